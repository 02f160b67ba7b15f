"""Regeneration throughput: the stage's batched, length-sorted generation vs plain batch-1 `model.generate`.

Same target, same prompts (first user turns of the packaged ShareGPT), same max_new_tokens, greedy, one run.
Prints one summary line: stage tokens/s, baseline tokens/s and their ratio (target >= 5x on a 2-core CPU).
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from models.target import load_target
from stages.common import Paths, TargetParams
from stages.regenerate import regenerate_rows
from stages.regenerate_backends import RegenerateParams, TransformersBackend
from stages.prepare import sample_conversations

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--baseline-prompts", type=int, default=4, help="batch-1 baseline on the first N (it is slow)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target("embedded", cache_dir=ROOT / "scratch" / "models")
    rows = sample_conversations(args.prompts, 600)
    params = RegenerateParams(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, window=8,
                              max_prompt_tokens=2048)
    backend = TransformersBackend(target, params)
    # baseline: one prompt at a time through plain generate, tokens counted the same way (up to eos)
    t0, base_tokens = time.perf_counter(), 0
    for r in rows[:args.baseline_prompts]:
        ids = torch.tensor([target.chat_ids(r["messages"][:1], add_generation_prompt=True)])
        out = target.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                    generation_config=backend.gen_config)
        base_tokens += backend._decode(out[0, ids.shape[1]:].tolist()).tokens
    base_tps = base_tokens / (time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        stats = regenerate_rows(rows, Path(tmp) / "out.jsonl", params, TargetParams(), Paths(Path(tmp)),
                                backend=backend, label="stage")
        stage_tps = stats["new_tokens"] / (time.perf_counter() - t0)
    print(f"regenerate: stage {stage_tps:.1f} tok/s ({len(rows)} prompts, batch {args.batch_size}) vs batch-1 "
          f"generate {base_tps:.1f} tok/s ({args.baseline_prompts} prompts) = {stage_tps / base_tps:.2f}x "
          f"(max_new_tokens {args.max_new_tokens}, {args.threads} threads)")


if __name__ == "__main__":
    main()
