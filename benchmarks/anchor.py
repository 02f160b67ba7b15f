"""The throughput anchor: SpecForge's offline EAGLE-3 training step, rebuilt from its published algorithm.

`benchmarks/train.py` states kvshot's training speed as a multiple of this step, timed in the same run on the same
batch, so the ratio holds on any machine. What makes it the anchor is the work it does, which follows SpecForge's
`OfflineEagle3Model` and its Llama EAGLE-3 draft layer step for step:
  * the target's full-vocabulary logits from its last hidden state, then per step the draft-vocabulary slice of
    them, softmaxed in fp32, as the soft teacher (recomputed at every one of the K steps);
  * fc over the three fused layers; per step a decoder layer on [norm(embedding), norm(hidden)] (2d wide q/k/v),
    rotary positions shifted by the step index, attention of every position over the causal prefix of step 0's
    keys plus the same position's keys of the later steps (the "cache_hidden" diagonal), SwiGLU MLP, final norm,
    the draft head over every position;
  * log-softmax over the draft vocabulary at every position, the loss masked by the loss mask and by whether the
    target's top-1 lies in the draft vocabulary, averaged over all positions;
  * between steps the inputs, teacher logits and loss mask shift left by one (padding at the end) and the
    attention mask drops the diagonal that would now see the future.
Nothing is compacted or skipped: every position is computed at every step, as the anchor does.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rotate(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _shift_left(x: torch.Tensor) -> torch.Tensor:
    """SpecForge's `padding(x, left=False)`: drop the first position, pad zeros at the end."""
    return torch.cat((x[:, 1:], torch.zeros_like(x[:, :1])), dim=1)


class AnchorEagle3(nn.Module):
    """The anchor's draft model: fc, one EAGLE-3 decoder layer, norm and a draft-vocabulary head."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int,
                 vocab_size: int, draft_vocab_size: int, rms_norm_eps: float = 1e-5, rope_theta: float = 10000.0,
                 **_):
        super().__init__()
        d = hidden_size
        self.h, self.hkv, self.hd, self.eps = num_heads, num_kv_heads, head_dim, rms_norm_eps
        self.embed = nn.Embedding(vocab_size, d)
        self.embed.weight.requires_grad_(False)        # frozen, as in the anchor
        self.fc = nn.Linear(3 * d, d, bias=False)
        self.in_norm, self.hid_norm, self.post_norm, self.norm = (nn.Parameter(torch.ones(d)) for _ in range(4))
        self.q = nn.Linear(2 * d, num_heads * head_dim, bias=False)
        self.k = nn.Linear(2 * d, num_kv_heads * head_dim, bias=False)
        self.v = nn.Linear(2 * d, num_kv_heads * head_dim, bias=False)
        self.o = nn.Linear(num_heads * head_dim, d, bias=False)
        self.gate = nn.Linear(d, intermediate_size, bias=False)
        self.up = nn.Linear(d, intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, d, bias=False)
        self.head = nn.Linear(d, draft_vocab_size, bias=False)
        self.register_buffer("inv_freq", 1.0 / rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
        self.register_buffer("t2d", torch.zeros(vocab_size, dtype=torch.bool))
        self.register_buffer("d2t", torch.arange(draft_vocab_size))
        self.t2d[:draft_vocab_size] = True

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ang = positions[:, None].float() * self.inv_freq[None]
        emb = torch.cat((ang, ang), dim=-1)
        return x * emb.cos().to(x.dtype) + _rotate(x) * emb.sin().to(x.dtype)

    def layer(self, embeds: torch.Tensor, hidden: torch.Tensor, cache: list[list[torch.Tensor]],
              mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        B, T, _ = hidden.shape
        x = torch.cat((_rms(embeds, self.in_norm, self.eps), _rms(hidden, self.hid_norm, self.eps)), dim=-1)
        q = self.q(x).view(B, T, self.h, self.hd).transpose(1, 2)
        k = self.k(x).view(B, T, self.hkv, self.hd).transpose(1, 2)
        v = self.v(x).view(B, T, self.hkv, self.hd).transpose(1, 2)
        step = len(cache[0])
        q, k = self._rope(q, positions + step), self._rope(k, positions + step)
        rep = self.h // self.hkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        cache[0].append(k)
        cache[1].append(v)
        scale = 1.0 / math.sqrt(self.hd)
        scores = [q @ cache[0][0].transpose(-1, -2) * scale + mask]
        scores += [((q * ki).sum(-1) * scale)[..., None] for ki in cache[0][1:]]
        w = torch.softmax(torch.cat(scores, dim=-1), dim=-1, dtype=torch.float32).to(q.dtype)
        out = w[..., :T] @ cache[1][0]
        for i, vi in enumerate(cache[1][1:]):
            out = out + w[..., T + i:T + i + 1] * vi
        h = hidden + self.o(out.transpose(1, 2).reshape(B, T, -1))
        y = _rms(h, self.post_norm, self.eps)
        return h + self.down(F.silu(self.gate(y)) * self.up(y))

    def forward(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, features: torch.Tensor,
                target_hidden: torch.Tensor, lm_head_weight: torch.Tensor, attention_mask: torch.Tensor | None = None,
                steps: int = 7, **_) -> torch.Tensor:
        B, T = input_ids.shape
        with torch.no_grad():
            target = F.linear(target_hidden, lm_head_weight)          # the full-vocabulary teacher logits
        lmask = loss_mask[..., None].to(features.dtype if features.is_floating_point() else torch.float32)
        hidden = self.fc(features)
        causal = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)
        pad = torch.zeros(B, 1, 1, T) if attention_mask is None else \
            (1.0 - attention_mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
        mask = (causal[None, None] + pad).clamp_min(torch.finfo(torch.float32).min).to(hidden.dtype)
        positions = torch.arange(T)
        cache: list[list[torch.Tensor]] = [[], []]
        losses = []
        for idx in range(steps):
            embeds = self.embed(input_ids).to(hidden.dtype)
            hidden = self.layer(embeds, hidden, cache, mask, positions)
            with torch.no_grad():
                in_draft = self.t2d[target.argmax(-1)][..., None].to(lmask.dtype)
                position_mask = in_draft * lmask
                target_p = torch.softmax(target[..., self.t2d].float(), dim=2)
            logits = self.head(_rms(hidden, self.norm, self.eps)).float()
            logp = torch.log_softmax(logits, dim=2)
            losses.append(-(position_mask * target_p * logp).sum(2).mean())
            if idx < steps - 1:
                input_ids, target, lmask = _shift_left(input_ids), _shift_left(target), _shift_left(lmask)
                ind = torch.arange(idx, T)
                mask = mask.clone()
                mask[:, :, ind, ind - idx] = torch.finfo(mask.dtype).min
        return sum(0.8 ** i * l for i, l in enumerate(losses))
