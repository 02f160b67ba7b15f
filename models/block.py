"""Block-wise drafters (DFlash / P-EAGLE style): one drafter pass drafts a whole block of B-1 tokens.

Alignment (mirrors the autoregressive drafters', DESIGN §4). An *anchor* at position t means:
- context: the target's information at positions <= t (its fused features, its KV, or both: `context`);
- block position 0 holds the known root token t+1 (in decoding: the token the target just emitted), at RoPE
  position pos(t) + 1; block positions j = 1..B-1 hold a learned mask embedding at RoPE positions pos(t) + 1 + j
  and predict token t+1+j. Block position j = k+1 plays speculative step k (k = 0..B-2): step k predicts token
  t+2+k, exactly the autoregressive drafter's step k, so the same targets, scoring and metrics apply.
- attention: every block position sees the context keys of positions <= t and all B block positions
  (bidirectional within the block); nothing else. No block sees another anchor's block.

Context keys, per drafter layer (the study's axis, `DrafterConfig.context`):
- `hidden` (DFlash): c = hidden_norm(fc(concat of the target features)) [.., T, d]; the layer's context_k_proj /
  context_v_proj map c to its context keys/values, keys rotated at the context position pos(t). DFlash maps c with
  the block's own k_proj/v_proj; here c has maps of its own, as the `kv` context has its injection: with one shared
  map a 2-layer drafter trained briefly stays at the no-target control's step-0 accuracy, far below EAGLE-3's on
  the same information (the root and mask states and the target features are different inputs, and one value
  map mixes them; tests/test_block.py::test_hidden_context_block_reaches_eagle3_step0);
- `kv`: the target's post-RoPE KV of its kv layers, injected per layer by `models.drafter.Injection`
  (`linear` or `head_concat`, `rope_fix`), as the kv_only drafter's prefix;
- `both`: the two key sets side by side under one joint softmax.
The block's own keys/values come from the same layer's projections of the block hidden states.

Pieces (state-dict names): `embed_tokens` (frozen target embedding, the root's input), `mask_embedding` [d] (the
masked positions' input), `fc`/`fc_norms`/`hidden_norm` (hidden, both), `layers.i` with `input_layernorm`,
`self_attn` (q/k/v/o_proj, `context_k_proj`/`context_v_proj` for hidden/both, `inject` for kv/both),
`post_attention_layernorm`, `mlp`; `norm`, `lm_head`, `d2t`, `t2d` as every drafter (`models.drafter.DraftModel`).

Training (`block_unroll`) runs many anchors per sequence in one pass and never builds an (anchors*B)^2 mask or
score matrix: the queries form T rows of B (row t = anchor t's block, [batch, H, T, B, hd]); for block offset j
the queries of all anchors are one [batch, H, T, hd] set whose context part is exactly causal over the T context
keys (query row t sees keys 0..t), and row t's own B keys are shared by its B queries
(`models.layers.attend_block`). On CPU that is fused: the context through PyTorch's flash kernel once per source
(all T*B queries under a row-causal mask), the block's own B x B scores per anchor as one batched matmul, merged by
log-sum-exp, forward and backward; what it keeps for backward is linear in B. With an anchor subset, projections,
MLP and head run on the anchor rows only; queries and block keys are scattered into the T rows for the attention
call alone.
Loss: at block position k+1 of anchor t, the soft cross-entropy against the target's next-token distribution on
the draft vocabulary for token t+2+k (the target's logits at t+1+k), scored exactly where `ttt_unroll` scores
step k at t (the token exists, is loss-masked and not padding, the target's argmax is in the draft vocabulary) and
t is an anchor; loss_k = mean over those, total = Σ_k decay^k loss_k (decay 0.8, the TTT step decay).

`block_reference` is the same drafter run anchor by anchor with plain dense attention (the tests' reference);
`models.decoding.block_proposer.BlockProposer` drives it in tree decoding.
"""
from __future__ import annotations

import torch
from torch import nn

from models.context import BlockContext
from models.drafter import DraftModel, Injection, _compute_dtype
from models.drafter_config import DrafterConfig
from models.layers import MLP, KeyBlock, RMSNorm, attend, attend_block, expand_heads, head_map
from models.rope import apply_rope
from models.ttt import (TTTOutput, _inverse, _shift, check_inputs, layout, require_teacher, score_teacher_rows,
                        scored_teacher)

# per layer, the context (K, V) of each source, hidden first then kv: [b, Hsrc, S, hd] each, heads not expanded
ContextKV = dict[int, list[tuple[torch.Tensor, torch.Tensor]]]


