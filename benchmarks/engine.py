"""Where the time goes when vLLM serves a kvshot drafter, beside kvshot's own decoding loop with the same drafter.

Both engines decode the same prompts greedily, plainly and with the drafter as a chain of k draft tokens, through
the e2e stage's engine part (`stages.engine.run_engines`: vLLM's CPU build in its own environment, batch 1). Per
drafter and k it prints acceptance in both engines, tokens/s and speedups over each engine's own plain decoding,
and the time per round split into its parts: for vLLM the proposer's hooks (copying the target's KV and hidden
states), its drafting (kvshot's proposer code, the same as in kvshot's loop) and the rest (the target's step, the
scheduler, sampling and rejection); for kvshot drafting and verification. An EAGLE-3 head is served by vLLM's own
EAGLE-3 proposer (its `eagle3` export), whose drafting is inside vLLM's step and is not split out.

Without --run-dir it trains an EAGLE-3 head and a KV-only drafter for a few steps on the target's own greedy
answers to the measured prompts (so they draft those answers well: the split of a round's time, not the acceptance,
is what such a run measures). With --run-dir it serves trained runs (runs/<study>/<trial>), e.g. a study's
strongest drafters. fp32 by default: it is native on every CPU, and in fp32 both engines' greedy outputs agree.

    .venv/bin/python benchmarks/engine.py [--run-dir runs/scale/<trial> ...] [--prompts 4] [--max-new-tokens 48]
                                          [--draft-tokens 1 3] [--dtype float32] [--compiled]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from benchmarks.e2e import sharegpt_prompts  # noqa: E402
from models.decoding import greedy_generate  # noqa: E402
from models.target import load_target  # noqa: E402
from stages.common import Paths, TargetParams  # noqa: E402


def memorising_drafters(tgt, params: TargetParams, prompts: list, n_new: int, work: Path, k: int) -> list[Path]:
    """An EAGLE-3 head and a KV-only drafter trained briefly on the target's own answers to `prompts`."""
    from stages.train import DrafterParams, TrainParams, online_source, run

    answers = [greedy_generate(tgt, p, n_new + 8).tokens for p in prompts]
    convs = [(p.tolist() + a, [False] * len(p) + [True] * len(a)) for p, a in zip(prompts, answers)] * 4
    out = []
    for variant in ("eagle3", "kv_only"):
        run_dir = work / "runs" / "engine-bench" / f"{variant}-memorised"
        run(DrafterParams(variant=variant, draft_vocab_size=2048),
            TrainParams(max_steps=48, batch_size=2, lr=3e-3, precision="fp32", log_every=1000,
                        checkpoint_every=1000, warmup_ratio=0.1, ttt_steps=k), run_dir, Paths(run_dir.parent),
            lambda *a, **kw: None, target=params, source=online_source(tgt, convs), loaded_target=tgt)
        out.append(run_dir)
    return out


def per_round_ms(row: dict) -> dict[str, float]:
    """Milliseconds per round (per prompt summed, then over all rounds) of each part of both engines' decoding."""
    pp = row["per_prompt"]
    v_rounds, k_rounds = sum(pp["drafts"]) or 1, sum(pp["kvshot_rounds"]) or 1
    out = {"vllm": 1e3 * sum(pp["seconds"]) / v_rounds, "kvshot": 1e3 * sum(pp["kvshot_seconds"]) / k_rounds,
           "kvshot draft": 1e3 * sum(pp["kvshot_draft_seconds"]) / k_rounds,
           "kvshot verify": 1e3 * sum(pp["kvshot_verify_seconds"]) / k_rounds}
    if "proposer_draft_seconds" in pp:
        out["vllm hooks"] = 1e3 * sum(pp["proposer_hook_seconds"]) / v_rounds
        out["vllm draft"] = 1e3 * sum(pp["proposer_draft_seconds"]) / v_rounds
        out["vllm rest"] = out["vllm"] - out["vllm hooks"] - out["vllm draft"]
    return out


