"""Training speed of each drafter variant: one TTT optimizer step (forward, backward, AdamW) on CPU.

SmolLM2-135M shapes (d=576, 9/3 heads, head_dim 64, SwiGLU 1536, vocab 49152, 16k draft vocabulary), random
target tensors (features, KV, last hidden and the cached top-1; no model load), bf16 autocast (fp32 on a CPU
without native bf16 matmuls; `--precision`), batch 1, every position scored (`--scored 0.5`: only the last half, as in a chat whose reply is half the tokens).
Prints per variant and length the K=7 and K=1 step times (median), their ratio, tokens/s and each variant's
overhead over eagle3, then one summary line.
Block drafters (`models.block`, one pass predicts block_size - 1 tokens): one `block_unroll` optimizer step per
context source and depth, against eagle3's K=7 step at the same 7 predicted tokens (block_size 8), over every
position as anchor or `--anchors N` random anchors per sequence; and the memory autograd keeps for backward at
block sizes 4, 8, 16 (linear in B: the same increase per block position).
overhead over eagle3; then loss tokens per second (`loss_throughput`): per variant on a realistic chat batch
and on the anchor's shape, the default (compact) unroll against the full one over every position (`--no-compare`
skips the latter), as multiples of the SpecForge anchor rebuilt in `benchmarks/anchor.py` and timed on the same batches, and one epoch of chats in plain and length-bucketed
order; then one summary line. On a machine shared with other work, `--threads 1 --clock process` (CPU time of
this process) gives steadier ratios than wall time.

    python benchmarks/train.py [--seqs 512 1024] [--variants eagle3 kv_only hybrid] [--repeats 3]
                               [--blocks hidden kv both] [--block-depths 1 2] [--anchors 0 128]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.anchor import AnchorEagle3  # noqa: E402
from models.block import block_unroll, sample_anchors  # noqa: E402
from models.build import build_drafter  # noqa: E402
from models.drafter import Drafter  # noqa: E402
from models.drafter_config import DrafterConfig  # noqa: E402
from models.ttt import ttt_unroll  # noqa: E402
from stages.common import native_bf16  # noqa: E402

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
# bf16 autocast where the CPU has native bf16 matmuls, else fp32 (emulated bf16 is many times slower: see
# benchmarks/precision.py); `--precision` chooses
BF16 = True


def autocast(bf16: bool | None = None):
    """bf16 autocast, or nothing for fp32; `bf16` None follows `--precision`."""
    return torch.autocast("cpu", dtype=torch.bfloat16) if (BF16 if bf16 is None else bf16) else nullcontext()


def as_fp32(data: dict) -> dict:
    """The batch with its float tensors (the KV pairs' too) in fp32: the cache stores bf16."""
    def f(v):
        if isinstance(v, list):
            return [tuple(f(t) for t in pair) for pair in v]
        return v.float() if torch.is_tensor(v) and v.is_floating_point() else v
    return {k: f(v) for k, v in data.items()}


def in_precision(data: dict) -> dict:
    """The batch as `--precision` trains on it."""
    return data if BF16 else as_fp32(data)


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
    hidden = torch.randn(1, T, d, generator=g).to(bf)
    return dict(input_ids=torch.randint(0, V, (1, T), generator=g), loss_mask=loss_mask,
                features=torch.randn(1, T, 3 * d, generator=g).to(bf), target_kv=kv,
                target_hidden=hidden, lm_head_weight=head, **cached_top1(hidden, head))


def cached_top1(hidden: torch.Tensor, head: torch.Tensor) -> dict:
    """What the feature cache stores beside the last hidden state: the target's full-vocabulary top-1."""
    top = torch.nn.functional.linear(hidden, head).max(-1)
    return dict(target_top1=top.indices, target_top1_logit=top.values.float())


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

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast():
        unroll(drafter, data, steps, anchors)
    return sum(seen.values())


def unroll(drafter, data: dict, steps: int | None, anchors: torch.Tensor | None = None):
    """One training pass: the K-step TTT unroll, or a block drafter's block_unroll (steps None)."""
    if drafter.config.variant == "block":
        return block_unroll(drafter, anchors=anchors, **data)
    return ttt_unroll(drafter, steps=steps, **data)


def median_step(loss_of, model: torch.nn.Module, opt, repeats: int, clock=time.perf_counter) -> float:
    """Median time of one optimizer step (forward `loss_of()`, backward, clip, AdamW) after a warm-up step."""
    times = []
    for i in range(repeats + 1):            # the first step warms up allocators and kernels
        t0 = clock()
        with autocast():
            loss = loss_of()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        if i:
            times.append(clock() - t0)
    return statistics.median(times)


def step_time(drafter: Drafter, opt, data: dict, steps: int | None, repeats: int,
              anchors: torch.Tensor | None = None) -> float:
    return median_step(lambda: unroll(drafter, data, steps, anchors).loss, drafter, opt, repeats)


# -- loss tokens per second: what a step trains, per variant ---------------------------------------------------

# The default profile's chats: one user turn of <= 256 prompt tokens (ShareGPT first turns in SmolLM2's chat
# template; quantiles 0, 10, 25, 50, 75, 90, 100% of those that fit) and an assistant answer of <= 96 new tokens
# plus its end-of-turn token, the loss on the answer; most answers reach the cap.
PROMPT_QUANTILES = ([0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0], [31, 36, 41, 51, 84, 137, 251])
MAX_ANSWER, CAPPED = 96, 0.7


def chat_lengths(n: int, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt, answer) token counts of n conversations drawn like the default profile's chats."""
    g = torch.Generator().manual_seed(seed)
    qs, vs = PROMPT_QUANTILES
    out = []
    for _ in range(n):
        u = float(torch.rand((), generator=g))
        j = max(i for i in range(len(qs) - 1) if qs[i] <= u)
        prompt = round(vs[j] + (vs[j + 1] - vs[j]) * (u - qs[j]) / (qs[j + 1] - qs[j]))
        capped = float(torch.rand((), generator=g)) < CAPPED
        answer = MAX_ANSWER if capped else int(torch.randint(16, MAX_ANSWER, (), generator=g))
        out.append((prompt, answer + 1))
    return out


def chat_batch(lengths: list[tuple[int, int]], d: int, V: int, seed: int = 0) -> dict:
    """A right-padded batch of chats (random target tensors as in `batch`), the loss on each answer."""
    g = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16
    B, T = len(lengths), max(p + a for p, a in lengths)
    head = torch.randn(V, d, generator=g) * d ** -0.5
    head[:16384] *= 3
    head = head.to(bf)
    attention_mask, loss_mask = torch.zeros(B, T), torch.zeros(B, T)
    for i, (p, a) in enumerate(lengths):
        attention_mask[i, :p + a] = 1
        loss_mask[i, p:p + a] = 1
    kv = [(torch.randn(B, 3, T, 64, generator=g).to(bf), torch.randn(B, 3, T, 64, generator=g).to(bf))
          for _ in range(3)]
    hidden = torch.randn(B, T, d, generator=g).to(bf)
    return dict(input_ids=torch.randint(0, V, (B, T), generator=g), loss_mask=loss_mask,
                attention_mask=attention_mask, features=torch.randn(B, T, 3 * d, generator=g).to(bf),
                target_kv=kv, target_hidden=hidden, lm_head_weight=head, **cached_top1(hidden, head))


def loss_tokens(data: dict) -> int:
    mask = data["loss_mask"].bool()
    return int((mask & data["attention_mask"].bool()).sum()) if "attention_mask" in data else int(mask.sum())


def timed_step(drafter: Drafter, opt, data: dict, repeats: int, clock, **kw) -> float:
    """Median time of one K=7 optimizer step (after a warm-up step) under `clock`."""
    return median_step(lambda: ttt_unroll(drafter, steps=7, **data, **kw).loss, drafter, opt, repeats, clock)


def anchor_step_time(data: dict, args, clock) -> float:
    """Median time of one K=7 optimizer step of the rebuilt SpecForge anchor (`benchmarks/anchor.py`) on `data`."""
    torch.manual_seed(0)
    model = AnchorEagle3(draft_vocab_size=args.draft_vocab, **SMOLLM2).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    return median_step(lambda: model(**data, steps=7), model, opt, args.repeats, clock)


def loss_throughput(args, clock, results: dict) -> list[str]:
    """Loss tokens/s per variant on a chat batch and on the anchor's shape, old (full) and new (compact) unroll,
    against the rebuilt SpecForge anchor timed on the same batches in this run (its seq-512 time from `results`
    when the step-time rows timed it on this very batch); then an epoch of chats in plain and bucketed order.
    Returns summary parts."""
    d, V = SMOLLM2["hidden_size"], SMOLLM2["vocab_size"]
    chats = chat_lengths(args.chat_batch, args.chat_seed)
    chat = in_precision(chat_batch(chats, d, V))
    B, T = chat["input_ids"].shape
    n_chat = loss_tokens(chat)
    real = int(chat["attention_mask"].sum())
    anchor_shape = in_precision(batch(512, d, V, 1.0))
    n_anchor = loss_tokens(anchor_shape)
    # the anchor trains one conversation per step without padding (SpecForge's batch size 1): time it on the same
    # chats one by one, which is cheaper for it than the padded batch
    alone = sum(anchor_step_time(in_precision(chat_batch([c], d, V)), args, clock) for c in chats)
    same = results.get((512, "anchor")) if args.scored == 1.0 and clock is time.perf_counter else None
    anchors = [n_chat / alone, n_anchor / (same or anchor_step_time(anchor_shape, args, clock))]
    print(f"\nloss tokens/s, K=7, {args.draft_vocab} draft vocabulary; the SpecForge anchor rebuilt "
          f"(benchmarks/anchor.py), timed here: the same chats one per step unpadded {anchors[0]:.0f}, "
          f"seq 512 {anchors[1]:.0f}")
    print(f"  chat batch: {B} chats (prompt+answer {', '.join(f'{p}+{a}' for p, a in chats)}), padded to {T}: "
          f"{n_chat} loss tokens = {n_chat / (B * T):.0%} of the {B * T} positions, {n_chat / real:.0%} of the "
          f"{real} real tokens; anchor shape: seq 512, batch 1, {n_anchor} loss tokens (100%)")
    head = "  variant          chat: full -> compact (x)   vs anchor |  seq 512: full -> compact (x)   vs anchor"
    print(head if args.compare else head.replace("full -> compact (x)", "compact"))
    parts, eagle3_chat = [], None
    for name in args.variants:
        torch.manual_seed(0)
        cfg = DrafterConfig(draft_vocab_size=args.draft_vocab, **VARIANTS[name], **SMOLLM2)
        drafter = Drafter(cfg).train()
        opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-4, fused=True)
        cols, rates = [], []
        for (data, n), anchor in zip(((chat, n_chat), (anchor_shape, n_anchor)), anchors):
            new = n / timed_step(drafter, opt, data, args.repeats, clock)
            if args.compare:
                old = n / timed_step(drafter, opt, data, args.repeats, clock, compact=False)
                cols.append(f"{old:5.0f} -> {new:5.0f} ({new / old:4.2f}x)   {new / anchor:4.2f}x")
            else:
                cols.append(f"{new:5.0f}   {new / anchor:4.2f}x")
            rates.append(new)
        print(f"  {name:15s}  " + "  |  ".join(cols), flush=True)
        if name == "eagle3":
            eagle3_chat = rates[0]
            parts.append(f"eagle3 loss tok/s chat {rates[0]:.0f} ({rates[0] / anchors[0]:.2f}x the anchor timed "
                         f"here), seq512 {rates[1]:.0f} ({rates[1] / anchors[1]:.2f}x)")
    if args.blocks:
        parts.append(block_loss_throughput(args, chat, n_chat, anchors[0], clock, eagle3_chat))
    if args.epoch_chats and "eagle3" in args.variants:
        parts.append(bucketed_epoch(args, clock))
    if "eagle3" in args.variants:
        parts.append(eval_throughput(args, chat, clock))
    return parts


