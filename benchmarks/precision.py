"""bf16 against fp32 on this CPU, for the work the pipeline does: is bf16 the fast choice here?

bf16 is only fast on CPUs with native bf16 matmuls (AVX512_BF16 or AMX: what oneDNN reports as bf16 support);
elsewhere (AVX2-only CPUs, most laptops) PyTorch emulates it and bf16 is several times slower than fp32.
Measures, interleaved in one run so that load on a shared machine hits both alike (median of `--repeats`):
  * a target forward with hidden states and KV (the features stage: batch 8, `--tokens` tokens),
  * one decode step of the target at batch 16 after 120 tokens (regeneration), at batch 1 after 300 tokens, and
    one verification of 8 tokens after 300 (speculative decoding, e2e),
  * one eagle3 TTT optimizer step on a chat batch (the train stage; bf16 autocast vs plain fp32).
Prints each time, the fp32 speed-up (bf16 time / fp32 time) and one summary line.

    python benchmarks/precision.py [--repeats 3] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.train import SMOLLM2, as_fp32, autocast, chat_batch, chat_lengths  # noqa: E402
from models.build import build_drafter  # noqa: E402
from models.drafter_config import DrafterConfig  # noqa: E402
from models.target import load_target  # noqa: E402
from models.ttt import ttt_unroll  # noqa: E402
from stages.common import native_bf16  # noqa: E402


def seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def target_jobs(dtype: str, tokens: int) -> dict:
    target = load_target("embedded", dtype=dtype, cache_dir=ROOT / "scratch" / "models")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (8, tokens), generator=g)
    prefix = torch.randint(0, target.vocab_size, (1, 300), generator=g)
    batch = torch.randint(0, target.vocab_size, (16, 120), generator=g)
    with torch.no_grad():
        cache = target.model(input_ids=prefix, use_cache=True).past_key_values
        batch_cache = target.model(input_ids=batch, use_cache=True).past_key_values

    def forward():
        with torch.no_grad():
            target.capture(ids)

    def decode():
        with torch.no_grad():
            target.model(input_ids=prefix[:, -1:], past_key_values=cache, use_cache=True)
            cache.crop(-1)

    def verify():
        with torch.no_grad():
            target.model(input_ids=prefix[:, -8:], past_key_values=cache, use_cache=True)
            cache.crop(-8)

    def decode_batch():
        with torch.no_grad():
            target.model(input_ids=batch[:, -1:], past_key_values=batch_cache, use_cache=True)
            batch_cache.crop(-1)

    return {"target forward (features)": forward, "decode step, batch 16 (regenerate)": decode_batch,
            "decode step, batch 1 (e2e)": decode, "verify 8 tokens (e2e)": verify}


def train_job(bf16: bool) -> dict:
    d, V = SMOLLM2["hidden_size"], SMOLLM2["vocab_size"]
    data = chat_batch(chat_lengths(4, 0), d, V)
    data = data if bf16 else as_fp32(data)
    drafter = build_drafter(DrafterConfig(variant="eagle3", draft_vocab_size=16384, **SMOLLM2))
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4)

    def step():
        with autocast(bf16):
            out = ttt_unroll(drafter, steps=7, **data)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()

    return {"eagle3 train step (train)": step}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=192)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {torch.backends.cpu.get_cpu_capability()}, native bf16: {native_bf16()}, {args.threads} threads")
    jobs = {"bf16": {**target_jobs("bfloat16", args.tokens), **train_job(True)},
            "fp32": {**target_jobs("float32", args.tokens), **train_job(False)}}
    ratios = []
    for name in jobs["bf16"]:
        for p in ("bf16", "fp32"):
            jobs[p][name]()                # warm-up: allocators, kernels, oneDNN primitives
        times = {"bf16": [], "fp32": []}
        for _ in range(args.repeats):      # interleave the two precisions round by round
            for p in ("bf16", "fp32"):
                times[p].append(seconds(jobs[p][name]))
        bf, fp = statistics.median(times["bf16"]), statistics.median(times["fp32"])
        ratios.append(bf / fp)
        print(f"{name:32s} bf16 {bf * 1e3:9.1f} ms   fp32 {fp * 1e3:9.1f} ms   fp32 speed-up {bf / fp:6.2f}x")
    print(f"SUMMARY precision: native bf16 {native_bf16()}; fp32 speed-up over bf16 "
          + ", ".join(f"{n.split(' (')[0]} {r:.2f}x" for n, r in zip(jobs["bf16"], ratios)))


if __name__ == "__main__":
    main()
