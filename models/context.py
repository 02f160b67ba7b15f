"""Which keys a query sees (DESIGN §5), in one place for every way a drafter runs.

An autoregressive drafter's attention has up to two branches. The self branch (eagle3, hybrid) sees the drafter's
own entries: those of the prefix and the entry's chain (the same position's entries of the earlier speculative
steps). The cross branch (kv_only, hybrid, cross_only) sees the target's injected KV of the prefix and the drafter's
own chain; with `no_target` (the no-target control) the chain alone; with `token_context` (the control with context)
the drafter's own entries of the prefix and its chain, as the self branch sees them, and no target KV at all.

`QueryContext.cross_blocks` applies that rule. Each way of running lays the keys out in its own memory layout and
supplies the pieces: decoding step by step (`models.drafter`: dense masks over a cache), the parallel TTT unroll
and the compact unroll (`models.ttt`: a causal prefix block plus per-position chains).

A block drafter (`models.block`) drafts a whole block per anchor: a query sees the context entries up to its anchor
(the target's fused hidden states, its injected KV, or both, `drafter.context`) and the block's own entries. Its
two layouts (dense for decoding and the reference, rows of anchors for training) implement `BlockContext.attend`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from models.layers import KeyBlock


class QueryContext(ABC):
    """The keys of each attention branch of an autoregressive drafter, for one forward pass."""

    def __init__(self, drafter: Any):
        self.drafter = drafter

    # -- the pieces a layout supplies ----------------------------------------------------------------------------

    @abstractmethod
    def self_blocks(self, attn, k: torch.Tensor, v: torch.Tensor, rows=None) -> list[KeyBlock]:
        """The self branch: the drafter's own entries of the prefix and the chain."""

    @abstractmethod
    def own_prefix(self, attn, k: torch.Tensor, v: torch.Tensor, rows=None) -> list[KeyBlock]:
        """The cross branch of the control with context: its own entries, seen as the self branch sees them."""

    @abstractmethod
    def target_prefix(self, attn, rows=None) -> KeyBlock:
        """The target's injected KV of the prefix (projected once per layer and pass)."""

    @abstractmethod
    def own_chain(self, attn, k: torch.Tensor, v: torch.Tensor, rows=None) -> KeyBlock:
        """The drafter's own entries of the chain, with this call's appended."""

    # -- the rule ------------------------------------------------------------------------------------------------

    def cross_blocks(self, attn, k: torch.Tensor, v: torch.Tensor, rows=None) -> list[KeyBlock]:
        """The cross branch: target prefix + own chain; the chain alone with `no_target`; the drafter's own prefix
        and chain with `token_context`."""
        cfg = self.drafter.config
        if cfg.token_context:
            return self.own_prefix(attn, k, v, rows)
        prefix = None if cfg.no_target else self.target_prefix(attn, rows)
        chain = self.own_chain(attn, k, v, rows)
        return [chain] if prefix is None else [prefix, chain]


class BlockContext(ABC):
    """The keys of a block drafter's attention: the context entries each anchor may see, then the block's own."""

    @abstractmethod
    def attend(self, attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention output `[R, n, H*hd]` of the block queries `q` over the context and the block keys `k`, `v`."""


__all__ = ["BlockContext", "QueryContext"]
