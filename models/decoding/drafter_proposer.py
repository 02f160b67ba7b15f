"""Drive a trained `models.drafter.Drafter` (any variant) as a tree proposer.

Per round (EAGLE-2 style):
1. catch-up: one drafter step over the tokens that entered the target cache since the last round. Entry t
   (position t in the target cache) takes the target features at t (eagle3 family) and token t+1 (the last
   entry's token is the root, the target's newest token), reads the target KV <= t (KV readers) and sits at
   RoPE position t+1. Its output at the last entry gives the tree's first level.
2. expansion: `depth` steps over the top_k frontier, each node fed with its own token, its parent entry's
   output hidden, RoPE position = its absolute position, self-attention over the accepted entries plus its
   tree ancestors, and (KV readers) the whole live target cache. The KV readers never recompute the prefix:
   the drafter's cache keeps the projected target KV and extends it by the new tail only.
3. the tree entries are dropped from the drafter cache before the next catch-up (rejected branches discarded;
   the accepted ones are recomputed with real target features, as EAGLE does).
"""
from __future__ import annotations

import torch

from models.decoding.proposers import TargetUpdate
from models.decoding.tree import DraftTree, TreeSpec, draft_tree
from models.drafter import DraftCache, Drafter
from models.target import Target


def check_fits(cfg, target: Target) -> None:
    """A drafter reads the target's features, KV layers and vocabulary as they are: they must be the ones it was
    built for (one-line ValueErrors)."""
    if cfg.uses_features and cfg.n_features != len(target.feature_layers):
        raise ValueError(f"drafter expects {cfg.n_features} target features, the target gives "
                         f"{len(target.feature_layers)} (target.feature_layers={target.feature_layers})")
    if cfg.reads_kv and cfg.n_kv_layers != len(target.kv_layers):
        raise ValueError(f"drafter expects {cfg.n_kv_layers} target KV layers, the target gives "
                         f"{len(target.kv_layers)} (target.kv_layers={target.kv_layers})")
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(f"drafter vocab_size={cfg.vocab_size} != target vocab size {target.vocab_size}")


class DrafterProposer:
    """Tree proposals from a drafter that reads the target's live features/KV; batch 1.

    The drafter is moved to the target's device and dtype (its attention reads the target's tensors as they are).
    """

    def __init__(self, drafter: Drafter, target: Target):
        cfg = drafter.config
        check_fits(cfg, target)
        self.drafter = drafter.to(device=target.device, dtype=target.dtype).eval()
        self.target = target
        self.cfg = cfg
        self.d2t = self.drafter.d2t
        self.cache = DraftCache()
        self._pending: TargetUpdate | None = None
        self._stable = 0           # drafter entries for accepted positions (= target cache length at catch-up)

    # -- protocol ----------------------------------------------------------------------------------------------
    def begin(self, update: TargetUpdate) -> None:
        self.cache = DraftCache()
        self._stable = 0
        self._pending = update

    def update(self, update: TargetUpdate) -> None:
        if update.start != self._stable:
            raise ValueError(f"drafter proposer: update starts at {update.start}, drafter holds {self._stable}")
        self._pending = update

    @torch.no_grad()
    def propose(self, root: int, spec: TreeSpec) -> DraftTree:
        dev = self.target.device
        root_logits, hidden = self._catch_up(root)         # the root entry's draft logits and output [1, d]
        base = self._stable                                 # absolute position of the root
        kv = self._target_kv()
        tree_mask = torch.zeros(1, 0, dtype=torch.bool, device=dev)   # [k_prev, tree entries so far]

        def expand(tokens: torch.Tensor, src: torch.Tensor, level: int) -> torch.Tensor:
            nonlocal hidden, tree_mask
            k = tokens.numel()
            src = src.to(dev)
            tree_mask = torch.cat([tree_mask[src], torch.eye(k, dtype=torch.bool, device=dev)], 1)
            mask = torch.cat([torch.ones(k, self._stable, dtype=torch.bool, device=dev), tree_mask], 1)[None]
            pos = torch.full((1, k), base + level, dtype=torch.long, device=dev)
            h_in = hidden[src][None] if self.cfg.uses_features else None
            logits, h = self.drafter.step(tokens.to(dev)[None], h_in, pos, self.cache, mask, kv, None)
            hidden = h[0]
            return torch.log_softmax(logits[0].float(), -1)

        root_logp = torch.log_softmax(root_logits.float(), -1)
        return draft_tree(root, root_logp, expand, spec, self.d2t)

    # -- pieces ------------------------------------------------------------------------------------------------
    def _target_kv(self):
        if not self.cfg.reads_kv:
            return None
        layers = self._pending_cache.layers
        return [(layers[i].keys, layers[i].values) for i in self.target.kv_layers]

    def _catch_up(self, root: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the entries of the newly accepted positions; returns the last entry's (the root's) draft logits
        [V_draft] and output hidden [1, d]."""
        up = self._pending
        if up is None:
            raise RuntimeError("drafter proposer: propose() before begin()/update()")
        dev = self.target.device
        self.cache.crop(self._stable)                      # drop last round's tree entries
        m, start = up.tokens.numel(), up.start
        ids = torch.cat([up.tokens[1:].to(dev), torch.tensor([root], device=dev)])[None]
        pos = torch.arange(start + 1, start + m + 1, device=dev)[None]
        causal = torch.ones(m, m, dtype=torch.bool, device=dev).tril()
        self_mask = torch.cat([torch.ones(m, self._stable, dtype=torch.bool, device=dev), causal], 1)[None]
        h_in = self.drafter.fuse(torch.cat(up.features, -1)) if self.cfg.uses_features else None
        self._pending_cache = up.cache
        kv, tmask = None, None
        if self.cfg.reads_kv:
            kv = self._target_kv()
            S_t = kv[0][0].shape[2]
            # entry t reads target KV <= t
            tmask = (torch.arange(S_t, device=dev)[None, :] <= torch.arange(start, start + m, device=dev)[:, None])[None]
        logits, hidden = self.drafter.step(ids, h_in, pos, self.cache, self_mask, kv, tmask, last_only=True)
        self._stable = start + m
        return logits[0, -1], hidden[0, -1:]