def block_loss_throughput(args, chat: dict, n_chat: int, anchor: float, clock, eagle3: float | None) -> str:
    """Loss tokens/s of the block drafters on the chat batch as the trainer runs them (the blocks the loss reaches as
    anchors, the cached top-1 teacher): the study's block trial against its EAGLE-3 one, per context and depth."""
    anchors = sample_anchors(chat["loss_mask"], chat["attention_mask"], None, span=args.block_size - 1)
    out = []
    for context in args.blocks:
        for depth in args.block_depths:
            torch.manual_seed(0)
            drafter = build_drafter(block_config(context, depth, args.block_size, args.draft_vocab)).train()
            opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-4, fused=True)
            loss = lambda d=drafter: block_unroll(d, anchors=anchors, **chat).loss     # noqa: E731
            rate = n_chat / median_step(loss, drafter, opt, args.repeats, clock)
            vs = f"   {eagle3 / rate:4.2f}x eagle3's step" if eagle3 else ""
            print(f"  block/{context:6s} d{depth}   chat {rate:5.0f}   {rate / anchor:4.2f}x anchor{vs}", flush=True)
            out.append(f"{context}/d{depth} {rate:.0f}")
    return f"block{args.block_size} loss tok/s chat " + " ".join(out)


@torch.no_grad()
def eval_throughput(args, chat: dict, clock) -> str:
    """Step-wise evaluation of eagle3 on the chat batch: the full unroll's logits at every position with the
    target's full-vocabulary logits (the old stepwise masks) against the loss-free compact unroll."""
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig(draft_vocab_size=args.draft_vocab, **VARIANTS["eagle3"], **SMOLLM2)).eval()
    data = {k: v for k, v in chat.items() if k not in ("target_hidden", "lm_head_weight", "target_top1",
                                                        "target_top1_logit")}

    def old() -> None:
        logits = torch.nn.functional.linear(chat["target_hidden"], chat["lm_head_weight"])
        out = ttt_unroll(drafter, target_logits=logits, steps=7, return_logits=True, **data)
        logits.argmax(-1), [z.argmax(-1) for z in out.logits]

    def new() -> None:
        ttt_unroll(drafter, steps=7, score=False, **data)

    times = {}
    for name, f in (("old", old), ("new", new)):
        ts = []
        for i in range(args.repeats + 1):
            t0 = clock()
            with autocast():
                f()
            if i:
                ts.append(clock() - t0)
        times[name] = statistics.median(ts)
    n = loss_tokens(chat)
    print(f"  evaluation (eagle3, chat batch, no grad): full unroll with full target logits {n / times['old']:.0f} "
          f"loss tok/s -> loss-free compact unroll {n / times['new']:.0f} ({times['old'] / times['new']:.2f}x)",
          flush=True)
    return f"eval {times['old'] / times['new']:.2f}x faster"


