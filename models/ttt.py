"""Autoregressive test-time training (TTT): the K-step unroll over all positions in parallel (DESIGN §6).

One implementation for every drafter variant. Step k runs the drafter once over all T positions:
- input token at position t is token t+1+k (teacher-forced), RoPE position `pos(t) + 1 + k`;
- hidden input (eagle3 family) is fc(features) at step 0 and the drafter's own output hidden of step k-1 after;
- keys: the self branch sees the step-0 keys of positions <= t (one T x T causal block, shared by all steps)
  plus its own keys of steps 1..k at the same position t; the cross branch sees the injected target KV of
  positions <= t (T x T causal) plus its own cross keys of steps 0..k at t (the token_context control's cross
  branch is laid out as a self branch: step-0 keys of positions <= t, its own keys of steps 1..k at t). The
  same-position keys are diag blocks of `models.layers.attend` (O(T) dot products each), merged with the causal
  block in one softmax, so no (K*T) x (K*T) mask or score matrix is ever built;
- target: the target's next-token distribution for token t+2+k, i.e. its logits at position t+1+k,
  restricted to the draft vocabulary and renormalised;
- scored where token t+2+k exists, is a loss-masked (assistant) token and not padding, and the target's
  argmax at t+1+k lies inside the draft vocabulary. loss_k = mean soft cross-entropy over those positions,
  total = Σ_k decay^k loss_k; acc/α counts (`models.metrics`) over the same positions.

Only what carries loss is computed (`ttt_unroll`'s default, compact path). Step k >= 1 at position t matters only
if some step k' >= k is scored at t (the chain at t is its own; later positions' prefix keys are step-0 keys), so
steps 1..K-1 run on the rows of those positions alone (projections, MLP; the queries are scattered into the [T]
layout for the fused attention call only); step 0 computes its keys everywhere and the rest of its last layer at
those positions; the head, the loss and the target's teacher distribution run on scored rows only. With the
target's full-vocabulary top-1 from the feature cache (`target_top1`, `target_top1_logit`) the teacher needs only
the draft-vocabulary logits. The losses, counts and gradients are those of the full unroll over every position
(`compact=False`, also the `return_logits` path), which tests hold it to.

Inputs are plain tensors so the train stage can feed the offline cache or an online target.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.context import QueryContext
from models.drafter import Drafter
from models.layers import KeyBlock, expand_heads, take_rows
from models.metrics import StepCounts, step_counts


@dataclass
class TTTOutput:
    loss: torch.Tensor | None              # scalar, Σ_k decay^k loss_k (differentiable); None when not scored
    losses: list[float]                    # loss_k
    counts: StepCounts | None              # acc_k / α_k numerators and denominators (None when not scored)
    gate_means: dict[int, float]           # hybrid: mean gate per layer over steps and the positions computed
    logits: list[torch.Tensor] | None = None   # per step [B, T, V_draft] when return_logits
    top1: list[torch.Tensor] | None = None     # score=False: per step [B, T] draft index of the drafter's top-1,
                                               # -1 where step k is not evaluated

    @property
    def acc(self) -> list[float]:
        return self.counts.acc

    @property
    def alpha(self) -> list[float]:
        return self.counts.alpha


class _TTTContext(QueryContext):
    """Key blocks for the parallel unroll: a causal T x T block plus per-position diag blocks."""

    def __init__(self, drafter: Drafter, causal: torch.Tensor | None, target_kv, position_ids: torch.Tensor):
        super().__init__(drafter)
        self.causal = causal                            # None: right padding, the plain causal triangle serves
        self.target_kv, self.position_ids = target_kv, position_ids
        self.k = 0
        self.dense0: dict = {}
        self.diag: dict = {}
        self.prefix: dict = {}
        self.gates: dict = {}

    def _prefix(self, k, v) -> KeyBlock:
        return KeyBlock(k, v, causal=True) if self.causal is None else KeyBlock(k, v, self.causal)

    def _chain(self, key, k, v) -> KeyBlock:
        """Append this step's same-position key to the chain: one [B, H, T, J, hd] tensor, one diag block."""
        k, v = k.unsqueeze(3), v.unsqueeze(3)
        old = self.diag.get(key)
        if old is not None:
            k, v = torch.cat([old[0], k], 3), torch.cat([old[1], v], 3)
        self.diag[key] = (k, v)
        return KeyBlock(k, v, diag=True)

    def self_blocks(self, attn, k, v, rows=None) -> list[KeyBlock]:
        K, V = expand_heads(k, attn.hmap), expand_heads(v, attn.hmap)
        if self.k == 0:
            self.dense0[attn.layer] = (K, V)
            return [self._prefix(K, V)]
        return [self._prefix(*self.dense0[attn.layer]), self._chain((attn.layer, "self"), K, V)]

    def own_prefix(self, attn, k, v, rows=None) -> list[KeyBlock]:
        return self.self_blocks(attn, k, v, rows)       # its own step-0 keys are the prefix

    def target_prefix(self, attn, rows=None) -> KeyBlock:
        if attn.layer not in self.prefix:
            if self.target_kv is None:
                raise ValueError(f"ttt_unroll: variant {self.drafter.config.variant!r} needs target_kv")
            cos, sin = self.drafter.rope_for_target(self.position_ids)
            pk, pv = attn.inject(self.target_kv, cos, sin)
            self.prefix[attn.layer] = (expand_heads(pk, attn.hmap), expand_heads(pv, attn.hmap))
        return self._prefix(*self.prefix[attn.layer])

    def own_chain(self, attn, k, v, rows=None) -> KeyBlock:
        return self._chain((attn.layer, "cross"), expand_heads(k, attn.hmap), expand_heads(v, attn.hmap))

    def record_gate(self, layer: int, g: torch.Tensor) -> None:
        self.gates.setdefault(layer, []).append(g.detach().float().mean())


