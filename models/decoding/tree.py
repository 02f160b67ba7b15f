"""EAGLE-2's dynamic draft tree as pure tensor functions.

A tree is stored flat in creation order: node 0 is the root (the token the target emitted last, not yet in its
cache), every parent precedes its children. Tree construction is written against per-level draft log-probs, so it
can be tested on hand-made distributions and driven by any drafter through one `expand` callback.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class TreeSpec:
    """EAGLE-2 tree shape: `depth` expansion steps after the first (draft levels 1..depth+1), `top_k` children per
    expanded node and frontier width, `total_tokens` nodes at most including the root (the paper's (8, 10, 60))."""

    depth: int
    top_k: int
    total_tokens: int

    def __post_init__(self):
        if self.depth < 0 or self.top_k < 1 or self.total_tokens < 1:
            raise ValueError(f"tree (depth, top_k, total_tokens)={self.as_list()}: need depth >= 0, top_k >= 1, "
                             "total_tokens >= 1")

    @classmethod
    def of(cls, tree: "TreeSpec | list[int] | tuple[int, int, int]") -> "TreeSpec":
        if isinstance(tree, TreeSpec):
            return tree
        if len(tree) != 3:
            raise ValueError(f"tree={list(tree)}: expected [depth, top_k, total_tokens]")
        return cls(*(int(v) for v in tree))

    @classmethod
    def chain(cls, length: int) -> "TreeSpec":
        """A chain of `length` draft tokens (top_k = 1)."""
        return cls(depth=max(length - 1, 0), top_k=1, total_tokens=length + 1)

    def as_list(self) -> list[int]:
        return [self.depth, self.top_k, self.total_tokens]


@dataclass
class DraftTree:
    """A flat draft tree: tokens [n] (target ids, root first), parents [n] (root -1), depths [n] (root 0)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor

    def __post_init__(self):
        n = self.tokens.numel()
        if n < 1 or self.parents.numel() != n or self.depths.numel() != n:
            raise ValueError(f"draft tree: tokens/parents/depths must share one length >= 1, got "
                             f"{self.tokens.numel()}/{self.parents.numel()}/{self.depths.numel()}")
        self._mask: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.tokens.numel()

    @property
    def is_chain(self) -> bool:
        return bool((self.parents[1:] == torch.arange(self.size - 1, device=self.parents.device)).all())

    def ancestor_mask(self) -> torch.Tensor:
        """[n, n] bool: row i is True at i and at every ancestor of i (who node i may attend to)."""
        if self._mask is None:
            self._mask = ancestor_mask(self.parents, self.depths)
        return self._mask

    def positions(self, past: int) -> torch.Tensor:
        """Absolute positions of the nodes when the target cache holds `past` tokens: past + depth."""
        return self.depths + past


def root_only(token: int | torch.Tensor, device: torch.device | str = "cpu") -> DraftTree:
    """The tree with nothing drafted: verification is then one plain decoding step."""
    tok = torch.as_tensor([int(token)], dtype=torch.long, device=device)
    zero = torch.zeros(1, dtype=torch.long, device=device)
    return DraftTree(tok, zero - 1, zero)


def ancestor_mask(parents: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """[n, n] bool ancestor-or-self mask of a flat tree (parents before children), one vector op per level."""
    n = parents.numel()
    mask = torch.eye(n, dtype=torch.bool, device=parents.device)
    for d in range(1, int(depths.max()) + 1):
        idx = (depths == d).nonzero().flatten()
        mask[idx] |= mask[parents[idx]]
    return mask


def chain_tree(root: int, draft: list[int] | torch.Tensor, device: torch.device | str = "cpu") -> DraftTree:
    """A chain: root, then each draft token the child of the previous one."""
    toks = torch.cat([torch.as_tensor([int(root)]), torch.as_tensor(draft, dtype=torch.long).flatten()]).to(device)
    n = toks.numel()
    ar = torch.arange(n, device=device)
    return DraftTree(toks, ar - 1, ar)


# -- EAGLE-2 dynamic expansion ------------------------------------------------------------------------------------

Expand = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
"""expand(tokens [k], src [k], level) -> log-probs [k, V_draft] of the children of the k new frontier nodes.

`tokens` are the frontier's target ids, `src` the index of each node's parent in the previous frontier (for level 1
all zeros: the parent is the root, whose distribution the drafter already produced), `level` their draft level."""


def draft_tree(root: int, root_logp: torch.Tensor, expand: Expand, spec: TreeSpec,
               d2t: torch.Tensor | None = None) -> DraftTree:
    """Build an EAGLE-2 dynamic tree from the root's draft log-probs [V_draft] and an `expand` callback.

    Each level keeps the top_k frontier nodes by cumulative log-prob; every top_k child of a frontier node is a
    candidate; the final tree is the best total_tokens - 1 candidates plus the root. A child's score never
    exceeds its parent's, and ties go to the earlier-created (shallower) node, so the kept set is ancestor-closed;
    for the same reason expansion stops as soon as no frontier node beats the current total_tokens - 1 best (an
    uncertain drafter then skips its deeper, useless steps; the tree is the same).
    `d2t` maps draft-vocabulary indices to target ids (None: the draft vocabulary is the target's).
    """
    device = root_logp.device
    keep = spec.total_tokens - 1
    if keep == 0:
        return root_only(root, device)
    k = min(spec.top_k, root_logp.shape[-1])
    to_target = (lambda i: d2t[i]) if d2t is not None else (lambda i: i)

    top = root_logp.float().topk(k)
    scores = top.values                                   # [k] cumulative log-prob of the frontier
    frontier_tok = to_target(top.indices)
    cand_tok, cand_score = [frontier_tok], [scores]
    cand_parent, cand_depth = [torch.full((k,), -1, device=device)], [torch.ones(k, dtype=torch.long, device=device)]
    frontier_cand = torch.arange(k, device=device)        # candidate index of each frontier node
    n_cand = k
    src = torch.zeros(k, dtype=torch.long, device=device)
    for level in range(1, spec.depth + 1):
        if n_cand >= keep and bool(scores.max() <= torch.cat(cand_score).topk(keep).values[-1]):
            break   # no deeper node can outscore (or, being later, tie) the keep best: the tree is final
        logp = expand(frontier_tok, src, level).float()   # [k_front, V]
        child = logp.topk(k, dim=-1)
        cum = (scores[:, None] + child.values).flatten()  # [k_front * k]
        toks = to_target(child.indices).flatten()
        parent = frontier_cand.repeat_interleave(k)
        cand_tok.append(toks), cand_score.append(cum), cand_parent.append(parent)
        cand_depth.append(torch.full_like(parent, level + 1))
        best = cum.topk(min(k, cum.numel()))
        src = best.indices // k
        scores = best.values
        frontier_tok = toks[best.indices]
        frontier_cand = n_cand + best.indices
        n_cand += cum.numel()
    return select_tree(root, torch.cat(cand_tok), torch.cat(cand_score), torch.cat(cand_parent),
                       torch.cat(cand_depth), keep)


def select_tree(root: int, cand_tokens: torch.Tensor, cand_scores: torch.Tensor, cand_parents: torch.Tensor,
                cand_depths: torch.Tensor, keep: int) -> DraftTree:
    """Keep the `keep` best candidates (stable on ties) and relabel them as a flat tree under the root.

    cand_parents[i] is the candidate index of i's parent (-1: the root); candidates are in creation order.
    """
    device = cand_tokens.device
    order = torch.sort(cand_scores, descending=True, stable=True).indices[:keep]
    chosen = order.sort().values                           # creation order: parents before children
    par = cand_parents[chosen]
    # candidate index -> node index (root = 0); ancestor closure makes every parent present
    node_of = torch.full((cand_tokens.numel() + 1,), -1, dtype=torch.long, device=device)
    node_of[chosen + 1] = torch.arange(1, chosen.numel() + 1, device=device)
    node_of[0] = 0
    parents = node_of[par + 1]
    if bool((parents < 0).any()):
        raise ValueError("draft tree: a kept candidate's parent was dropped (scores not monotone along paths)")
    tokens = torch.cat([torch.as_tensor([int(root)], device=device), cand_tokens[chosen]])
    parents = torch.cat([torch.full((1,), -1, dtype=torch.long, device=device), parents])
    depths = torch.cat([torch.zeros(1, dtype=torch.long, device=device), cand_depths[chosen]])
    return DraftTree(tokens, parents, depths)
