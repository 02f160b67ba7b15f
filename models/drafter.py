"""The KVShot drafters (DESIGN §5): `eagle3`, `kv_only`, `hybrid`, `cross_only`, one `Drafter` module.

The block-wise drafter family (`block`: one pass drafts a whole block of tokens) shares the config
(`models.drafter_config.DrafterConfig`), this module's `DraftModel` base (embedding, fc, head, vocabulary, RoPE)
and `Injection`; its module is `models.block.BlockDrafter`. `models.build.build_drafter(cfg)` returns the right
module for any variant.

Alignment (DESIGN §4). Entry (t, k) -- position t, speculative step k -- reads target information about tokens
<= t, takes the token t+1+k as input and predicts token t+2+k. Its RoPE position is the absolute position of
its input token, `pos(t) + 1 + k` (pos = the target's position ids, normally t). Self-attention only sees
relative offsets, so the +1 changes nothing for `eagle3`; for the KV readers it puts a query for token t+1+k
at the distance from each prefix key that the target itself would use.

Pieces (names are the state-dict prefixes):
- `embed_tokens`: the target's token embedding, frozen (copied in with `load_target_weights`).
- `fc` (eagle3, hybrid, cross_only): Linear(3d -> d) over the concat of the three target features. Step 0's
  hidden input is fc(features at t); step k>0's is the drafter's own previous output hidden (pre final norm).
  EAGLE-3.1's two options against attention drift, both off by default: `fc_norm` puts one RMSNorm per fused
  feature before `fc` (`fc_norms.j`), `norm_output` feeds step k+1 the *post*-final-norm hidden of step k
  (`Drafter.carry`). `eagle3` with both on is "EAGLE-3.1".
- `layers.i`: Llama-style decoder layers. Layer 0 of the eagle3 family reads [norm(emb); norm(hidden)] (2d)
  and keeps the hidden as its residual (EAGLE-3); other layers read d. kv_only's input is the embedding alone.
  * `self_attn`: attention over the drafter's own keys (eagle3, hybrid).
  * `cross_attn`: the KV reader (kv_only, hybrid, cross_only). Its prefix keys are the injected target KV of
    positions <= t (`inject`, per layer); the draft tokens' keys come from its own k_proj/v_proj. An entry of
    the drafter's own whose input token already lies inside the visible target KV is not seen by this branch
    (the target's KV covers it), so a query sees target KV <= t plus its own chain t+1 .. t+1+k.
    `no_target` (kv_only only: the paper's "no target information" control) drops the target prefix from the
    keys and keeps everything else, so a query sees only its own chain t+1 .. t+1+k: the target KV it is handed
    changes nothing.
    `token_context` (with `no_target`: the control with context) gives that control a prefix of its own: the
    branch attends causally over the drafter's own entries of the prefix tokens, as a self-attention branch does,
    so the drafter is a small causal language model of its own depth over the frozen token embeddings (layer 0's
    prefix keys are its W_K/W_V of the embeddings, a deeper layer's those of its own hidden states there). It
    reads no target KV at all (`reads_kv` is False): the trainer and the decoder hand it none.
  * hybrid: n = self_attn, o = cross_attn, Δ = o - n, g = σ(W_g[n; o; Δ] + b_g), attention output
    n + g ⊙ W_Δ Δ (`gate`, `delta`). g = 0 gives eagle3 exactly; `force_gate(0.0)` pins it there.
  * `post_attention_layernorm`, `mlp` (SwiGLU).
- `norm`, `lm_head` (d -> draft vocab); buffers `d2t` (draft index -> target id, the ids themselves, not
  EAGLE-3's offsets) and `t2d` (bool over the target vocab), both saved in the state dict.
  `embed_tokens.weight` is in the state dict too; a checkpoint may leave it out and restore it with
  `load_target_weights` after `load_state_dict(..., strict=False)`.

Warm start (`init=ckpt`): `init_from_eagle3(drafter, eagle3_state_dict)` copies every tensor of the same name
and shape (fc, self_attn, MLP, norms, head, vocabulary; cross_only has no self_attn to receive) and returns
the loaded and the new keys (cross_attn, gate, delta).

Injection of the L_s target layers' KV (`[B, Hkv_t, S, hd]` each, post-RoPE):
- `linear`: per KV head h, a learned map from the concat of the L_s layers' key (and, separately, value)
  vectors (L_s*hd) to one hd vector: one unified KV with the target's Hkv heads. Initialised to the mean of
  the layers. rope_fix=False projects the rotated keys as they are; rope_fix=True un-rotates each layer's keys
  at their positions, projects, and re-rotates the result at the same positions (queries are always rotated
  at their own absolute positions).
- `head_concat`: the L_s layers' KV heads side by side (L_s*Hkv_t heads, layer-major); query head h reads KV
  head floor(h * L_s*Hkv_t / H), i.e. contiguous query-head groups read one source layer. No parameters, so
  rope_fix has no effect with it.

Incremental API (decoding; also the naive reference the TTT unroll is tested against):
    logits, hidden_out = drafter.step(input_ids, hidden_in, positions, cache, self_mask, target_kv, target_mask)
- input_ids `[B, n]` input tokens; hidden_in `[B, n, d]` (eagle3 family: `drafter.fuse(features)` for entries
  with target features, the previous step's hidden_out for draft tokens; None for kv_only); positions
  `[B, n]` the RoPE positions (input-token positions).
- cache: a `DraftCache`; the call appends the n new own entries. `cache.select(idx)` keeps some entries
  (drop rejected tree branches), `cache.crop(n)` keeps the first n.
- self_mask `[B, n, S_own + n]` bool: which own entries (cached + new) each query may see (causal among
  accepted tokens, ancestors in a draft tree, itself).
- target_kv: per kv layer (K, V) `[B, Hkv_t, S_t, hd]`, the target's live cache of the prefix, at positions
  0..S_t-1. The projected prefix is kept in the cache and extended by the new tail only (entries already
  projected are assumed unchanged; call `cache.crop_prefix(n)` if the target cache is rewritten below them).
- target_mask `[B, n, S_t]` bool (None = all visible).
Returns draft-vocabulary logits `[B, n, V_draft]` and the hidden the next step reads `[B, n, d]` (the output
hidden, pre final norm; post-norm with `norm_output`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from models.context import QueryContext
from models.drafter_config import DrafterConfig
from models.layers import MLP, KeyBlock, RMSNorm, attend, expand_heads, head_map, take_rows
from models.rope import RotaryEmbedding, apply_rope, unapply_rope

# -- attention modules ----------------------------------------------------------------------------------------

class Injection(nn.Module):
    """Target KV of the L_s layers -> the cross branch's prefix KV (see the module docstring)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.mode = cfg.injection
        self.rope_fix = cfg.rope_fix
        if self.mode == "linear":
            L, Hkv, hd_t, hd = cfg.n_kv_layers, cfg.num_kv_heads, cfg.target_head_dim, cfg.head_dim
            if cfg.target_num_kv_heads != Hkv:
                raise ValueError(f"linear injection maps KV head to KV head: target has {cfg.target_num_kv_heads} "
                                 f"KV heads, the drafter {Hkv}")
            mean = torch.cat([torch.eye(hd_t, hd)] * L, 0) / L
            self.k_proj = nn.Parameter(mean.expand(Hkv, -1, -1).clone())   # [Hkv, L*hd_t, hd]
            self.v_proj = nn.Parameter(mean.expand(Hkv, -1, -1).clone())

    def forward(self, kv: list[tuple[torch.Tensor, torch.Tensor]], cos: torch.Tensor | None = None,
                sin: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """kv: per layer (K, V) `[B, Hkv_t, S, hd]`; cos/sin `[B, 1, S, hd]` of the keys' positions (rope_fix)."""
        if self.mode == "head_concat":
            return torch.cat([k for k, _ in kv], 1), torch.cat([v for _, v in kv], 1)
        ks = [k for k, _ in kv]
        if self.rope_fix:
            ks = [unapply_rope(k.float(), cos, sin) for k in ks]
        dtype = torch.get_autocast_dtype(self.k_proj.device.type) \
            if torch.is_autocast_enabled(self.k_proj.device.type) else self.k_proj.dtype
        k = torch.einsum("bhsi,hio->bhso", torch.cat(ks, -1).to(dtype), self.k_proj.to(dtype))
        v = torch.einsum("bhsi,hio->bhso", torch.cat([v for _, v in kv], -1).to(dtype), self.v_proj.to(dtype))
        if self.rope_fix:
            k = apply_rope(k, cos.to(k.dtype), sin.to(k.dtype))
        return k, v


class Attention(nn.Module):
    """q/k/v/o projections; which keys the queries see is decided by the context (`ctx`) of the call."""

    def __init__(self, in_dim: int, cfg: DrafterConfig, cross: bool, layer: int):
        super().__init__()
        H, hd = cfg.num_heads, cfg.head_dim
        self.cross, self.layer = cross, layer
        self.num_kv_heads = cfg.cross_kv_heads if cross else cfg.num_kv_heads
        self.head_dim = hd
        self.q_proj = nn.Linear(in_dim, H * hd, bias=False)
        self.k_proj = nn.Linear(in_dim, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(in_dim, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(H * hd, cfg.hidden_size, bias=False)
        self.register_buffer("hmap", head_map(H, self.num_kv_heads), persistent=False)
        if cross and not cfg.no_target:
            self.inject = Injection(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, n, d] -> [B, n, d]; with `rows` (flat indices into B*n) only those entries query, [1, len(rows), d]
        (keys and values still come from every entry)."""
        B, n, _ = x.shape
        xq, cq, sq = (x, cos, sin) if rows is None else (take_entries(x, rows), take_rows(cos, rows),
                                                          take_rows(sin, rows))
        nq = xq.shape[1]          # the head count spelled out: a view cannot infer it when no entry queries
        q = self.q_proj(xq).view(xq.shape[0], nq, self.q_proj.out_features // self.head_dim,
                                 self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, n, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, n, -1, self.head_dim).transpose(1, 2)
        q = apply_rope(q, cq.to(q.dtype), sq.to(q.dtype))
        k = apply_rope(k, cos.to(k.dtype), sin.to(k.dtype))
        blocks = ctx.cross_blocks(self, k, v, rows) if self.cross else ctx.self_blocks(self, k, v, rows)
        o = attend(q, blocks)
        return self.o_proj(o.transpose(1, 2).reshape(xq.shape[0], nq, self.o_proj.in_features))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, index: int):
        super().__init__()
        d = cfg.hidden_size
        self.index = index
        self.fused_input = cfg.uses_features and index == 0
        in_dim = 2 * d if self.fused_input else d
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        if self.fused_input:
            self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
        if cfg.variant in ("eagle3", "hybrid"):
            self.self_attn = Attention(in_dim, cfg, cross=False, layer=index)
        if cfg.cross_branch:
            self.cross_attn = Attention(in_dim, cfg, cross=True, layer=index)
        self.hybrid = cfg.variant == "hybrid"
        if self.hybrid:
            self.gate = nn.Linear(3 * d, d, bias=True)
            self.delta = nn.Linear(d, d, bias=False)
            nn.init.zeros_(self.gate.bias)      # g starts near 0.5
        self.gate_override: float | None = None
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.mlp = MLP(d, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, emb: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                ctx, rows: torch.Tensor | None = None) -> torch.Tensor:
        """One layer over n entries [B, n, d]; with `rows` only those entries' outputs, [1, len(rows), d]."""
        residual = x if rows is None else take_entries(x, rows)
        if self.fused_input:
            h = torch.cat([self.input_layernorm(emb), self.hidden_norm(x)], -1)
        else:
            h = self.input_layernorm(x)
        h = _compute_dtype(h)       # cast once here, not once per projection
        if self.hybrid:
            n = self.self_attn(h, cos, sin, ctx, rows)
            if self.gate_override == 0.0:
                a = n               # the closed gate: exactly the eagle3 path, the cross branch not even run
            else:
                o = self.cross_attn(h, cos, sin, ctx, rows)
                delta = o - n
                if self.gate_override is None:
                    g = torch.sigmoid(self.gate(torch.cat([n, o, delta], -1)))
                else:
                    g = torch.full_like(n, self.gate_override)
                ctx.record_gate(self.index, g)
                a = n + g * self.delta(delta)
        elif hasattr(self, "self_attn"):
            a = self.self_attn(h, cos, sin, ctx, rows)
        else:
            a = self.cross_attn(h, cos, sin, ctx, rows)
        x = residual + a
        return x + self.mlp(self.post_attention_layernorm(x))


def take_entries(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[B, n, ...] -> [1, len(rows), ...]: the entries at flat indices `rows` (b * n + i)."""
    return x.reshape(-1, *x.shape[2:]).index_select(0, rows).unsqueeze(0)


def _compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """x in the autocast dtype when autocast is on (activations then stay bf16 between the matmuls)."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return x.to(torch.get_autocast_dtype(dev))
    return x


# -- the incremental cache ------------------------------------------------------------------------------------

def _cat(old: tuple | None, new: tuple) -> tuple:
    if old is None:
        return new
    return tuple(torch.cat([o, n], 2) for o, n in zip(old, new))


@dataclass
class DraftCache:
    """The drafter's own per-layer keys/values plus the projected target prefix (decoding state).

    own: {(layer, 'self'|'cross'): (K, V) [B, Hkv, S_own, hd]}; positions [B, S_own] (RoPE positions of the own
    entries); prefix: {layer: (K, V) [B, Hkv_cross, S_prefix, hd]} the injected target KV projected so far.
    """

    own: dict = field(default_factory=dict)
    positions: torch.Tensor | None = None
    prefix: dict = field(default_factory=dict)
    prefix_len: int = 0

    def __len__(self) -> int:
        return 0 if self.positions is None else self.positions.shape[1]

    def select(self, index: torch.Tensor) -> None:
        """Keep only own entries `index` (1D long, same for the whole batch), in that order."""
        if self.positions is None:
            return
        index = index.to(self.positions.device)
        self.own = {key: (k.index_select(2, index), v.index_select(2, index)) for key, (k, v) in self.own.items()}
        self.positions = self.positions.index_select(1, index)

    def crop(self, n: int) -> None:
        """Keep the first n own entries."""
        self.select(torch.arange(min(n, len(self))))

    def crop_prefix(self, n: int) -> None:
        """Forget projected target prefix beyond n (the target cache was rewritten there)."""
        if n < self.prefix_len:
            self.prefix = {i: (k[:, :, :n], v[:, :, :n]) for i, (k, v) in self.prefix.items()}
            self.prefix_len = n


class _StepContext(QueryContext):
    """Key blocks for `Drafter.step`: dense masks over cached + new entries."""

    def __init__(self, drafter: "Drafter", cache: DraftCache, positions: torch.Tensor, self_mask: torch.Tensor,
                 target_kv, target_mask):
        super().__init__(drafter)
        self.cache = cache
        self.self_mask = self_mask[:, None]
        self.target_kv, self.target_mask = target_kv, target_mask
        self.entry_pos = positions if cache.positions is None else torch.cat([cache.positions, positions], 1)
        self.new_prefix: dict = {}
        self.gates: dict = {}
        self._tmask: torch.Tensor | None = None

    def _own(self, attn: Attention, k, v, branch: str):
        key = (attn.layer, branch)
        kv = _cat(self.cache.own.get(key), (k, v))
        self.cache.own[key] = kv
        return expand_heads(kv[0], attn.hmap), expand_heads(kv[1], attn.hmap)

    def self_blocks(self, attn: Attention, k, v, rows=None) -> list[KeyBlock]:
        K, V = self._own(attn, k, v, "self")
        return [KeyBlock(K, V, self.self_mask)]

    def own_prefix(self, attn: Attention, k, v, rows=None) -> list[KeyBlock]:
        # its own entries of the accepted tokens are the prefix, seen as the self branch sees them (causal among
        # accepted tokens, tree ancestors, itself)
        K, V = self._own(attn, k, v, "cross")
        return [KeyBlock(K, V, self.self_mask)]

    def _target_mask(self) -> torch.Tensor:
        """[B, n, S_t] bool: the target entries each query may see (the same for every layer of the step, so made
        once); a reader of the target KV must be handed it."""
        if self.target_kv is None:
            raise ValueError(f"drafter.step: variant {self.drafter.config.variant!r} reads the target KV; "
                             "target_kv is required")
        if self._tmask is None:
            S_t = self.target_kv[0][0].shape[2]
            B, n = self.self_mask.shape[0], self.self_mask.shape[2]
            self._tmask = (torch.ones(B, n, S_t, dtype=torch.bool, device=self.entry_pos.device)
                           if self.target_mask is None else self.target_mask.to(torch.bool))
        return self._tmask

    def target_prefix(self, attn: Attention, rows=None) -> KeyBlock:
        tmask = self._target_mask()
        pk, pv = self._prefix(attn)
        return KeyBlock(expand_heads(pk, attn.hmap), expand_heads(pv, attn.hmap), tmask[:, None])

    def own_chain(self, attn: Attention, k, v, rows=None) -> KeyBlock:
        tmask = self._target_mask()
        S_t = tmask.shape[2]
        # an own entry whose input token is already inside the visible target KV is the target's business
        # (no_target: it stays unseen all the same, so a query sees exactly the chain it sees in training)
        last = torch.where(tmask, torch.arange(S_t, device=k.device), -1).amax(-1, keepdim=True)  # [B, n, 1]
        covered = self.entry_pos[:, None, :] <= last
        K, V = self._own(attn, k, v, "cross")
        return KeyBlock(K, V, self.self_mask & ~covered[:, None])

    def _prefix(self, attn: Attention):
        """The projected target prefix of this layer, extended by the target cache's new tail only."""
        cache, layer = self.cache, attn.layer
        S_t = self.target_kv[0][0].shape[2]
        if layer in self.new_prefix:
            return self.new_prefix[layer]
        old = cache.prefix.get(layer)
        P = 0 if old is None else old[0].shape[2]
        if S_t < P:
            old = (old[0][:, :, :S_t], old[1][:, :, :S_t])
            P = S_t
        if S_t > P:
            tail = [(k[:, :, P:S_t], v[:, :, P:S_t]) for k, v in self.target_kv]
            B = tail[0][0].shape[0]
            pos = torch.arange(P, S_t, device=tail[0][0].device).expand(B, -1)
            cos, sin = self.drafter.rope_for_target(pos)
            new = attn.inject(tail, cos, sin)
            old = _cat(old, new)
        cache.prefix[layer] = old
        self.new_prefix[layer] = old
        return old

    def record_gate(self, layer: int, g: torch.Tensor) -> None:
        self.gates[layer] = g.detach().float().mean()

    def finish(self) -> None:
        self.cache.positions = self.entry_pos
        if self.new_prefix:
            self.cache.prefix_len = next(iter(self.new_prefix.values()))[0].shape[2]


# -- the drafter ----------------------------------------------------------------------------------------------

class DraftModel(nn.Module):
    """What every drafter module shares (`Drafter`, `models.block.BlockDrafter`): the frozen target embedding
    `embed_tokens`, the feature fusion `fc` (+ `fc_norms`) when the config reads features, the subclass's `layers`,
    the final `norm` and the draft-vocabulary `lm_head`, RoPE, and the `d2t`/`t2d` buffers.

    `make_layers` builds the layers between fc and norm: construction order fixes the random initialisation, and
    this is the order `Drafter` always had.
    """

    def __init__(self, cfg: DrafterConfig, make_layers: Callable[[], nn.ModuleList]):
        super().__init__()
        self.config = cfg
        d = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d)
        self.embed_tokens.weight.requires_grad_(False)
        if cfg.uses_features:
            if cfg.fc_norm:
                self.fc_norms = nn.ModuleList(RMSNorm(d, cfg.rms_norm_eps) for _ in range(cfg.n_features))
            self.fc = nn.Linear(cfg.n_features * d, d, bias=False)
        self.layers = make_layers()
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(d, cfg.draft_vocab_size, bias=False)
        inv = torch.tensor(cfg.rope_inv_freq, dtype=torch.float32) if cfg.rope_inv_freq else None
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, inv, cfg.rope_scaling)
        self._inv_freq32 = self.rotary.inv_freq.clone()    # not a buffer: `.to(bf16)` must not round it
        ids = torch.arange(cfg.draft_vocab_size)
        self.register_buffer("d2t", ids.clone())
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        self.register_buffer("t2d", t2d)
        self.last_gates: dict[int, float] = {}

    # -- setup -------------------------------------------------------------------------------------------------
    def set_vocab(self, d2t: torch.Tensor) -> None:
        """Install the draft vocabulary (draft index -> target id)."""
        d2t = torch.as_tensor(d2t, dtype=torch.long, device=self.d2t.device)
        if d2t.shape != self.d2t.shape:
            raise ValueError(f"d2t: expected {self.config.draft_vocab_size} ids, got {tuple(d2t.shape)}")
        self.d2t.copy_(d2t)
        self.t2d.zero_()
        self.t2d[d2t] = True

    def outside_ids(self) -> torch.Tensor:
        """Target ids outside the draft vocabulary (cached until the vocabulary changes)."""
        key = (self.d2t.data_ptr(), self.d2t._version)
        if getattr(self, "_outside_key", None) != key:
            self._outside = (~self.t2d).nonzero().squeeze(1)
            self._outside_key = key
        return self._outside

    def target_to_draft(self) -> torch.Tensor:
        """[V] long: the draft index of each target id, -1 outside the draft vocabulary."""
        m = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=self.d2t.device)
        m[self.d2t] = torch.arange(self.d2t.numel(), device=self.d2t.device)
        return m

    @torch.no_grad()
    def load_target_weights(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor | None = None) -> None:
        """Copy the target's embedding (frozen); optionally start the head from the target's rows of d2t."""
        self.embed_tokens.weight.copy_(embed_weight.to(self.embed_tokens.weight.dtype))
        if lm_head_weight is not None:
            self.lm_head.weight.copy_(lm_head_weight[self.d2t.to(lm_head_weight.device)].to(self.lm_head.weight.dtype))

    # -- pieces --------------------------------------------------------------------------------------------------
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """[B, n, 3d] concat of the target features -> the step-0 hidden input [B, n, d]."""
        if not self.config.uses_features:
            raise ValueError(f"drafter variant {self.config.variant!r} takes no target features")
        if not torch.is_autocast_enabled():
            features = features.to(self.embed_tokens.weight.dtype)   # the drafter's dtype (fc may be int8)
        if self.config.fc_norm:
            parts = features.chunk(self.config.n_features, -1)
            features = torch.cat([norm(x) for norm, x in zip(self.fc_norms, parts)], -1)
        return self.fc(features)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin `[B, 1, n, hd]` (fp32) for positions [B, n]."""
        if self.rotary.inv_freq.dtype != torch.float32:      # the module was cast: restore exact frequencies
            self.rotary.inv_freq = self._inv_freq32.to(self.rotary.inv_freq.device)
        cos, sin = self.rotary(positions)
        return cos[:, None], sin[:, None]

    def rope_for_target(self, positions: torch.Tensor):
        """cos/sin to take target keys back to un-rotated form (undoes attention_scaling too)."""
        cos, sin = self.rope(positions)
        a2 = self.config.rope_scaling ** 2
        return (cos / a2, sin / a2) if a2 != 1.0 else (cos, sin)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: [.., d] -> [.., V_draft]."""
        return self.lm_head(self.norm(hidden))


class Drafter(DraftModel):
    """The autoregressive drafters (eagle3, kv_only, hybrid, cross_only): one token per step."""

    def __init__(self, cfg: DrafterConfig):
        if cfg.variant == "block":
            raise ValueError("drafter variant 'block' is models.block.BlockDrafter; build it with build_drafter(cfg)")
        super().__init__(cfg, lambda: nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.depth)))

    def force_gate(self, value: float | None) -> None:
        """Pin the hybrid gate to a constant (0.0 = closed: exactly eagle3); None restores the learned gate."""
        for layer in self.layers:
            layer.gate_override = value

    def carry(self, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden that step k+1 reads from step k's output: as is (EAGLE-3), or after the final norm
        (`norm_output`, EAGLE-3.1)."""
        return self.norm(hidden) if self.config.norm_output else hidden

    def forward_hidden(self, input_ids: torch.Tensor, hidden_in: torch.Tensor | None, positions: torch.Tensor,
                       ctx, rows: torch.Tensor | None = None) -> torch.Tensor:
        """One pass of the layers for n entries, keys supplied by `ctx` (TTT or step); returns hidden [B, n, d].

        `rows` (flat indices into B*n): only these entries' outputs are wanted, [1, len(rows), d]. Earlier layers
        still run everywhere (their outputs are the next layer's keys); the last one computes its keys everywhere
        and its queries, attention output and MLP at the rows alone."""
        emb = _compute_dtype(self.embed_tokens(input_ids))
        if self.config.uses_features:
            if hidden_in is None:
                raise ValueError(f"drafter variant {self.config.variant!r}: hidden_in is required")
            x = hidden_in
        else:
            x = emb
        cos, sin = self.rope(positions)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, emb if i == 0 else None, cos, sin, ctx, rows if i == last else None)
        return x

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, hidden_in: torch.Tensor | None, positions: torch.Tensor,
             cache: DraftCache, self_mask: torch.Tensor, target_kv=None,
             target_mask: torch.Tensor | None = None, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Incremental drafting (see the module docstring). Extends `cache` by the n new entries.

        `last_only` applies the head to the last entry alone (logits `[B, 1, V]`): a decoding catch-up needs one
        distribution, and the head is the drafter's largest matmul."""
        B, n = input_ids.shape
        S = len(cache) + n
        if tuple(self_mask.shape) != (B, n, S):
            raise ValueError(f"drafter.step: self_mask has shape {tuple(self_mask.shape)}, expected {(B, n, S)}")
        ctx = _StepContext(self, cache, positions, self_mask.to(torch.bool), target_kv, target_mask)
        hidden = self.forward_hidden(input_ids, hidden_in, positions, ctx)
        ctx.finish()
        self.last_gates = {i: float(g) for i, g in ctx.gates.items()}
        return self.head(hidden[:, -1:] if last_only else hidden), self.carry(hidden)


# -- warm start from a trained eagle3 -----------------------------------------------------------------------

@torch.no_grad()
def init_from_eagle3(drafter: Drafter, state_dict: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """Copy every tensor the drafter shares with a trained eagle3 drafter (same name and shape), bit-exactly.

    Returns (loaded keys, new keys left as initialised). A shared name with a different shape is an error.
    """
    loaded, new = [], []
    own = drafter.state_dict()
    for name, t in own.items():
        src = state_dict.get(name)
        if src is None:
            new.append(name)
            continue
        if tuple(src.shape) != tuple(t.shape):
            raise ValueError(f"init=ckpt: {name} has shape {tuple(src.shape)} in the eagle3 checkpoint, "
                             f"{tuple(t.shape)} in this drafter")
        t.copy_(src)
        loaded.append(name)
    return loaded, new