class _SoftCrossEntropy(torch.autograd.Function):
    """Per row i: -p[rows[i]] · log_softmax(z[i]), and its gradient softmax(z[i]) - p[rows[i]].

    Runs over small blocks of rows so the fp32 temporaries stay in cache and gathers the target rows block by block
    (the [N, V] fp32 target is never materialised). The gradient is written during the forward pass, in z's dtype,
    from the same log-softmax, so backward is one multiply and z itself need not be kept.
    """

    @staticmethod
    def forward(ctx, z: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor, block: int) -> torch.Tensor:
        out = torch.empty(z.shape[0], dtype=torch.float32, device=z.device)
        want_grad = ctx.needs_input_grad[0]
        grad = torch.empty_like(z) if want_grad else None
        # fp32 throughout: under CPU autocast vecdot would cast both operands to bf16 (two copies, a rounded CE)
        with torch.autocast(z.device.type, enabled=False):
            for i in range(0, z.shape[0], block):
                logp = torch.log_softmax(z[i:i + block], -1, dtype=torch.float32)    # a new fp32 tensor, upcast fused
                p = probs.index_select(0, rows[i:i + block])
                out[i:i + block] = torch.linalg.vecdot(p, logp).neg_()
                if want_grad:
                    grad[i:i + block] = logp.exp_().sub_(p)
        if want_grad:
            ctx.save_for_backward(grad)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return grad.mul_(g.to(grad.dtype).unsqueeze(1)), None, None, None


def soft_cross_entropy(z: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor | None = None,
                       block: int = 32) -> torch.Tensor:
    """Soft cross-entropy of logits z [N, V] against target probabilities probs[rows] ([M, V] fp32, rows [N];
    rows None = probs row for row) -> [N] fp32."""
    if rows is None:
        rows = torch.arange(z.shape[0], device=z.device)
    return _SoftCrossEntropy.apply(z, probs, rows, block)


def _shift(x: torch.Tensor, s: int, fill) -> torch.Tensor:
    """x[:, s:] padded at the end with `fill` back to length T."""
    pad = torch.full_like(x[:, :s], fill)
    return torch.cat([x[:, s:], pad], 1)


@torch.no_grad()
def target_distribution(target_logits: torch.Tensor, drafter: Drafter) -> tuple[torch.Tensor, torch.Tensor]:
    """Target logits [B, T, V] -> (probabilities over the draft vocabulary [B, T, V_draft] fp32,
    the draft index of the target's argmax [B, T], -1 where the argmax lies outside the draft vocabulary)."""
    arg = target_logits.max(-1).indices          # max().indices: several times faster than argmax in bf16
    tgt = drafter.target_to_draft()[arg]
    if drafter.config.draft_vocab_size < drafter.config.vocab_size:
        target_logits = target_logits.index_select(-1, drafter.d2t)
    return torch.softmax(target_logits.float(), -1), tgt


