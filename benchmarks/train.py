"""Training speed of each drafter variant: one TTT optimizer step (forward, backward, AdamW) on CPU.

SmolLM2-135M shapes (d=576, 9/3 heads, head_dim 64, SwiGLU 1536, vocab 49152, 16k draft vocabulary), random
target tensors (features, KV, last hidden; no model load), bf16 autocast, batch 1, every position scored
(`--scored 0.5`: only the last half, as in a chat whose reply is half the tokens).
Prints per variant and length the K=7 and K=1 step times (median), their ratio, tokens/s and each variant's
overhead over eagle3, then one summary line.
Block drafters (`models.block`, one pass predicts block_size - 1 tokens): one `block_unroll` optimizer step per
context source and depth, against eagle3's K=7 step at the same 7 predicted tokens (block_size 8), over every
position as anchor or `--anchors N` random anchors per sequence; and the memory autograd keeps for backward at
block sizes 4, 8, 16 (linear in B: the same increase per block position).

    python benchmarks/train.py [--seqs 512 1024] [--variants eagle3 kv_only hybrid] [--repeats 3]
                               [--blocks hidden kv both] [--block-depths 1 2] [--anchors 0 128]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.block import block_unroll, sample_anchors  # noqa: E402
from models.drafter import Drafter, DrafterConfig, build_drafter  # noqa: E402
from models.ttt import ttt_unroll  # noqa: E402

SMOLLM2 = dict(hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152,
               rms_norm_eps=1e-5, rope_theta=100000.0)
VARIANTS = {
    "eagle3": dict(variant="eagle3"),
    "kv_only": dict(variant="kv_only"),
    "kv_only+fix": dict(variant="kv_only", rope_fix=True),
    "kv_only/concat": dict(variant="kv_only", injection="head_concat"),
    "hybrid": dict(variant="hybrid"),
    "cross_only": dict(variant="cross_only"),
}
# the anchor: SpecForge's own eagle3 TTT on this machine (bf16 autocast, no compile), seconds per step
ANCHOR = {512: {7: 0.92, 1: 0.29}, 1024: {7: 3.83, 1: 0.83}}


def batch(T: int, d: int, V: int, scored: float = 1.0, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16
    # the draft vocabulary is ids 0..16k-1 (the default d2t): make the target's argmax land there, as the
    # frequency-chosen vocabulary does for ~all real tokens, so every position is scored
    head = torch.randn(V, d, generator=g) * d ** -0.5
    head[:16384] *= 3
    head = head.to(bf)
    kv = [(torch.randn(1, 3, T, 64, generator=g).to(bf), torch.randn(1, 3, T, 64, generator=g).to(bf))
          for _ in range(3)]
    loss_mask = torch.zeros(1, T)
    loss_mask[:, T - int(round(scored * T)):] = 1          # the reply: the last `scored` share of the tokens
    return dict(input_ids=torch.randint(0, V, (1, T), generator=g), loss_mask=loss_mask,
                features=torch.randn(1, T, 3 * d, generator=g).to(bf), target_kv=kv,
                target_hidden=torch.randn(1, T, d, generator=g).to(bf),
                lm_head_weight=head)


def eagle3_flops(T: int, K: int, Vd: int, d: int = 576, H: int = 9, Hkv: int = 3, hd: int = 64,
                 inter: int = 1536, V: int = 49152) -> float:
    """Matmul FLOPs of one eagle3 TTT step: the target's logits once (forward only), fc once (no input grad),
    then K x (decoder layer + draft head) forward and backward (3x the forward), causal attention at T/2 keys
    plus the chain. The K7/K1 ratio of this count is the floor of the measured ratio when nothing else costs."""
    target = 2 * T * d * V
    fc = 2 * (2 * T * 3 * d * d)
    layer = 2 * T * (2 * d * (H + 2 * Hkv) * hd + H * hd * d + 3 * d * inter)
    attn = lambda k: 2 * 2 * T * H * hd * (T / 2 + k)   # noqa: E731  QK^T and PV
    head = 2 * T * d * Vd
    return target + fc + sum(3 * (layer + attn(k) + head) for k in range(K))


def saved_bytes(drafter: Drafter, data: dict, steps: int | None = None, anchors: torch.Tensor | None = None) -> int:
    """Bytes autograd keeps for the backward pass of one unroll (distinct storages): the memory that grows with K
    (for a block drafter, steps=None: one block_unroll pass, growing with the block size)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        unroll(drafter, data, steps, anchors)
    return sum(seen.values())


