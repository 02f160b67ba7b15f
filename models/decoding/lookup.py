"""Prompt lookup as a draft source: the continuation of an earlier occurrence of the text's last n-gram.

A small model's answers copy their prompt and repeat themselves; a learned drafter misses much of that and an
n-gram match catches it for free. `LookupProposer` proposes that continuation alone (prompt lookup through our own
loop) or grafts it onto any other proposer's tree as one extra branch: the tree then holds up to `num_tokens` more
nodes than its spec, the verification stays one target forward, and losslessness is untouched (verification
accepts only the target's own greedy choices, whoever proposed them).
"""
from __future__ import annotations

import torch

from models.decoding.proposers import DraftProposer, TargetUpdate
from models.decoding.tree import DraftTree, TreeSpec, root_only


class NgramIndex:
    """The tokens so far, with, for every n-gram (n <= max_ngram), where its latest occurrence was followed.

    Kept incrementally: appending m tokens costs m * max_ngram dictionary writes, a lookup max_ngram reads.
    """

    def __init__(self, max_ngram: int):
        if max_ngram < 1:
            raise ValueError(f"max_ngram={max_ngram}: must be >= 1")
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}    # n-gram -> index just after its latest occurrence

    def extend(self, tokens: list[int]) -> None:
        for tok in tokens:
            self.tokens.append(tok)
            end = len(self.tokens)
            for n in range(1, min(self.max_ngram, end) + 1):
                self._next[tuple(self.tokens[end - n:end])] = end

    def continuation(self, last: int, num_tokens: int) -> list[int]:
        """What followed the latest earlier occurrence of the longest n-gram ending in `last` (the token after
        the stored ones), at most num_tokens; [] when no n-gram has occurred before."""
        seq = self.tokens + [last]
        for n in range(min(self.max_ngram, len(seq) - 1), 0, -1):
            start = self._next.get(tuple(seq[-n:]))
            if start is not None:
                return seq[start:start + num_tokens]
        return []


def graft_chain(tree: DraftTree, chain: list[int]) -> DraftTree:
    """The tree with `chain` (tokens after the root) added as a root path: the longest prefix the tree already holds
    is shared, the rest appended as new nodes (parents still precede children)."""
    if not chain:
        return tree
    tokens, parents, depths = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
    children: dict[tuple[int, int], int] = {(parents[i], tokens[i]): i for i in range(1, len(tokens))}
    node = 0
    for tok in chain:
        child = children.get((node, tok))
        if child is None:
            tokens.append(tok), parents.append(node), depths.append(depths[node] + 1)
            child = len(tokens) - 1
            children[(node, tok)] = child
        node = child
    dev = tree.tokens.device
    as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=dev)  # noqa: E731
    return DraftTree(as_tensor(tokens), as_tensor(parents), as_tensor(depths))


class LookupProposer:
    """Prompt-lookup drafts: alone (`inner=None`: a chain of up to num_tokens) or grafted onto `inner`'s tree."""

    def __init__(self, inner: DraftProposer | None = None, num_tokens: int = 8, max_ngram: int = 3):
        if num_tokens < 1:
            raise ValueError(f"lookup num_tokens={num_tokens}: must be >= 1")
        self.inner = inner
        self.num_tokens = num_tokens
        self.index = NgramIndex(max_ngram)

    def begin(self, update: TargetUpdate) -> None:
        self.index = NgramIndex(self.index.max_ngram)
        self.index.extend(update.tokens.tolist())
        if self.inner is not None:
            self.inner.begin(update)

    def update(self, update: TargetUpdate) -> None:
        if update.start != len(self.index.tokens):
            raise ValueError(f"lookup proposer: update starts at {update.start}, it holds {len(self.index.tokens)}")
        self.index.extend(update.tokens.tolist())
        if self.inner is not None:
            self.inner.update(update)

    def propose(self, root: int, spec: TreeSpec) -> DraftTree:
        tree = self.inner.propose(root, spec) if self.inner is not None else root_only(root)
        return graft_chain(tree, self.index.continuation(root, self.num_tokens))