@torch.no_grad()
def target_distribution_from_hidden(hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                                    drafter: Drafter) -> tuple[torch.Tensor, torch.Tensor]:
    """As `target_distribution`, from the target's last hidden [B, T, d] and its LM head weight [V, d].

    The draft rows and the other rows are two matmuls, so the [B, T, V] logits are never gathered column-wise
    (slow on CPU); the argmax is inside the draft vocabulary iff the draft rows' max reaches the others' max.
    """
    h = hidden.to(lm_head_weight.dtype)
    if drafter.config.draft_vocab_size == drafter.config.vocab_size:
        return target_distribution(F.linear(h, lm_head_weight), drafter)
    logits = F.linear(h, lm_head_weight.index_select(0, drafter.d2t))
    rest = F.linear(h, lm_head_weight.index_select(0, drafter.outside_ids()))
    top, arg = logits.max(-1)
    tgt = torch.where(top >= rest.amax(-1), arg, -1)
    return torch.softmax(logits.float(), -1), tgt


def check_inputs(who: str, drafter, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                 features: torch.Tensor | None) -> None:
    """The shape and feature checks every unroll (TTT and block) makes, as one-line ValueErrors."""
    B, T = input_ids.shape
    if loss_mask.shape != (B, T):
        raise ValueError(f"{who}: loss_mask has shape {tuple(loss_mask.shape)}, expected {(B, T)}")
    if drafter.config.uses_features and features is None:
        raise ValueError(f"{who}: {drafter.config.variant!r} needs features [B, T, {drafter.config.n_features}*d]")


