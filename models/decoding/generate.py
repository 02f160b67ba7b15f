"""Decoding loops and baselines, each returning what it measured (gpt-fast's generate.py, with trees).

`speculative_generate` is the one loop: with no proposer it verifies a root-only tree every step, which is plain
greedy decoding through the same code path (the "speculation off" baseline).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from models.decoding.proposers import DraftProposer, TargetUpdate
from models.decoding.tree import TreeSpec, root_only
from models.decoding.verify import cache_length, compact_cache, prefill, verify
from models.target import Target


@dataclass
class DecodeResult:
    tokens: list[int]                        # generated tokens (prompt excluded), eos included when hit
    seconds: float                           # wall time, prefill included
    rounds: int = 0                          # target forwards after prefill
    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per round (accepted drafts + 1)
    draft_seconds: float = 0.0               # time inside the proposer (or outside target forwards)
    logits: list[torch.Tensor] | None = None  # per generated token, when asked for (plain greedy reference)
    verify_seconds: float = 0.0              # time in verification (target forward, logits, acceptance) after prefill

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0

    @property
    def tau(self) -> float:
        """Mean tokens per verification round (accepted draft tokens + 1); 1.0 without speculation.

        Without per-round lengths (transformers' loops) it is (generated - 1) / rounds: the prefill emits one."""
        if self.accept_lengths:
            return sum(self.accept_lengths) / len(self.accept_lengths)
        return (len(self.tokens) - 1) / self.rounds if self.rounds else 1.0

    @property
    def draft_share(self) -> float:
        return self.draft_seconds / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> dict:
        return {"new_tokens": len(self.tokens), "seconds": self.seconds, "tokens_per_s": self.tokens_per_s,
                "rounds": self.rounds, "tau": self.tau, "draft_time_share": self.draft_share}


def _eos_set(eos_token_id) -> set[int]:
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(e) for e in eos_token_id}


def _finish(tokens: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    tokens = tokens[:max_new_tokens]
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


@torch.inference_mode()   # no_grad plus no version counting: ~5% off a drafted round's small ops on CPU
def speculative_generate(target: Target, prompt_ids: torch.Tensor, max_new_tokens: int,
                         proposer: DraftProposer | None = None, tree: TreeSpec | list[int] | None = None,
                         eos_token_id: int | list[int] | None = None) -> DecodeResult:
    """Greedy tree speculative decoding of one prompt [T]; `proposer=None` decodes one token per target step."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 1")
    spec = TreeSpec.of(tree) if tree is not None else None
    if proposer is not None and spec is None:
        raise ValueError("speculative_generate: a proposer needs a tree spec [depth, top_k, total_tokens]")
    eos = _eos_set(eos_token_id)
    prompt_ids = prompt_ids.flatten()
    clock = device_clock(target.device)
    t0 = clock()
    cap, logits = prefill(target, prompt_ids)
    cache = cap.cache
    out = [int(logits.max(-1).indices)]
    draft_s = verify_s = 0.0
    if proposer is not None:
        t = clock()
        proposer.begin(TargetUpdate(prompt_ids, 0, cap.features, cap.last_hidden, cache))
        draft_s += clock() - t
    lengths: list[int] = []
    while len(out) < max_new_tokens and out[-1] not in eos:
        root = out[-1]
        if proposer is not None:
            t = clock()
            draft = proposer.propose(root, spec)
            draft_s += clock() - t
        else:
            draft = root_only(root)
        past = cache_length(cache)
        t = clock()
        v = verify(target, draft, cache)
        verify_s += clock() - t
        compact_cache(cache, past, v.path)
        path = v.path.tolist()
        new = draft.tokens[path[1:]].tolist() + [v.bonus]
        lengths.append(len(new))
        out.extend(new)
        if any(t in eos for t in new):
            break
        if proposer is not None:
            t = clock()
            idx = v.path.to(cap.last_hidden.device)
            proposer.update(TargetUpdate(draft.tokens[v.path], past,
                                         [f.index_select(1, idx) for f in v.capture.features],
                                         v.capture.last_hidden.index_select(1, idx), cache))
            draft_s += clock() - t
    seconds = clock() - t0
    return DecodeResult(_finish(out, max_new_tokens, eos), seconds, len(lengths), lengths, draft_s,
                        verify_seconds=verify_s)


def device_clock(device: torch.device | str) -> Callable[[], float]:
    """`time.perf_counter` that first waits for the work queued on a CUDA device: its kernels run asynchronously,
    so a plain timer around a call would read the launches, not the work (as gpt-fast synchronises)."""
    device = torch.device(device)
    if device.type != "cuda":
        return time.perf_counter

    def clock() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return clock


# -- baselines through transformers' generate ------------------------------------------------------------------

class _ForwardTimer:
    """Counts and times the model's forward calls (to split a generate() call into target vs other time)."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.calls, self.seconds, self._t = model, 0, 0.0, 0.0
        self.clock = device_clock(next(model.parameters()).device)

    def __enter__(self):
        self._h = [self.model.register_forward_pre_hook(self._pre), self.model.register_forward_hook(self._post)]
        return self

    def _pre(self, *_):
        self._t = self.clock()

    def _post(self, *_):
        self.calls += 1
        self.seconds += self.clock() - self._t

    def __exit__(self, *exc):
        for h in self._h:
            h.remove()


def _generate(target: Target, prompt_ids: torch.Tensor, max_new_tokens: int, eos_token_id, **kwargs):
    ids = prompt_ids.flatten()[None].to(target.device)
    eos = sorted(_eos_set(eos_token_id))
    model = target.model
    with _ForwardTimer(model) as timer:
        t0 = timer.clock()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=0, do_sample=False, num_beams=1, eos_token_id=eos or None,
                             pad_token_id=eos[0] if eos else 0, return_dict_in_generate=True, **kwargs)
        seconds = timer.clock() - t0
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    return out, _finish(tokens, max_new_tokens, set(eos)), seconds, timer


@torch.no_grad()
def greedy_generate(target: Target, prompt_ids: torch.Tensor, max_new_tokens: int,
                    eos_token_id: int | list[int] | None = None, keep_logits: bool = False) -> DecodeResult:
    """Plain greedy `model.generate`: the speedup reference (and, with `keep_logits`, the near-tie reference)."""
    out, tokens, seconds, timer = _generate(target, prompt_ids, max_new_tokens, eos_token_id,
                                            output_logits=keep_logits)
    logits = [row[0].float() for row in out.logits][: len(tokens)] if keep_logits else None
    return DecodeResult(tokens, seconds, max(timer.calls - 1, 0), [], 0.0, logits)


@torch.no_grad()
def prompt_lookup_generate(target: Target, prompt_ids: torch.Tensor, max_new_tokens: int,
                           eos_token_id: int | list[int] | None = None, num_tokens: int = 5,
                           max_ngram_size: int = 2) -> DecodeResult:
    """transformers' prompt-lookup decoding; τ from the forward count, draft time = time outside forwards."""
    _, tokens, seconds, timer = _generate(target, prompt_ids, max_new_tokens, eos_token_id,
                                          prompt_lookup_num_tokens=num_tokens, max_matching_ngram_size=max_ngram_size)
    return DecodeResult(tokens, seconds, max(timer.calls - 1, 0), [], max(seconds - timer.seconds, 0.0))