# -- modules --------------------------------------------------------------------------------------------------

class BlockAttention(nn.Module):
    """q/k/v/o projections of one layer; the context keys of each source; which keys a query sees is the
    context object's business (`ctx.attend`)."""

    def __init__(self, cfg: DrafterConfig, layer: int):
        super().__init__()
        d, H, Hkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.layer, self.head_dim = layer, hd
        self.q_proj = nn.Linear(d, H * hd, bias=False)
        self.k_proj = nn.Linear(d, Hkv * hd, bias=False)
        self.v_proj = nn.Linear(d, Hkv * hd, bias=False)
        self.o_proj = nn.Linear(H * hd, d, bias=False)
        self.uses_features, self.reads_kv = cfg.uses_features, cfg.reads_kv
        if cfg.uses_features:
            # the fused target features get key/value maps of their own, as the kv context has its injection: one
            # map shared with the block's token/mask states keeps a 2-layer drafter at the no-target control's
            # step-0 accuracy (tests/test_block.py, benchmarks/block_fairness.py)
            self.context_k_proj = nn.Linear(d, Hkv * hd, bias=False)
            self.context_v_proj = nn.Linear(d, Hkv * hd, bias=False)
        self.register_buffer("hmap", head_map(H, Hkv), persistent=False)
        if cfg.reads_kv:
            self.inject = Injection(cfg)
            # the injected KV has its own head count (head_concat: every source layer's heads side by side)
            self.register_buffer("kv_hmap", head_map(H, cfg.cross_kv_heads), persistent=False)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:-1], -1, self.head_dim).transpose(-2, -3)      # [.., n, h*hd] -> [.., h, n, hd]

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [R, n, d] -> rotated q [R, H, n, hd], rotated k and v [R, Hkv, n, hd]."""
        q, k, v = self._split(self.q_proj(x)), self._split(self.k_proj(x)), self._split(self.v_proj(x))
        return apply_rope(q, cos.to(q.dtype), sin.to(q.dtype)), apply_rope(k, cos.to(k.dtype), sin.to(k.dtype)), v

    def context(self, hidden: torch.Tensor | None, target_kv, rope_h, rope_kv) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This layer's context (K, V) per source (heads not expanded): the fused hidden [b, S, d] through the
        layer's context k/v projections, keys rotated by rope_h (cos, sin of the context positions); the target KV
        (per kv layer [b, Hkv_t, S, hd]) through the injection, rope_kv un-rotating for rope_fix."""
        out = []
        if hidden is not None:
            k, v = self._split(self.context_k_proj(hidden)), self._split(self.context_v_proj(hidden))
            cos, sin = rope_h
            out.append((apply_rope(k, cos.to(k.dtype), sin.to(k.dtype)), v))
        if target_kv is not None:
            out.append(self.inject(target_kv, *rope_kv))
        return out

    def expand(self, context: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Context (K, V) per source with heads expanded to the query heads."""
        hmaps = ([self.hmap] if self.uses_features else []) + ([self.kv_hmap] if self.reads_kv else [])
        return [(expand_heads(k, m), expand_heads(v, m)) for (k, v), m in zip(context, hmaps)]


class BlockLayer(nn.Module):
    """Llama-style decoder layer (RMSNorm, RoPE attention, SwiGLU) over the block's hidden states."""

    def __init__(self, cfg: DrafterConfig, index: int):
        super().__init__()
        d = cfg.hidden_size
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.self_attn = BlockAttention(cfg, index)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.mlp = MLP(d, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx) -> torch.Tensor:
        h = _compute_dtype(self.input_layernorm(x))
        q, k, v = self.self_attn.project(h, cos, sin)
        x = x + self.self_attn.o_proj(ctx.attend(self.self_attn, q, k, v))
        return x + self.mlp(self.post_attention_layernorm(x))


class BlockDrafter(DraftModel):
    """The `block` variant (see the module docstring)."""

    def __init__(self, cfg: DrafterConfig):
        if cfg.variant != "block":
            raise ValueError(f"BlockDrafter: variant {cfg.variant!r} is not 'block' (build it with build_drafter)")
        super().__init__(cfg, lambda: nn.ModuleList(BlockLayer(cfg, i) for i in range(cfg.depth)))
        d = cfg.hidden_size
        if cfg.uses_features:
            self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.randn(d) * 0.02)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def context_hidden(self, features: torch.Tensor) -> torch.Tensor:
        """[b, S, n_features*d] concat of the target features -> the normed fused context [b, S, d]."""
        return self.hidden_norm(self.fuse(features))

    def context_kv(self, positions: torch.Tensor, features: torch.Tensor | None = None,
                   target_kv=None) -> ContextKV:
        """Every layer's context (K, V) per source for context entries at positions [b, S] (decoding: a new tail
        of the accepted prefix; the reference: positions <= t)."""
        cfg = self.config
        hidden = self.context_hidden(features) if cfg.uses_features else None
        rope_h = self.rope(positions) if cfg.uses_features else None
        rope_kv = self.rope_for_target(positions) if cfg.reads_kv else None
        kv = target_kv if cfg.reads_kv else None
        return {i: layer.self_attn.context(hidden, kv, rope_h, rope_kv) for i, layer in enumerate(self.layers)}

    def block_input(self, root_ids: torch.Tensor) -> torch.Tensor:
        """root ids [R] -> the block's input [R, B, d]: the root's embedding, then B-1 mask embeddings."""
        root = self.embed_tokens(root_ids)[:, None]
        mask = self.mask_embedding.to(root.dtype).expand(root.shape[0], self.block_size - 1, -1)
        return torch.cat([root, mask], 1)

    def forward_block(self, root_ids: torch.Tensor, root_positions: torch.Tensor, ctx) -> torch.Tensor:
        """One pass over R blocks: root ids [R] at RoPE positions root_positions [R] (masks after them), keys
        from `ctx`; returns the output hidden [R, B, d] (pre final norm)."""
        x = _compute_dtype(self.block_input(root_ids))
        positions = root_positions[:, None] + torch.arange(self.block_size, device=root_positions.device)
        cos, sin = self.rope(positions)
        for layer in self.layers:
            x = layer(x, cos, sin, ctx)
        return x

    @torch.no_grad()
    def draft(self, root_ids: torch.Tensor, root_positions: torch.Tensor, context: ContextKV,
              visible: torch.Tensor | None = None) -> torch.Tensor:
        """Decoding: R blocks over given context (K, V) per layer (every entry visible, or visible [R, S] bool)
        -> draft-vocabulary logits [R, B-1, V_draft] of block positions 1..B-1 (speculative steps 0..B-2)."""
        h = self.forward_block(root_ids, root_positions, _DenseContext(context, visible))
        return self.head(h[:, 1:])