def bucketed_epoch(args, clock) -> str:
    """eagle3 over one epoch of chats (batch 4): the plain seeded order against length-bucketed batches."""
    from stages.train import batch_indices

    d, V = SMOLLM2["hidden_size"], SMOLLM2["vocab_size"]
    chats = chat_lengths(args.epoch_chats, args.chat_seed + 1)
    lengths = [p + a for p, a in chats]
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig(draft_vocab_size=args.draft_vocab, **VARIANTS["eagle3"], **SMOLLM2)).train()
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-4, fused=True)
    steps = -(-len(chats) // 4)
    out = {}
    for window in (1, 8):
        total_t, total_n, positions = 0.0, 0, 0
        for step in range(steps):
            idx = batch_indices(step, len(chats), 4, 0, lengths, window)
            data = in_precision(chat_batch([chats[i] for i in idx], d, V, seed=step))
            total_t += timed_step(drafter, opt, data, 1, clock)
            total_n += loss_tokens(data)
            positions += data["input_ids"].numel()
        out[window] = (total_n / total_t, sum(lengths) / positions)
    (plain, fill_p), (bucketed, fill_b) = out[1], out[8]
    print(f"  eagle3, one epoch of {len(chats)} chats in batches of 4: plain order {plain:.0f} loss tok/s "
          f"({fill_p:.0%} of positions real), bucketed (window 8) {bucketed:.0f} ({fill_b:.0%} real): "
          f"{bucketed / plain:.2f}x", flush=True)
    return f"bucketed epoch {bucketed:.0f} loss tok/s ({bucketed / plain:.2f}x plain)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="*", default=[512, 1024], help="step-time lengths (none: skip them)")
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
    ap.add_argument("--chat-batch", type=int, default=4, help="chats in the loss-throughput batch (0: skip it)")
    ap.add_argument("--chat-seed", type=int, default=0)
    ap.add_argument("--epoch-chats", type=int, default=32, help="chats in the bucketing epoch (0: skip it)")
    ap.add_argument("--no-compare", dest="compare", action="store_false",
                    help="loss throughput of the default unroll only, not the full unroll beside it")
    ap.add_argument("--clock", choices=["wall", "process"], default="wall",
                    help="loss throughput timed in wall time or this process's CPU time")
    ap.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                    help="bf16 autocast or fp32 (auto: bf16 where the CPU has native bf16 matmuls)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    global BF16
    BF16 = args.precision == "bf16" or (args.precision == "auto" and native_bf16("cpu"))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {'bf16 autocast' if BF16 else 'fp32'}, "
          f"batch 1, {args.scored:.0%} of positions scored")
    results: dict = {}
    for T in args.seqs:
        data = in_precision(batch(T, SMOLLM2["hidden_size"], SMOLLM2["vocab_size"], args.scored))
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
        if (T, "eagle3") in results:
            a = results[(T, "anchor")] = anchor_step_time(data, args, time.perf_counter)
            print(f"seq {T:5d} eagle3 vs the SpecForge anchor timed here (K=7 {a:.3f} s): "
                  f"{a / results[(T, 'eagle3')][0]:4.2f}x faster")
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
    if args.chat_batch:
        parts += loss_throughput(args, time.process_time if args.clock == "process" else time.perf_counter, results)
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
