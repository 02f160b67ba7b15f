"""Autoregressive test-time training (TTT): the K-step unroll over all positions in parallel (DESIGN §6).

One implementation for every drafter variant. Step k runs the drafter once over all T positions:
- input token at position t is token t+1+k (teacher-forced), RoPE position `pos(t) + 1 + k`;
- hidden input (eagle3 family) is fc(features) at step 0 and the drafter's own output hidden of step k-1 after;
- keys: the self branch sees the step-0 keys of positions <= t (one T x T causal block, shared by all steps)
  plus its own keys of steps 1..k at the same position t; the cross branch sees the injected target KV of
  positions <= t (T x T causal) plus its own cross keys of steps 0..k at t. The same-position keys are diag
  blocks of `models.layers.attend` (O(T) dot products each), merged with the causal block in one softmax, so
  no (K*T) x (K*T) mask or score matrix is ever built;
- target: the target's next-token distribution for token t+2+k, i.e. its logits at position t+1+k,
  restricted to the draft vocabulary and renormalised;
- scored where token t+2+k exists, is a loss-masked (assistant) token and not padding, and the target's
  argmax at t+1+k lies inside the draft vocabulary. loss_k = mean soft cross-entropy over those positions,
  total = Σ_k decay^k loss_k; acc/α counts (`models.metrics`) over the same positions.

Inputs are plain tensors so the train stage can feed the offline cache or an online target.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.drafter import Drafter
from models.layers import KeyBlock, expand_heads
from models.metrics import StepCounts, step_counts


@dataclass
class TTTOutput:
    loss: torch.Tensor                     # scalar, Σ_k decay^k loss_k (differentiable)
    losses: list[float]                    # loss_k
    counts: StepCounts                     # acc_k / α_k numerators and denominators
    gate_means: dict[int, float]           # hybrid: mean gate per layer over steps and positions
    logits: list[torch.Tensor] | None = None   # per step [B, T, V_draft] when return_logits

    @property
    def acc(self) -> list[float]:
        return self.counts.acc

    @property
    def alpha(self) -> list[float]:
        return self.counts.alpha


class _TTTContext:
    """Key blocks for the parallel unroll: a causal T x T block plus per-position diag blocks."""

    def __init__(self, drafter: Drafter, causal: torch.Tensor | None, target_kv, position_ids: torch.Tensor):
        self.drafter, self.causal = drafter, causal     # None: right padding, the plain causal triangle serves
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

    def self_blocks(self, attn, k, v) -> list[KeyBlock]:
        K, V = expand_heads(k, attn.hmap), expand_heads(v, attn.hmap)
        if self.k == 0:
            self.dense0[attn.layer] = (K, V)
            return [self._prefix(K, V)]
        return [self._prefix(*self.dense0[attn.layer]), self._chain((attn.layer, "self"), K, V)]

    def cross_blocks(self, attn, k, v) -> list[KeyBlock]:
        if attn.layer not in self.prefix and not self.drafter.config.no_target:
            if self.target_kv is None:
                raise ValueError(f"ttt_unroll: variant {self.drafter.config.variant!r} needs target_kv")
            cos, sin = self.drafter.rope_for_target(self.position_ids)
            pk, pv = attn.inject(self.target_kv, cos, sin)
            self.prefix[attn.layer] = (expand_heads(pk, attn.hmap), expand_heads(pv, attn.hmap))
        chain = self._chain((attn.layer, "cross"), expand_heads(k, attn.hmap), expand_heads(v, attn.hmap))
        if self.drafter.config.no_target:
            return [chain]
        return [self._prefix(*self.prefix[attn.layer]), chain]

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


def ttt_unroll(drafter: Drafter, input_ids: torch.Tensor, loss_mask: torch.Tensor,
               attention_mask: torch.Tensor | None = None, features: torch.Tensor | None = None,
               target_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
               target_logits: torch.Tensor | None = None, target_hidden: torch.Tensor | None = None,
               lm_head_weight: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
               steps: int = 7, decay: float = 0.8, return_logits: bool = False) -> TTTOutput:
    """The K-step TTT unroll (see the module docstring).

    input_ids, loss_mask, attention_mask, position_ids: [B, T] (right padding); features: [B, T, 3d] concat
    of the target features (eagle3 family); target_kv: per kv layer (K, V) [B, Hkv, T, hd] post-RoPE (KV
    readers); target_logits [B, T, V], or target_hidden [B, T, d] (final norm applied) with lm_head_weight
    [V, d]. Run it under torch.autocast for bf16 and under no_grad for evaluation.
    """
    B, T = input_ids.shape
    dev = input_ids.device
    cfg = drafter.config
    if loss_mask.shape != (B, T):
        raise ValueError(f"ttt_unroll: loss_mask has shape {tuple(loss_mask.shape)}, expected {(B, T)}")
    if cfg.uses_features and features is None:
        raise ValueError(f"ttt_unroll: variant {cfg.variant!r} needs features [B, T, {cfg.n_features}*d]")
    if target_logits is None:
        if target_hidden is None or lm_head_weight is None:
            raise ValueError("ttt_unroll: give target_logits, or target_hidden with lm_head_weight")
        probs, tgt = target_distribution_from_hidden(target_hidden, lm_head_weight, drafter)
    else:
        probs, tgt = target_distribution(target_logits, drafter)
    attention_mask = torch.ones(B, T, dtype=torch.bool, device=dev) if attention_mask is None \
        else attention_mask.to(torch.bool)
    if position_ids is None:
        position_ids = torch.arange(T, device=dev).expand(B, T)
    # right padding (every row valid then padding): a valid query never sees a padded key under the plain causal
    # triangle, and padded queries are never scored, so the fused causal kernels serve; otherwise an explicit mask
    right_padded = not bool((~attention_mask[:, :-1] & attention_mask[:, 1:]).any())
    causal = None if right_padded else \
        torch.ones(T, T, dtype=torch.bool, device=dev).tril()[None, None] & attention_mask[:, None, None, :]
    Vd = probs.shape[-1]
    probs = probs.reshape(B * T, Vd)
    tgt = tgt.reshape(B * T)
    scored = loss_mask.to(torch.bool) & attention_mask

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
    sizes = [i.numel() for i in idxs]
    z = torch.cat(picked) if return_logits else drafter.head(torch.cat(picked))
    src = torch.cat(rows)
    per_row = soft_cross_entropy(z, probs, src)
    hits = z.detach().max(-1).indices == tgt[src]
    step_of_row = torch.repeat_interleave(torch.arange(steps, device=dev), torch.tensor(sizes, device=dev))
    loss_sum = torch.zeros(steps, device=dev, dtype=per_row.dtype).index_add(0, step_of_row, per_row)
    per_step = loss_sum / torch.tensor(sizes, device=dev).clamp(min=1)
    weights = decay ** torch.arange(steps, device=dev, dtype=per_step.dtype)
    total = (per_step * weights).sum()
    losses = per_step.detach().tolist()
    corrects = []
    for idx, hit in zip(idxs, hits.split(sizes)):
        correct = torch.zeros(B * T, dtype=torch.bool, device=dev)
        correct[idx] = hit
        corrects.append(correct)
    counts = step_counts(torch.stack(corrects), torch.stack(valids))
    gates = {i: float(torch.stack(g).mean()) for i, g in ctx.gates.items()}
    drafter.last_gates = gates
    return TTTOutput(loss=total, losses=losses, counts=counts, gate_means=gates,
                     logits=all_logits if return_logits else None)
