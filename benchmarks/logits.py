"""The target's logits over the few positions a verification scores: `F.linear` against the same product in other
layouts, on this CPU.

Speculative verification asks the target's lm_head (SmolLM2: 49,152 x 576, tied to the embedding) for the logits
of the k + 1 positions of a chain, a handful of rows. Which matrix-multiply kernel PyTorch picks for so few rows
depends on the layout of the operands, and on some CPUs `F.linear` (what transformers' lm_head and kvshot's
`Target.logits` call) is several times slower than the same product written as `W @ hᵀ`. This prints, per row
count, the median time of each form and the ratio to `F.linear`, then one verification forward of a 4-token chain
with the lm_head as it is and as `W @ hᵀ` (the greedy tokens must not change).

    .venv/bin/python benchmarks/logits.py [--dtype float32] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def median_ms(fn, repeats: int = 30) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


class TransposedLinear(torch.nn.Module):
    """A bias-free linear computed as `W @ hᵀ` (the same weight, shared)."""

    def __init__(self, linear: torch.nn.Module):
        super().__init__()
        self.weight = linear.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        flat = h.reshape(-1, h.shape[-1])
        return (self.weight @ flat.t()).t().reshape(*h.shape[:-1], -1)


@torch.no_grad()
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    from models.decoding.tree import chain_tree
    from models.decoding.verify import cache_length, prefill, verify
    from models.target import load_target

    target = load_target("embedded", args.dtype, cache_dir=ROOT / "scratch" / "models")
    weight = target.lm_head.weight.detach()
    weight_t = weight.t().contiguous()
    print(f"lm_head {tuple(weight.shape)} {args.dtype}, {args.threads} threads: ms per call (ratio to F.linear)")
    ratios = {}
    for rows in (1, 2, 4, 8):
        h = torch.randn(rows, weight.shape[1], dtype=dtype)
        base = median_ms(lambda: torch.nn.functional.linear(h, weight))
        transposed = median_ms(lambda: weight @ h.t())
        contiguous = median_ms(lambda: h @ weight_t)
        ratios[rows] = base / transposed
        print(f"  {rows} row(s): F.linear {base:.2f}; W @ hᵀ {transposed:.2f} ({transposed / base:.2f}); "
              f"h @ Wᵀ (contiguous copy) {contiguous:.2f} ({contiguous / base:.2f})")

    prompt = torch.tensor(target.chat_ids([{"role": "user", "content": "Explain how a transformer language model "
                                            "works, step by step."}], add_generation_prompt=True))
    cap, _ = prefill(target, prompt)
    cache, past = cap.cache, cache_length(cap.cache)
    tree = chain_tree(1, [2, 3, 4])

    def verified() -> list[int]:
        v = verify(target, tree, cache)
        cache.crop(past - cache_length(cache))
        return v.argmax.tolist()

    as_is, tokens = median_ms(verified, 15), verified()
    original = target.model.lm_head
    target.model.lm_head = TransposedLinear(original)
    swapped, swapped_tokens = median_ms(verified, 15), verified()
    target.model.lm_head = original
    print(f"verification of a 4-token chain: {as_is:.1f} ms as is, {swapped:.1f} ms with W @ hᵀ "
          f"({swapped / as_is:.2f}); greedy tokens {'the same' if tokens == swapped_tokens else 'DIFFERENT'}")
    print(f"\nSUMMARY logits {args.dtype}: W @ hᵀ over F.linear speed " +
          ", ".join(f"{r} rows {x:.2f}x" for r, x in ratios.items()) + f"; 4-token verify {as_is / swapped:.2f}x")


if __name__ == "__main__":
    main()