def unroll(drafter, data: dict, steps: int | None, anchors: torch.Tensor | None = None):
    """One training pass: the K-step TTT unroll, or a block drafter's block_unroll (steps None)."""
    if drafter.config.variant == "block":
        return block_unroll(drafter, anchors=anchors, **data)
    return ttt_unroll(drafter, steps=steps, **data)


def step_time(drafter: Drafter, opt, data: dict, steps: int | None, repeats: int,
              anchors: torch.Tensor | None = None) -> float:
    times = []
    for i in range(repeats + 1):            # the first step warms up allocators and kernels
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = unroll(drafter, data, steps, anchors)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 0.5)
        opt.step()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--draft-vocab", type=int, default=16384)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--scored", type=float, default=1.0, help="share of positions in the loss mask")
    ap.add_argument("--blocks", nargs="*", default=["hidden", "kv", "both"], choices=["hidden", "kv", "both"],
                    help="block drafter context sources to time (none: skip the block rows)")
    ap.add_argument("--block-depths", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--anchors", type=int, nargs="+", default=[0], help="anchors per sequence (0: every position)")
    ap.add_argument("--memory-sizes", type=int, nargs="*", default=[4, 8, 16],
                    help="block sizes whose saved-for-backward memory is measured (first --blocks context, depth 1)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, bf16 autocast, batch 1, "
          f"{args.scored:.0%} of positions scored")
    results: dict = {}
    for T in args.seqs:
        data = batch(T, SMOLLM2["hidden_size"], SMOLLM2["vocab_size"], args.scored)
        for name in args.variants:
            torch.manual_seed(0)
            cfg = DrafterConfig(draft_vocab_size=args.draft_vocab, **VARIANTS[name], **SMOLLM2)
            drafter = Drafter(cfg).train()
            opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-4, fused=True)
            t7 = step_time(drafter, opt, data, 7, args.repeats)
            t1 = step_time(drafter, opt, data, 1, args.repeats)
            results[(T, name)] = (t7, t1)
            base = results.get((T, "eagle3"))
            over = f"{t7 / base[0] - 1:+6.1%} vs eagle3" if base and name != "eagle3" else ""
            if name == "eagle3":
                f7, f1 = eagle3_flops(T, 7, args.draft_vocab), eagle3_flops(T, 1, args.draft_vocab)
                over = f"(matmul FLOPs K7/K1 {f7 / f1:4.2f}x, {f7 / t7 / 1e9:4.0f} GFLOP/s at K=7)"
                mem = {k: saved_bytes(drafter, data, k) / 2 ** 20 for k in (1, 4, 7)}
                over += (f"\n           saved for backward: K=1 {mem[1]:.0f} MiB, K=4 {mem[4]:.0f} MiB, K=7 {mem[7]:.0f} MiB "
                         f"(+{(mem[4] - mem[1]) / 3:.0f} and +{(mem[7] - mem[4]) / 3:.0f} MiB per step: linear in K)")
            print(f"seq {T:5d} {name:15s} K=7 {t7:6.3f} s  K=1 {t1:6.3f} s  K7/K1 {t7 / t1:4.2f}x  "
                  f"{T / t7:7.0f} tok/s  {over}", flush=True)
        if (T, "eagle3") in results and T in ANCHOR:
            t7, t1 = results[(T, "eagle3")]
            a = ANCHOR[T]
            print(f"seq {T:5d} eagle3 vs SpecForge anchor: K=7 {a[7] / t7:4.2f}x faster, K=1 {a[1] / t1:4.2f}x faster")
        block_rows(T, data, args, results)
    parts = []
    for T in args.seqs:
        if (T, "eagle3") in results:
            t7, t1 = results[(T, "eagle3")]
            parts.append(f"eagle3@{T} K7 {t7:.2f}s K7/K1 {t7 / t1:.2f}x")
        overs = [results[(T, n)][0] / results[(T, "eagle3")][0] - 1 for n in args.variants
                 if n != "eagle3" and (T, n) in results and (T, "eagle3") in results]
        if overs:
            parts.append(f"KV overhead@{T} {min(overs):+.0%}..{max(overs):+.0%}")
        blocks = {key: t for key, t in results.items() if key[0] == T and isinstance(key[1], tuple)}
        if blocks:
            ref = results.get((T, "eagle3"), (None,))[0]
            vs = f" vs eagle3 K7 {ref:.2f}s" if ref else ""
            parts.append(f"block{args.block_size}@{T} " + " ".join(
                f"{c}/d{d}/{a or 'all'} {t:.2f}s" for (_, (c, d, a)), t in blocks.items()) + vs)
        if (T, "block-memory") in results:
            parts.append("block saved-for-backward " + ", ".join(f"B={b} {m:.0f} MiB"
                                                                  for b, m in results[(T, "block-memory")].items()))
    print("SUMMARY train: " + "; ".join(parts))


