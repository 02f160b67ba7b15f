"""Who proposes the draft tree: a small protocol, plus the oracle and callable proposers.

The decoding loop tells a proposer what entered the target's cache (`begin` after prefill, `update` after each
verification, both with the live cache and the target features of the new tokens), then asks it for a tree rooted
at the last emitted token (`propose`). Real drafters plug in through `models.decoding.drafter_proposer`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from models.decoding.tree import DraftTree, TreeSpec, chain_tree, draft_tree, root_only


@dataclass
class TargetUpdate:
    """Tokens that just entered the target's KV cache and what the target computed for them."""

    tokens: torch.Tensor              # [m] target ids, at absolute positions start .. start + m - 1
    start: int
    features: list[torch.Tensor]      # each [1, m, d]: the target's feature layers at those tokens
    last_hidden: torch.Tensor         # [1, m, d]
    cache: object                     # the target's live DynamicCache (already holding these m tokens)


class DraftProposer(Protocol):
    def begin(self, update: TargetUpdate) -> None: ...
    def update(self, update: TargetUpdate) -> None: ...
    def propose(self, root: int, spec: TreeSpec) -> DraftTree: ...


def chain_length(spec: TreeSpec) -> int:
    """Longest root path a tree of this spec can hold: its draft levels, capped by its node budget."""
    return min(spec.depth + 1, spec.total_tokens - 1)


class _History:
    """Tokens in the target cache, kept as a Python list (the proposers below read them often)."""

    def __init__(self):
        self.tokens: list[int] = []

    def begin(self, update: TargetUpdate) -> None:
        self.tokens = update.tokens.tolist()

    def update(self, update: TargetUpdate) -> None:
        if update.start != len(self.tokens):
            raise ValueError(f"proposer update: starts at {update.start}, history holds {len(self.tokens)} tokens")
        self.tokens.extend(update.tokens.tolist())


class OracleProposer(_History):
    """Proposes the target's own greedy continuation, read from a known reference sequence (prompt + greedy output).

    With `branch=True` each level also gets a wrong sibling placed before the right one, so the accepted path is
    not a contiguous prefix of the flat tree (exercises tree masks and cache compaction); the chain then
    shortens so that the tree still fits total_tokens.
    """

    def __init__(self, reference: list[int] | torch.Tensor, branch: bool = False, vocab_size: int | None = None):
        super().__init__()
        self.reference = list(torch.as_tensor(reference).tolist())
        self.branch = branch
        self.vocab_size = vocab_size or (max(self.reference) + 2)

    def propose(self, root: int, spec: TreeSpec) -> DraftTree:
        pos = len(self.tokens)
        if pos >= len(self.reference) or self.reference[pos] != root:
            return root_only(root)
        length = min(spec.depth + 1, (spec.total_tokens - 1) // 2) if self.branch else chain_length(spec)
        draft = self.reference[pos + 1: pos + 1 + length]
        if not self.branch or not draft:
            return chain_tree(root, draft)
        tokens, parents, depths = [root], [-1], [0]
        right = 0
        for d, tok in enumerate(draft, 1):
            tokens += [(tok + 1) % self.vocab_size, tok]
            parents += [right, right]
            depths += [d, d]
            right = len(tokens) - 1
        t = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
        return DraftTree(t(tokens), t(parents), t(depths))


NextLogProbs = Callable[[torch.Tensor], torch.Tensor]
"""fn(sequences [k, T] target ids) -> log-probs [k, V_draft] of each sequence's next token."""


class CallableProposer(_History):
    """Builds the EAGLE-2 dynamic tree from any next-token function over whole sequences (a small LM, n-grams...).

    One call per tree level, batched over the frontier; no cache, so it suits tests and tiny draft models.
    """

    def __init__(self, fn: NextLogProbs, d2t: torch.Tensor | None = None):
        super().__init__()
        self.fn = fn
        self.d2t = d2t

    def propose(self, root: int, spec: TreeSpec) -> DraftTree:
        seq = torch.tensor(self.tokens + [root], dtype=torch.long)[None]
        frontier = seq

        def expand(tokens: torch.Tensor, src: torch.Tensor, level: int) -> torch.Tensor:
            nonlocal frontier
            frontier = torch.cat([frontier[src], tokens[:, None].to(frontier.device)], 1)
            return self.fn(frontier)

        return draft_tree(root, self.fn(seq)[0], expand, spec, self.d2t)


def lm_log_probs(model: torch.nn.Module) -> NextLogProbs:
    """A next-token function from an HF causal LM run over the whole sequence (no cache)."""

    @torch.no_grad()
    def fn(seqs: torch.Tensor) -> torch.Tensor:
        dev = next(model.parameters()).device
        logits = model(input_ids=seqs.to(dev), use_cache=False, logits_to_keep=1).logits[:, -1]
        return torch.log_softmax(logits.float(), -1)

    return fn