def teacher(who: str, drafter, target_logits: torch.Tensor | None, target_hidden: torch.Tensor | None,
            lm_head_weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's distribution over the draft vocabulary and its argmax's draft index (`target_distribution`),
    from its logits or from its last hidden state and head."""
    require_teacher(who, target_logits, target_hidden, lm_head_weight)
    if target_logits is not None:
        return target_distribution(target_logits, drafter)
    return target_distribution_from_hidden(target_hidden, lm_head_weight, drafter)


def require_teacher(who: str, target_logits, target_hidden, lm_head_weight) -> None:
    """Refuse a call that gives neither the target's logits nor its last hidden state with the head."""
    if target_logits is None and (target_hidden is None or lm_head_weight is None):
        raise ValueError(f"{who}: give target_logits, or target_hidden with lm_head_weight")


def layout(loss_mask: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None):
    """(attention mask, position ids, explicit causal mask or None, scored positions) of a [B, T] batch.

    Under right padding (every row valid then padding) a valid query never sees a padded key through the plain
    causal triangle and padded queries are never scored, so the fused causal kernels serve (mask None); otherwise
    an explicit [B, 1, T, T] mask."""
    B, T = loss_mask.shape
    dev = loss_mask.device
    attention_mask = torch.ones(B, T, dtype=torch.bool, device=dev) if attention_mask is None \
        else attention_mask.to(torch.bool)
    if position_ids is None:
        position_ids = torch.arange(T, device=dev).expand(B, T)
    right_padded = not bool((~attention_mask[:, :-1] & attention_mask[:, 1:]).any())
    causal = None if right_padded else \
        torch.ones(T, T, dtype=torch.bool, device=dev).tril()[None, None] & attention_mask[:, None, None, :]
    return attention_mask, position_ids, causal, loss_mask.to(torch.bool) & attention_mask


def score_steps(z: torch.Tensor, probs: torch.Tensor, tgt: torch.Tensor, idxs: list[torch.Tensor],
                sources: list[torch.Tensor], valids: list[torch.Tensor], decay: float, n: int
                ) -> tuple[torch.Tensor, list[float], StepCounts]:
    """Loss and counts of K steps from their scored rows stacked in `z` (step k's rows are positions `idxs[k]`
    of the n flat positions, scored against the teacher at `sources[k]`): each step's mean soft cross-entropy,
    weighted by decay**k and summed, and the top-1 hits against `tgt` counted where `valids[k]`."""
    dev = z.device
    steps = len(idxs)
    sizes = [i.numel() for i in idxs]
    src = torch.cat(sources)
    per_row = soft_cross_entropy(z, probs, src)
    hits = z.detach().max(-1).indices == tgt[src]
    step_of_row = torch.repeat_interleave(torch.arange(steps, device=dev), torch.tensor(sizes, device=dev))
    loss_sum = torch.zeros(steps, device=dev, dtype=per_row.dtype).index_add(0, step_of_row, per_row)
    per_step = loss_sum / torch.tensor(sizes, device=dev).clamp(min=1)
    weights = decay ** torch.arange(steps, device=dev, dtype=per_step.dtype)
    corrects = []
    for idx, hit in zip(idxs, hits.split(sizes)):
        correct = torch.zeros(n, dtype=torch.bool, device=dev)
        correct[idx] = hit
        corrects.append(correct)
    return (per_step * weights).sum(), per_step.detach().tolist(), step_counts(torch.stack(corrects), torch.stack(valids))


def ttt_unroll(drafter: Drafter, input_ids: torch.Tensor, loss_mask: torch.Tensor,
               attention_mask: torch.Tensor | None = None, features: torch.Tensor | None = None,
               target_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
               target_logits: torch.Tensor | None = None, target_hidden: torch.Tensor | None = None,
               lm_head_weight: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
               steps: int = 7, decay: float = 0.8, return_logits: bool = False,
               target_top1: torch.Tensor | None = None, target_top1_logit: torch.Tensor | None = None,
               score: bool = True, compact: bool = True) -> TTTOutput:
    """The K-step TTT unroll (see the module docstring).

    input_ids, loss_mask, attention_mask, position_ids: [B, T] (right padding); features: [B, T, 3d] concat
    of the target features (eagle3 family); target_kv: per kv layer (K, V) [B, Hkv, T, hd] post-RoPE (KV
    readers); target_logits [B, T, V], or target_hidden [B, T, d] (final norm applied) with lm_head_weight
    [V, d], optionally with the target's full-vocabulary top-1 id and logit per position (target_top1 [B, T]
    long, target_top1_logit [B, T]; the feature cache's) so that only the draft rows of the head are multiplied.
    Run it under torch.autocast for bf16 and under no_grad for evaluation.

    return_logits gives every position's logits at every step (the full unroll); compact=False runs the full
    unroll without them (the reference the default path equals). score=False (evaluation): no target needed, no
    loss; `top1` holds the drafter's top-1 at every position where token t+2+k exists and is a loss-masked token.
    """
    if return_logits or not compact:
        if not score:
            raise ValueError("ttt_unroll: score=False runs the compact unroll (no return_logits, compact=True)")
        return _full_unroll(drafter, input_ids, loss_mask, attention_mask, features, target_kv, target_logits,
                            target_hidden, lm_head_weight, position_ids, steps, decay, return_logits)
    return _compact_unroll(drafter, input_ids, loss_mask, attention_mask, features, target_kv, target_logits,
                           target_hidden, lm_head_weight, position_ids, steps, decay, target_top1,
                           target_top1_logit, score)


def _full_unroll(drafter: Drafter, input_ids, loss_mask, attention_mask, features, target_kv, target_logits,
                 target_hidden, lm_head_weight, position_ids, steps: int, decay: float,
                 return_logits: bool) -> TTTOutput:
    """Every step at every position (the straightforward unroll; the reference of `_compact_unroll`)."""
    B, T = input_ids.shape
    dev = input_ids.device
    cfg = drafter.config
    check_inputs("ttt_unroll", drafter, input_ids, loss_mask, features)
    probs, tgt = teacher("ttt_unroll", drafter, target_logits, target_hidden, lm_head_weight)
    attention_mask, position_ids, causal, scored = layout(loss_mask, attention_mask, position_ids)
    Vd = probs.shape[-1]
    probs = probs.reshape(B * T, Vd)
    tgt = tgt.reshape(B * T)

    ctx = _TTTContext(drafter, causal, target_kv, position_ids)
    hidden = drafter.fuse(features) if cfg.uses_features else None
    valids, idxs, rows, picked, all_logits = [], [], [], [], []
    for k in range(steps):
        ctx.k = k
        ids_k = _shift(input_ids, 1 + k, 0)
        h = drafter.forward_hidden(ids_k, hidden, position_ids + 1 + k, ctx)
        # position t at step k is scored against the target's logits at t+1+k (which predict token t+2+k)
        valid = _shift(scored, 2 + k, False) & (_shift(tgt.view(B, T), 1 + k, -1) >= 0)
        idx = valid.reshape(-1).nonzero().squeeze(1)
        valids.append(valid.reshape(-1))
        idxs.append(idx)
        rows.append(idx + 1 + k)
        if return_logits:
            all_logits.append(drafter.head(h))
            picked.append(all_logits[-1].reshape(B * T, -1)[idx])
        else:
            picked.append(h.reshape(B * T, -1)[idx])
        hidden = drafter.carry(h)
    # the head and the loss do not feed the next step: run them once over the scored rows of every step
    z = torch.cat(picked) if return_logits else drafter.head(torch.cat(picked))
    total, losses, counts = score_steps(z, probs, tgt, idxs, rows, valids, decay, B * T)
    gates = {i: float(torch.stack(g).mean()) for i, g in ctx.gates.items()}
    drafter.last_gates = gates
    return TTTOutput(loss=total, losses=losses, counts=counts, gate_means=gates,
                     logits=all_logits if return_logits else None)


# -- the compact unroll: only what carries loss ------------------------------------------------------------------

def _inverse(rows: torch.Tensor, n: int) -> torch.Tensor:
    """[n] long: where each flat index sits in `rows`, -1 where it is absent."""
    inv = torch.full((n,), -1, dtype=torch.long, device=rows.device)
    inv[rows] = torch.arange(rows.numel(), device=rows.device)
    return inv


_DRAFT_ROWS: dict = {}


def _draft_rows(weight: torch.Tensor, drafter: Drafter) -> torch.Tensor:
    """The draft vocabulary's rows of the target's LM head, kept (one entry, the head held weakly) until the head or
    the vocabulary changes: the gather would otherwise be repeated every step."""
    d2t = drafter.d2t
    key = (weight._version, d2t.device, d2t.data_ptr(), d2t._version, tuple(d2t.shape))
    ref = _DRAFT_ROWS.get("weight")
    if ref is None or ref() is not weight or _DRAFT_ROWS.get("key") != key \
            or not torch.equal(_DRAFT_ROWS["d2t"], d2t):
        _DRAFT_ROWS.update(weight=weakref.ref(weight), key=key, d2t=d2t.clone(),
                           rows=weight.index_select(0, d2t.to(weight.device)))
    return _DRAFT_ROWS["rows"]


@torch.no_grad()
def teacher_rows(drafter: Drafter, rows: torch.Tensor, target_logits: torch.Tensor | None = None,
                 target_hidden: torch.Tensor | None = None, lm_head_weight: torch.Tensor | None = None,
                 target_top1: torch.Tensor | None = None,
                 target_top1_logit: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`target_distribution` at the flat positions `rows` of [B, T] only: (draft-vocabulary probabilities [n, V_draft]
    fp32, the draft index of the target's argmax [n], -1 outside the draft vocabulary).

    With the target's full-vocabulary top-1 (id and logit, from the feature cache) only the draft rows of the LM
    head are multiplied: the argmax is inside when the top-1 is a draft token or a draft token reaches its logit
    (a tie, which `target_distribution_from_hidden` also counts as inside)."""
    if target_logits is not None:
        return target_distribution(target_logits.reshape(-1, target_logits.shape[-1]).index_select(0, rows), drafter)
    h = target_hidden.reshape(-1, target_hidden.shape[-1]).index_select(0, rows)
    if target_top1 is None or drafter.config.draft_vocab_size == drafter.config.vocab_size:
        return target_distribution_from_hidden(h, lm_head_weight, drafter)
    logits = F.linear(h.to(lm_head_weight.dtype), _draft_rows(lm_head_weight, drafter))
    top, arg = logits.max(-1)
    top1 = target_top1.reshape(-1).index_select(0, rows).long()
    # compared in the logits' own precision (bf16 under autocast, even for an fp32 cache), as the two-matmul rule
    # compares two maxima computed alike
    reach = top >= target_top1_logit.reshape(-1).index_select(0, rows).to(top.dtype)
    inside = drafter.t2d[top1] | reach
    return torch.softmax(logits.float(), -1), torch.where(inside, arg, -1)


class _WeightedSoftCrossEntropy(torch.autograd.Function):
    """Σ_i w_i · CE_i with CE_i = -probs[rows[i]] · log_softmax(z[i]), plus CE [N] and argmax(z) [N] (no gradient).

    As `_SoftCrossEntropy`, block by block (each block's fp32 temporaries stay in cache), with the weights known in
    advance (the unroll's decay^k / n_k) folded into the gradient as it is written, the argmax taken from the same
    block, and contiguous runs of target rows read as slices rather than gathered: backward is a no-op for the
    usual unit output gradient.
    """

    @staticmethod
    def forward(ctx, z: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, block: int):
        N = z.shape[0]
        ce = torch.empty(N, dtype=torch.float32, device=z.device)
        arg = torch.empty(N, dtype=torch.long, device=z.device)
        grad = torch.empty_like(z) if ctx.needs_input_grad[0] else None
        r = rows.tolist()
        # breaks[j]: how many of rows[0..j] do not follow their predecessor (a block is a slice when none does)
        breaks = torch.cat([rows.new_zeros(1), (rows[1:] - rows[:-1] != 1).long().cumsum(0)]).tolist() if N else []
        # fp32 throughout: under CPU autocast vecdot would cast both operands to bf16 (two copies, a rounded CE)
        with torch.autocast(z.device.type, enabled=False):
            for i in range(0, N, block):
                j = min(i + block, N)
                logp = torch.log_softmax(z[i:j], -1, dtype=torch.float32)
                p = probs[r[i]:r[i] + j - i] if breaks[j - 1] == breaks[i] else probs.index_select(0, rows[i:j])
                ce[i:j] = torch.linalg.vecdot(p, logp).neg_()
                arg[i:j] = logp.max(-1).indices     # log_softmax is monotone per row: z's argmax, ties alike
                if grad is not None:
                    grad[i:j] = logp.exp_().sub_(p).mul_(weight[i:j, None])
            total = torch.linalg.vecdot(ce, weight)
        ctx.mark_non_differentiable(ce, arg)
        ctx.save_for_backward(grad)
        return total, ce, arg

    @staticmethod
    def backward(ctx, g: torch.Tensor, _ce, _arg):
        (grad,) = ctx.saved_tensors
        if g.numel() != 1 or float(g) != 1.0:
            grad = grad * g.to(grad.dtype)
        return grad, None, None, None, None


def weighted_soft_cross_entropy(z: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor,
                                block: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Σ_i weight_i · CE_i differentiable, CE [N] fp32, argmax of z [N]) for logits z [N, V] against the target
    probabilities probs[rows] ([M, V] fp32, rows [N]); see `_WeightedSoftCrossEntropy`."""
    return _WeightedSoftCrossEntropy.apply(z, probs, rows, weight.float(), block)


class _CompactContext(QueryContext):
    """Key blocks for the compact unroll.

    Step 0's entries are every position ([B, T] layout; its last layer may query at some `rows` only); step k >= 1's
    entries are the flat positions `self.rows` ([1, n] layout), a subset of the previous step's. The self branch's
    prefix is step 0's keys, the cross branch's the injected target KV, both in the [B, T] layout and read by the
    queries at their flat positions; a chain is extended at every step and carried into the next step's rows.
    """

    def __init__(self, drafter: Drafter, causal: torch.Tensor | None, target_kv, position_ids: torch.Tensor):
        super().__init__(drafter)
        self.causal = causal
        self.target_kv, self.position_ids = target_kv, position_ids
        self.k, self.rows, self.sel = 0, None, None
        self.dense0: dict = {}
        self.prefix: dict = {}
        self.chains: dict = {}
        self.gates: dict = {}

    def begin(self, k: int, rows: torch.Tensor | None, sel: torch.Tensor | None) -> None:
        """Step k over `rows` (None: every position); sel = where they sit among the previous step's rows."""
        self.k, self.rows, self.sel = k, rows, sel

    def _prefix(self, k, v, rows) -> KeyBlock:
        if self.causal is None:
            return KeyBlock(k, v, causal=True, rows=rows)
        return KeyBlock(k, v, self.causal, rows=rows)

    def _chain(self, key, k, v, rows) -> KeyBlock:
        """Append this step's same-position key to the chain, carried over from the previous step's layout."""
        k, v = k.unsqueeze(3), v.unsqueeze(3)
        old = self.chains.get(key)
        if old is not None:
            ok, ov = old
            if self.k == 1:            # step 0 kept every position
                ok, ov = take_rows(ok, self.rows), take_rows(ov, self.rows)
            else:
                ok, ov = ok.index_select(2, self.sel), ov.index_select(2, self.sel)
            k, v = torch.cat([ok, k], 3), torch.cat([ov, v], 3)
        self.chains[key] = (k, v)
        if rows is not None:           # step 0's last layer: only these entries query
            k, v = take_rows(k, rows), take_rows(v, rows)
        return KeyBlock(k, v, diag=True)

    def self_blocks(self, attn, k, v, rows=None) -> list[KeyBlock]:
        K, V = expand_heads(k, attn.hmap), expand_heads(v, attn.hmap)
        if self.k == 0:
            self.dense0[attn.layer] = (K, V)
            return [self._prefix(K, V, rows)]
        return [self._prefix(*self.dense0[attn.layer], self.rows), self._chain((attn.layer, "self"), K, V, None)]

    def own_prefix(self, attn, k, v, rows=None) -> list[KeyBlock]:
        return self.self_blocks(attn, k, v, rows)       # its own step-0 keys are the prefix

    def target_prefix(self, attn, rows=None) -> KeyBlock:
        if attn.layer not in self.prefix:
            if self.target_kv is None:
                raise ValueError(f"ttt_unroll: variant {self.drafter.config.variant!r} needs target_kv")
            cos, sin = self.drafter.rope_for_target(self.position_ids)
            pk, pv = attn.inject(self.target_kv, cos, sin)
            self.prefix[attn.layer] = (expand_heads(pk, attn.hmap), expand_heads(pv, attn.hmap))
        return self._prefix(*self.prefix[attn.layer], rows if self.k == 0 else self.rows)

    def own_chain(self, attn, k, v, rows=None) -> KeyBlock:
        return self._chain((attn.layer, "cross"), expand_heads(k, attn.hmap), expand_heads(v, attn.hmap), rows)

    def record_gate(self, layer: int, g: torch.Tensor) -> None:
        self.gates.setdefault(layer, []).append(g.detach().float().mean())


def _compact_unroll(drafter: Drafter, input_ids, loss_mask, attention_mask, features, target_kv, target_logits,
                    target_hidden, lm_head_weight, position_ids, steps: int, decay: float, target_top1,
                    target_top1_logit, score: bool) -> TTTOutput:
    """The unroll restricted to what carries loss (module docstring); equal to `_full_unroll`'s result."""
    B, T = input_ids.shape
    N = B * T
    dev = input_ids.device
    cfg = drafter.config
    check_inputs("ttt_unroll", drafter, input_ids, loss_mask, features)
    if score:
        require_teacher("ttt_unroll", target_logits, target_hidden, lm_head_weight)
    attention_mask, position_ids, causal, scored = layout(loss_mask, attention_mask, position_ids)

    if score:
        probs, tgt_teach, where, usable = scored_teacher(drafter, scored, target_logits, target_hidden,
                                                         lm_head_weight, target_top1, target_top1_logit)
        # position t at step k is scored against the target's row t+1+k (which predicts token t+2+k)
        valid = torch.stack([_shift(usable, 1 + k, False) for k in range(steps)]).reshape(steps, N)
    else:
        valid = torch.stack([_shift(scored, 2 + k, False) for k in range(steps)]).reshape(steps, N)
    # step k runs at position t when it, or a later step of the same chain, is scored there
    need = valid.flip(0).cumsum(0).flip(0) > 0
    ids, pos = input_ids.reshape(N), position_ids.reshape(N)

    ctx = _CompactContext(drafter, causal, target_kv, position_ids)
    picked, idxs, targets = [], [], []
    h, prev = None, None
    for k in range(steps):
        rows = need[k].nonzero().squeeze(1)
        idx = valid[k].nonzero().squeeze(1)
        if k > 0 and rows.numel() == 0:      # no chain reaches this far: nothing later is scored either
            idxs += [idx] * (steps - k)
            break
        if k == 0:
            ctx.begin(0, None, None)
            hidden = drafter.fuse(features) if cfg.uses_features else None
            h = drafter.forward_hidden(_shift(input_ids, 1, 0), hidden, position_ids + 1, ctx, rows)
        else:
            sel = _inverse(prev, N)[rows]
            ctx.begin(k, rows, sel)
            hidden = drafter.carry(h.index_select(1, sel)) if cfg.uses_features else None
            h = drafter.forward_hidden(ids[rows + 1 + k][None], hidden, (pos[rows] + 1 + k)[None], ctx)
        prev = rows
        picked.append(h[0].index_select(0, _inverse(rows, N)[idx]))
        idxs.append(idx)
        if score:
            targets.append(where[idx + 1 + k])
    gates = {i: float(torch.stack(g).mean()) for i, g in ctx.gates.items()}
    drafter.last_gates = gates
    # the head and the loss do not feed the next step: run them once over the scored rows of every step
    z = drafter.head(torch.cat(picked))
    sizes = [i.numel() for i in idxs]
    if not score:
        top = z.detach().max(-1).indices
        top1 = []
        for idx, t in zip(idxs, top.split(sizes)):
            out = torch.full((N,), -1, dtype=torch.long, device=dev)
            out[idx] = t
            top1.append(out.view(B, T))
        return TTTOutput(loss=None, losses=[], counts=None, gate_means=gates, top1=top1)
    total, losses, counts = score_teacher_rows(z, probs, tgt_teach, idxs, targets, valid, decay)
    return TTTOutput(loss=total, losses=losses, counts=counts, gate_means=gates)


def scored_teacher(drafter: Drafter, scored: torch.Tensor, target_logits, target_hidden, lm_head_weight,
                   target_top1, target_top1_logit):
    """The teacher at the rows that score something: (probs [M, V_draft], draft index of the argmax [M], where
    [B*T] (flat position -> its teacher row, -1 if none), usable [B, T] (a teacher row whose argmax is in the
    draft vocabulary)). The target's row r is a teacher row when token r+1 is scored (`scored` [B, T])."""
    B, T = scored.shape
    N = B * T
    teach = _shift(scored, 1, False).reshape(N).nonzero().squeeze(1)
    probs, tgt_teach = teacher_rows(drafter, teach, target_logits, target_hidden, lm_head_weight,
                                    target_top1, target_top1_logit)
    usable = torch.zeros(N, dtype=torch.bool, device=scored.device)
    usable[teach] = tgt_teach >= 0
    return probs, tgt_teach, _inverse(teach, N), usable.view(B, T)


def score_teacher_rows(z: torch.Tensor, probs: torch.Tensor, tgt_teach: torch.Tensor, idxs: list[torch.Tensor],
                       targets: list[torch.Tensor], valid: torch.Tensor, decay: float
                       ) -> tuple[torch.Tensor, list[float], StepCounts]:
    """Loss and counts of K steps whose scored rows are stacked in `z` (step k's rows: flat positions idxs[k],
    scored against teacher rows targets[k] of `scored_teacher`'s probs): Σ_k decay^k * mean CE_k, the per-step mean
    CE and the top-1 hits counted where `valid` [K, B*T]."""
    dev = z.device
    steps, N = valid.shape
    sizes = [i.numel() for i in idxs]
    n = torch.tensor(sizes, device=dev).clamp(min=1)
    step_of_row = torch.repeat_interleave(torch.arange(steps, device=dev), torch.tensor(sizes, device=dev))
    per_step_weight = decay ** torch.arange(steps, device=dev, dtype=torch.float32) / n
    src = torch.cat(targets)
    total, per_row, arg = weighted_soft_cross_entropy(z, probs, src, per_step_weight[step_of_row])
    hits = arg == tgt_teach[src]
    loss_sum = torch.zeros(steps, device=dev, dtype=per_row.dtype).index_add(0, step_of_row, per_row)
    losses = (loss_sum / n).tolist()
    corrects = []
    for idx, hit in zip(idxs, hits.split(sizes)):
        correct = torch.zeros(N, dtype=torch.bool, device=dev)
        correct[idx] = hit
        corrects.append(correct)
    return total, losses, step_counts(torch.stack(corrects), valid)
