"""Drive a block drafter (`models.block.BlockDrafter`) as a tree proposer: one drafter pass per round.

State: per drafter layer, the context (K, V) of every position in the target cache (positions 0..S-1, S = the
target cache length), i.e. exactly the context an anchor at t = S-1 sees in training:
- `hidden` context: the layer's projections of the fused target features, extended by each `TargetUpdate`'s
  new tokens (the accepted path's features, in order, at positions start..start+m-1);
- `kv` context: the injected live target cache, extended by its new tail only (positions already injected are
  unchanged: verification compacts the accepted nodes down to start.. and crops the rest, so below the tail the
  cache holds what it held when it was injected).
A round's `propose(root, spec)` is one pass over the block [root, mask x (B-1)] at positions S..S+B-1 (the root is
the token the target just emitted, not yet in its cache) -> per block position j = 1..B-1 the draft log-probs of
the token at S+j, i.e. tree level j. The tree is EAGLE-2's dynamic tree (`draft_tree`) whose `expand` callback
returns block position level+1's log-probs for every frontier node: the block's distributions do not depend on
the drafted prefix, so the selection picks the best joint paths of per-position top-k tokens. Depth is capped at
B-1 levels. Nothing of the tree enters the state: the next update brings the accepted tokens' own target info.
"""
from __future__ import annotations

import torch

from models.block import BlockDrafter, ContextKV
from models.decoding.proposers import TargetUpdate
from models.decoding.drafter_proposer import check_fits
from models.decoding.tree import DraftTree, TreeSpec, draft_tree
from models.target import Target


def _cat(old: ContextKV | None, new: ContextKV) -> ContextKV:
    if old is None:
        return new
    return {i: [(torch.cat([ko, kn], 2), torch.cat([vo, vn], 2)) for (ko, vo), (kn, vn) in zip(old[i], new[i])]
            for i in new}


class BlockProposer:
    """Tree proposals from a block drafter reading the target's features and/or live KV; batch 1.

    The drafter is moved to the target's device and dtype (its attention reads the target's tensors as they are).
    """

    def __init__(self, drafter: BlockDrafter, target: Target):
        cfg = drafter.config
        if cfg.variant != "block":
            raise ValueError(f"block proposer: drafter variant {cfg.variant!r} is not 'block' (use DrafterProposer)")
        check_fits(cfg, target)
        self.drafter = drafter.to(device=target.device, dtype=target.dtype).eval()
        self.target = target
        self.cfg = cfg
        self.d2t = self.drafter.d2t
        self.context: ContextKV | None = None
        self.length = 0            # context positions held = the target cache length after the last update

    # -- protocol ----------------------------------------------------------------------------------------------
    def begin(self, update: TargetUpdate) -> None:
        self.context, self.length = None, 0
        self._extend(update)

    def update(self, update: TargetUpdate) -> None:
        if update.start != self.length:
            raise ValueError(f"block proposer: update starts at {update.start}, the drafter holds {self.length}")
        self._extend(update)

    @torch.no_grad()
    def propose(self, root: int, spec: TreeSpec) -> DraftTree:
        logp = self.block_log_probs(root)                  # [B-1, V_draft]: row j-1 = tree level j
        depth = min(spec.depth, logp.shape[0] - 1)          # levels 1..depth+1 <= B-1
        spec = TreeSpec(depth, spec.top_k, spec.total_tokens)

        def expand(tokens: torch.Tensor, src: torch.Tensor, level: int) -> torch.Tensor:
            return logp[level].expand(tokens.numel(), -1)   # children of level-`level` nodes sit at level+1

        return draft_tree(root, logp[0], expand, spec, self.d2t)

    # -- pieces ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def block_log_probs(self, root: int) -> torch.Tensor:
        """The one drafter pass of a round: log-probs [B-1, V_draft] of block positions 1..B-1 (the tokens at
        positions S+1 .. S+B-1, S = the target cache length) given the root token at S."""
        if self.context is None:
            raise RuntimeError("block proposer: propose() before begin()")
        dev = self.target.device
        ids = torch.tensor([root], device=dev)
        pos = torch.tensor([self.length], device=dev)
        logits = self.drafter.draft(ids, pos, self.context)[0]
        return torch.log_softmax(logits.float(), -1)

    @torch.no_grad()
    def _extend(self, update: TargetUpdate) -> None:
        """Project the context of the update's tokens (positions start..start+m-1) and append it."""
        dev = self.target.device
        start, m = update.start, update.tokens.numel()
        end = start + m
        feats = torch.cat(update.features, -1).to(dev) if self.cfg.uses_features else None
        kv = None
        if self.cfg.reads_kv:
            layers = update.cache.layers
            S_t = layers[self.target.kv_layers[0]].keys.shape[2]
            if S_t != end:
                raise ValueError(f"block proposer: the target cache holds {S_t} tokens, the update ends at {end}")
            kv = [(layers[i].keys[:, :, start:end], layers[i].values[:, :, start:end]) for i in self.target.kv_layers]
        pos = torch.arange(start, end, device=dev)[None]
        self.context = _cat(self.context, self.drafter.context_kv(pos, feats, kv))
        self.length = end