def block_config(context: str, depth: int, block_size: int, draft_vocab: int) -> DrafterConfig:
    return DrafterConfig(variant="block", context=context, depth=depth, block_size=block_size,
                         draft_vocab_size=draft_vocab, **SMOLLM2)


def block_rows(T: int, data: dict, args, results: dict) -> None:
    """Block drafters at this length: step time per context, depth and anchor count vs eagle3's K=7 step; then the
    memory saved for backward per block size."""
    base = results.get((T, "eagle3"))
    for n_anchors in args.anchors:
        anchors = None if not n_anchors else sample_anchors(data["loss_mask"], None, n_anchors,
                                                            torch.Generator().manual_seed(0))
        for context in args.blocks:
            for depth in args.block_depths:
                torch.manual_seed(0)
                drafter = build_drafter(block_config(context, depth, args.block_size, args.draft_vocab)).train()
                opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-4, fused=True)
                t = step_time(drafter, opt, data, None, args.repeats, anchors)
                results[(T, (context, depth, n_anchors))] = t
                over = f"{t / base[0] - 1:+6.1%} vs eagle3 K=7" if base else ""
                which = f"{n_anchors} anchors" if n_anchors else "all anchors"
                print(f"seq {T:5d} block/{context:6s} d{depth} B={args.block_size} ({args.block_size - 1} tokens, "
                      f"{which}) {t:6.3f} s  {T / t:7.0f} tok/s  {over}", flush=True)
    if args.memory_sizes and args.blocks:
        context = args.blocks[0]
        mem = {}
        for size in args.memory_sizes:
            torch.manual_seed(0)
            drafter = build_drafter(block_config(context, 1, size, args.draft_vocab)).train()
            mem[size] = saved_bytes(drafter, data) / 2 ** 20
        sizes = sorted(mem)
        per = [f"+{(mem[b] - mem[a]) / (b - a):.0f}" for a, b in zip(sizes, sizes[1:])]
        print(f"seq {T:5d} block/{context} d1 saved for backward: "
              + ", ".join(f"B={b} {mem[b]:.0f} MiB" for b in sizes)
              + f" ({' and '.join(per)} MiB per block position: linear in B)", flush=True)
        results[(T, "block-memory")] = mem


if __name__ == "__main__":
    main()