def plain_ms_per_token(row: dict) -> tuple[float, float]:
    """(vLLM, kvshot) milliseconds per token of plain greedy decoding on the same prompts."""
    return 1e3 / row["plain_tokens_per_s"], 1e3 / row["kvshot_greedy_tokens_per_s"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", type=Path, action="append", default=[], help="a trained run (repeatable)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--draft-tokens", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compiled", action="store_true",
                    help="serve EAGLE-3 exports with vLLM's compiled graphs (minutes of warm-up on 2 cores); the "
                         "kvshot proposer route is always eager (its hooks must run)")
    ap.add_argument("--workspace", type=Path, default=ROOT, help="the workspace whose held-out prompts to decode")
    args = ap.parse_args(argv)

    from stages.engine import run_engines

    torch.set_num_threads(args.threads)
    work = ROOT / "scratch" / "bench-engine"
    params = TargetParams(source="embedded", dtype=args.dtype)
    tgt = load_target(params.source, params.dtype, cache_dir=ROOT / "scratch" / "models")
    prompts = [torch.tensor(tgt.chat_ids([{"role": "user", "content": t}], add_generation_prompt=True))
               for t in sharegpt_prompts(args.prompts, workspace=args.workspace)]
    run_dirs = args.run_dir or memorising_drafters(tgt, params, prompts, args.max_new_tokens, work,
                                                    max(args.draft_tokens))
    settings = [{"trial": d.name} for d in run_dirs]
    rows = run_engines(args.draft_tokens, run_dirs, settings, prompts, tgt, params, args.dtype, args.max_new_tokens,
                       Paths(root=work), eager=not args.compiled)

    print(f"\n{len(prompts)} prompts x {args.max_new_tokens} tokens, {args.dtype}, batch 1, {args.threads} threads")
    print("| drafter | k | vLLM route | lossless | τ vLLM | τ kvshot | speedup vLLM | speedup kvshot "
          "| ms/round vLLM (hooks + draft + rest) | ms/round kvshot (draft + verify) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        if row["status"] != "ok":
            print(f"| {row['trial']} | {row.get('draft_tokens')} | not served: {row.get('error')} |")
            continue
        ms = per_round_ms(row)
        split = (f"{ms['vllm']:.1f} ({ms['vllm hooks']:.1f} + {ms['vllm draft']:.1f} + {ms['vllm rest']:.1f})"
                 if "vllm draft" in ms else f"{ms['vllm']:.1f} (not split)")
        print(f"| {row['trial']} | {row['draft_tokens']} | {row['engine_route']} | {row['lossless']} "
              f"| {row['tau']:.3f} | {row['kvshot_tau']:.3f} | {row['speedup']:.2f}x | {row['kvshot_speedup']:.2f}x "
              f"| {split} | {ms['kvshot']:.1f} ({ms['kvshot draft']:.1f} + {ms['kvshot verify']:.1f}) |")
    plain = {row["engine_route"]: plain_ms_per_token(row) for row in rows if row["status"] == "ok"}
    for route, (v, k) in plain.items():
        print(f"plain greedy ms/token ({route} route's plain run): vLLM {v:.1f}, kvshot {k:.1f} "
              f"(kvshot/vLLM {k / v:.2f})")
    parts = [f"{r['trial']} k={r['draft_tokens']} speedup vLLM {r['speedup']:.2f}x kvshot {r['kvshot_speedup']:.2f}x"
             + (f" (proposer {100 * r['proposer_share']:.0f}% of vLLM's time)" if r.get("proposer_share") else "")
             for r in rows if r["status"] == "ok"]
    print(f"\nSUMMARY engine {args.dtype} {len(prompts)} prompts x {args.max_new_tokens} tokens: " + "; ".join(parts))


if __name__ == "__main__":
    main()