# -- key contexts ---------------------------------------------------------------------------------------------

class _DenseContext(BlockContext):
    """Every block sees its context entries (all, or `visible` [R, S]) and its own B keys: dense attention.

    explicit=False goes through `models.layers.attend` (the SDPA kernel; decoding), explicit=True is a plain
    softmax over the concatenated scores (the reference)."""

    def __init__(self, context: ContextKV, visible: torch.Tensor | None = None, explicit: bool = False):
        self.context, self.visible, self.explicit = context, visible, explicit

    def attend(self, attn: BlockAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        R, H, n, hd = q.shape
        ctx = attn.expand(self.context[attn.layer])
        own = (expand_heads(k, attn.hmap), expand_heads(v, attn.hmap))
        mask = None if self.visible is None else self.visible.to(torch.bool)[:, None, None, :]   # [R, 1, 1, S]
        if self.explicit:
            keys = torch.cat([kk for kk, _ in ctx] + [own[0]], -2)
            vals = torch.cat([vv for _, vv in ctx] + [own[1]], -2)
            s = (q.float() @ keys.float().transpose(-1, -2)) * hd ** -0.5
            if mask is not None:      # each source's entries share the context positions' visibility
                own_mask = torch.ones(R, 1, 1, n, dtype=torch.bool, device=q.device)
                s = s.masked_fill(~torch.cat([mask] * len(ctx) + [own_mask], -1), float("-inf"))
            o = (torch.softmax(s, -1) @ vals.float()).to(q.dtype)
        else:
            o = attend(q, [KeyBlock(kk, vv, mask) for kk, vv in ctx] + [KeyBlock(*own)])
        return o.transpose(1, 2).reshape(R, n, H * hd)


class _UnrollContext(BlockContext):
    """Key blocks for the parallel training pass: per source a causal T x T block (or the padding-aware mask),
    plus the block's own B keys per anchor row (`attend_block`)."""

    def __init__(self, drafter: BlockDrafter, batch: int, T: int, rows: torch.Tensor | None,
                 hidden: torch.Tensor | None, target_kv, position_ids: torch.Tensor, mask: torch.Tensor | None):
        self.batch, self.T, self.rows, self.mask = batch, T, rows, mask     # mask None: the plain causal triangle
        self.hidden = hidden
        self.target_kv = target_kv
        cfg = drafter.config
        self.rope_h = drafter.rope(position_ids) if cfg.uses_features else None
        self.rope_kv = drafter.rope_for_target(position_ids) if cfg.reads_kv else None

    def _to_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[R, ...] anchor rows -> [batch*T, ...], zeros at the positions that are not anchors."""
        if self.rows is None:
            return x
        return x.new_zeros(self.batch * self.T, *x.shape[1:]).index_copy(0, self.rows, x)

    def _from_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.rows is None else x.index_select(0, self.rows)

    def attend(self, attn: BlockAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        R, H, n, hd = q.shape
        b, T = self.batch, self.T
        blocks = [KeyBlock(kk, vv, causal=True) if self.mask is None else KeyBlock(kk, vv, self.mask)
                  for kk, vv in attn.expand(attn.context(self.hidden, self.target_kv, self.rope_h, self.rope_kv))]
        # [R, H, n, hd] -> [b, H, T, n, hd]: T rows of n queries (all anchors: a view), each row's own n keys
        rows = lambda x: self._to_rows(x).view(b, T, H, n, hd).transpose(1, 2)   # noqa: E731
        o = attend_block(rows(q), blocks, rows(expand_heads(k, attn.hmap)), rows(expand_heads(v, attn.hmap)))
        return self._from_rows(o.permute(0, 2, 3, 1, 4).reshape(b * T, n, H * hd))


# -- training -------------------------------------------------------------------------------------------------

def sample_anchors(loss_mask: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   max_anchors: int | None = None, generator: torch.Generator | None = None,
                   span: int = 1) -> torch.Tensor:
    """Anchors for one training batch: bool [B, T], a uniform random subset of at most `max_anchors` positions per
    sequence among those whose block carries loss: one of its first `span` predicted tokens t+2 .. t+1+span is a
    loss token and not padding (span = block_size - 1: every anchor the loss can reach, as the TTT unroll scores
    every position some step of which is scored). max_anchors None or 0: every such position."""
    B, T = loss_mask.shape
    ok = loss_mask.to(torch.bool)
    if attention_mask is not None:
        ok = ok & attention_mask.to(torch.bool)
    cand = torch.zeros(B, T, dtype=torch.bool, device=loss_mask.device)
    for j in range(2, 2 + max(span, 1)):
        if j < T:
            cand[:, :T - j] |= ok[:, j:]
    if not max_anchors or max_anchors >= T:
        return cand
    score = torch.rand(B, T, generator=generator).to(loss_mask.device)
    score = torch.where(cand, score, -1.0)
    top = score.topk(max_anchors, dim=1).indices
    return torch.zeros_like(cand).scatter_(1, top, True) & cand


def block_unroll(drafter: BlockDrafter, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                 attention_mask: torch.Tensor | None = None, features: torch.Tensor | None = None,
                 target_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 target_logits: torch.Tensor | None = None, target_hidden: torch.Tensor | None = None,
                 lm_head_weight: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                 anchors: torch.Tensor | None = None, decay: float = 0.8, return_logits: bool = False,
                 target_top1: torch.Tensor | None = None, target_top1_logit: torch.Tensor | None = None) -> TTTOutput:
    """The parallel training pass of a block drafter over many anchors (see the module docstring).

    Inputs as `models.ttt.ttt_unroll`: input_ids, loss_mask, attention_mask, position_ids [B, T] (right padding
    takes the fused causal path; any other padding an explicit mask); features [B, T, n_features*d] (context
    hidden/both); target_kv per kv layer (K, V) [B, Hkv, T, hd] post-RoPE (kv/both); target_logits [B, T, V], or
    target_hidden [B, T, d] with lm_head_weight [V, d], optionally with the target's top-1 id and logit [B, T]
    (only the draft rows of the head are then multiplied, as in the compact TTT unroll); the teacher is computed
    only at the rows that score something. anchors: bool [B, T] (None = every position).
    Returns a `TTTOutput` with steps = block_size - 1: step k is block position k+1, predicting token t+2+k,
    weighted decay**k in the loss. With return_logits, logits[k] is [B, T, V_draft], entry [b, t] anchor t's
    prediction at step k (zeros where t is not an anchor).
    """
    B, T = input_ids.shape
    dev = input_ids.device
    cfg = drafter.config
    n, steps = cfg.block_size, cfg.block_size - 1
    check_inputs("block_unroll", drafter, input_ids, loss_mask, features)
    if cfg.reads_kv and target_kv is None:
        raise ValueError(f"block_unroll: context {cfg.context!r} needs target_kv")
    if anchors is not None and anchors.shape != (B, T):
        raise ValueError(f"block_unroll: anchors has shape {tuple(anchors.shape)}, expected {(B, T)}")
    require_teacher("block_unroll", target_logits, target_hidden, lm_head_weight)
    attention_mask, position_ids, mask, scored = layout(loss_mask, attention_mask, position_ids)
    probs, tgt_teach, where, usable = scored_teacher(drafter, scored, target_logits, target_hidden, lm_head_weight,
                                                     target_top1, target_top1_logit)
    Vd = cfg.draft_vocab_size

    every = anchors is None or bool(anchors.all())
    anchors = torch.ones(B, T, dtype=torch.bool, device=dev) if anchors is None else anchors.to(torch.bool)
    rows = None if every else anchors.reshape(-1).nonzero().squeeze(1)
    row_of = None if rows is None else _inverse(rows, B * T)      # flat position -> anchor row

    hidden = drafter.context_hidden(features) if cfg.uses_features else None
    ctx = _UnrollContext(drafter, B, T, rows, hidden, target_kv if cfg.reads_kv else None, position_ids, mask)
    root_ids = _shift(input_ids, 1, 0).reshape(-1)                 # anchor t's root is token t+1
    root_pos = (position_ids + 1).reshape(-1)
    if rows is not None:
        root_ids, root_pos = root_ids[rows], root_pos[rows]
    h = drafter.forward_block(root_ids, root_pos, ctx)             # [R, n, d]

    logits_rows = drafter.head(h[:, 1:]) if return_logits else None   # [R, n-1, Vd]
    valids, idxs, targets, picked = [], [], [], []
    for k in range(steps):
        # anchor t at step k (block position k+1) is scored against the target's logits at t+1+k
        valid = _shift(usable, 1 + k, False) & anchors
        idx = valid.reshape(-1).nonzero().squeeze(1)
        r = idx if row_of is None else row_of[idx]
        valids.append(valid.reshape(-1))
        idxs.append(idx)
        targets.append(where[idx + 1 + k])
        picked.append(logits_rows[r, k] if return_logits else h[r, k + 1])
    z = torch.cat(picked) if return_logits else drafter.head(torch.cat(picked))
    total, losses, counts = score_teacher_rows(z, probs, tgt_teach, idxs, targets, torch.stack(valids), decay)
    all_logits = None
    if return_logits:
        full = logits_rows if rows is None else \
            logits_rows.new_zeros(B * T, steps, Vd).index_copy(0, rows, logits_rows)
        all_logits = [full[:, k].reshape(B, T, Vd) for k in range(steps)]
    drafter.last_gates = {}
    return TTTOutput(loss=total, losses=losses, counts=counts, gate_means={}, logits=all_logits)


# -- the reference --------------------------------------------------------------------------------------------

@torch.no_grad()
def block_reference(drafter: BlockDrafter, input_ids: torch.Tensor, features: torch.Tensor | None = None,
                    target_kv=None, attention_mask: torch.Tensor | None = None,
                    position_ids: torch.Tensor | None = None, anchors: torch.Tensor | None = None) -> torch.Tensor:
    """The block drafter run anchor by anchor: for each t, its block alone over the context of positions <= t
    (sliced explicitly, projected afresh, padding masked), plain dense softmax attention.
    Returns [B-1, batch, T, V_draft] (step k = block position k+1), NaN where t is not an anchor or has no root."""
    b, T = input_ids.shape
    dev = input_ids.device
    cfg = drafter.config
    steps = cfg.block_size - 1
    out = torch.full((steps, b, T, cfg.draft_vocab_size), float("nan"), device=dev)
    if position_ids is None:
        position_ids = torch.arange(T, device=dev).expand(b, T)
    for t in range(T - 1):
        rows = torch.arange(b, device=dev) if anchors is None else anchors[:, t].nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        pos = position_ids[rows, :t + 1]
        feats = features[rows, :t + 1] if cfg.uses_features else None
        kv = [(k[rows, :, :t + 1], v[rows, :, :t + 1]) for k, v in target_kv] if cfg.reads_kv else None
        context = drafter.context_kv(pos, feats, kv)
        visible = None if attention_mask is None else attention_mask[rows, :t + 1]
        ctx = _DenseContext(context, visible, explicit=True)
        h = drafter.forward_block(input_ids[rows, t + 1], position_ids[rows, t] + 1, ctx)
        logits = drafter.head(h[:, 1:]).float()                    # [rows, steps, V]
        out[:, rows, t] = logits.transpose(0, 1)
    return out


__all__ = ["BlockAttention", "BlockDrafter", "BlockLayer", "ContextKV", "block_reference", "block_unroll",
           "sample_anchors"]
