"""Batches of target information for training and evaluation, read offline from the feature cache or computed
online by running the target; both give the same `FeatureBatch` of plain tensors.

    cache = open_features(paths.features("small"))                 # offline: shards written by `features`
    cache = open_features(paths.features("small"), target=target)  # online: the target runs here
    for batch in cache.batches(batch_size=4, seed=0, epoch=e): ...

Batches are right-padded to the longest conversation in the batch (`attention_mask` 0 on padding, every other
tensor zero there). The order is a seeded permutation per epoch, the same for both readers.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from stages.common import StageError


@dataclass
class FeatureBatch:
    input_ids: torch.Tensor                         # [B, T] long
    loss_mask: torch.Tensor                         # [B, T] bool: assistant tokens
    attention_mask: torch.Tensor                    # [B, T] long: 1 on real tokens
    features: list[torch.Tensor] | None             # each [B, T, d]: the fused-feature layers
    last_hidden: torch.Tensor | None                # [B, T, d]: final-norm hidden (target logits = lm_head(.))
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None   # per kv layer (K, V) [B, Hkv, T, hd], post-RoPE
    ids: list[str]
    top1: torch.Tensor | None = None                # [B, T] long: the target's full-vocabulary top-1 (None: not cached)
    top1_logit: torch.Tensor | None = None          # [B, T] fp32: its logit

    @property
    def concat_features(self) -> torch.Tensor:
        """[B, T, n_features * d]: EAGLE-3's fc input."""
        return torch.cat(self.features, -1)

    def to(self, device, dtype: torch.dtype | None = None) -> "FeatureBatch":
        cast = (lambda x: x.to(device, dtype)) if dtype is not None else (lambda x: x.to(device))
        return FeatureBatch(self.input_ids.to(device), self.loss_mask.to(device), self.attention_mask.to(device),
                            [cast(f) for f in self.features] if self.features is not None else None,
                            cast(self.last_hidden) if self.last_hidden is not None else None,
                            [(cast(k), cast(v)) for k, v in self.kv] if self.kv is not None else None, self.ids,
                            self.top1.to(device) if self.top1 is not None else None,
                            self.top1_logit.to(device) if self.top1_logit is not None else None)


def read_index(directory: Path) -> dict:
    path = Path(directory) / "index.json"
    if not path.is_file():
        raise StageError(f"{path}: no feature cache index (run the features stage)")
    index = json.loads(path.read_text())
    if index.get("format") != "kvshot-features/1":
        raise StageError(f"{path}: not a kvshot feature cache (format {index.get('format')!r})")
    return index


def token_frequencies(directory: Path, vocab_size: int) -> torch.Tensor:
    """Loss-masked token counts [vocab_size] (int64) of a cache directory, for the draft vocabulary."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for t, n in read_index(directory)["token_freq"].items():
        if int(t) < vocab_size:
            counts[int(t)] = n
    return counts


def permutation(n: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    if not shuffle:
        return list(range(n))
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


class _Source(ABC):
    """What both readers share: conversations, token lists, batching."""

    ids: list[str]

    def __len__(self) -> int:
        return len(self.ids)

    @abstractmethod
    def tokens(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids and loss_mask of conversation i."""

    @abstractmethod
    def batch(self, idx: list[int]) -> FeatureBatch:
        """The padded batch of conversations `idx`."""

    def lengths(self) -> list[int]:
        """Tokens per conversation (what length-bucketed batching sorts by)."""
        return [len(self.tokens(i)[0]) for i in range(len(self))]

    def batches(self, batch_size: int, seed: int = 0, epoch: int = 0, shuffle: bool = True,
                drop_last: bool = False, limit: int | None = None) -> Iterator[FeatureBatch]:
        order = permutation(len(self), seed, epoch, shuffle)
        if limit is not None:
            order = order[:limit]
        for b in range(0, len(order), batch_size):
            idx = order[b:b + batch_size]
            if drop_last and len(idx) < batch_size:
                return
            yield self.batch(idx)

    def num_batches(self, batch_size: int, drop_last: bool = False) -> int:
        return len(self) // batch_size if drop_last else -(-len(self) // batch_size)

    def _pad_tokens(self, idx: list[int]):
        toks = [self.tokens(i) for i in idx]
        width = max(len(t) for t, _ in toks)
        ids = torch.zeros((len(idx), width), dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.bool)
        att = torch.zeros((len(idx), width), dtype=torch.long)
        for r, (t, m) in enumerate(toks):
            ids[r, :len(t)], mask[r, :len(t)], att[r, :len(t)] = t, m, 1
        return ids, mask, att, [len(t) for t, _ in toks]


class OfflineFeatures(_Source):
    """The feature cache on disk (memory-mapped shards; a batch reads only its conversations)."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        self.directory = Path(directory)
        self.index = read_index(self.directory)
        self._files, self._where, self.ids = [], [], []
        for s, rec in enumerate(self.index["shards"]):
            path = self.directory / rec["file"]
            if not path.is_file():
                raise StageError(f"{path}: shard listed in index.json is missing")
            f = safe_open(str(path), "pt")
            meta = f.metadata() or {}
            offsets = f.get_tensor("offsets").tolist()
            self._files.append((f, offsets))
            names = json.loads(meta.get("ids", "[]"))
            for j in range(len(offsets) - 1):
                self._where.append((s, j))
                self.ids.append(names[j] if j < len(names) else f"{rec['file']}:{j}")
        self.offline = bool(self.index.get("offline"))
        self.n_features = sum(k.startswith("feature_") for k in self.index["tensors"])
        self.n_kv = sum(k.startswith("k_") for k in self.index["tensors"])
        self.has_top1 = "target_top1" in self.index["tensors"]     # caches written before it existed lack it

    def _slice(self, i: int, name: str) -> torch.Tensor:
        s, j = self._where[i]
        f, offsets = self._files[s]
        return f.get_slice(name)[offsets[j]:offsets[j + 1]]

    def tokens(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._slice(i, "input_ids").long(), self._slice(i, "loss_mask").bool()

    def lengths(self) -> list[int]:
        out = []
        for s, j in self._where:
            offsets = self._files[s][1]
            out.append(offsets[j + 1] - offsets[j])
        return out

    def batch(self, idx: list[int]) -> FeatureBatch:
        ids, mask, att, lens = self._pad_tokens(idx)
        if not self.offline:
            raise StageError(f"{self.directory}: the cache holds tokens only (features.offline=false); "
                             "open it with a target to run online")
        B, T = ids.shape

        def stack(name: str) -> torch.Tensor:
            parts = [self._slice(i, name) for i in idx]
            out = parts[0].new_zeros((B, T, *parts[0].shape[1:]))
            for r, p in enumerate(parts):
                out[r, :len(p)] = p
            return out

        feats = [stack(f"feature_{j}") for j in range(self.n_features)]
        kv = [(stack(f"k_{j}").transpose(1, 2).contiguous(), stack(f"v_{j}").transpose(1, 2).contiguous())
              for j in range(self.n_kv)]
        top1 = (stack("target_top1").long(), stack("target_top1_logit")) if self.has_top1 else (None, None)
        return FeatureBatch(ids, mask, att, feats, stack("last_hidden"), kv, [self.ids[i] for i in idx], *top1)


class OnlineFeatures(_Source):
    """The same batches computed by running `target` (right-padded batch, one forward) on tokenised conversations."""

    def __init__(self, target, tokens: list[tuple[torch.Tensor, torch.Tensor]], ids: list[str],
                 dtype: torch.dtype | None = None):
        self.target, self._tokens, self.ids = target, tokens, list(ids)
        self.dtype = dtype

    @classmethod
    def from_cache(cls, directory: Path, target, dtype: torch.dtype | None = None) -> "OnlineFeatures":
        """Tokens (and order) from a cache directory, target tensors computed here."""
        cache = OfflineFeatures(directory)
        return cls(target, [cache.tokens(i) for i in range(len(cache))], cache.ids, dtype)

    @classmethod
    def from_conversations(cls, rows: list[dict], target, max_len: int,
                           dtype: torch.dtype | None = None) -> "OnlineFeatures":
        """Any conversation JSONL rows ({"id", "messages"}), tokenised with the target's chat template."""
        from stages.features import tokenize_conversation

        tokens, ids = [], []
        for n, r in enumerate(rows):
            got = tokenize_conversation(target.tokenizer, r["messages"], max_len)
            if got is None or not any(got[1]):
                continue
            tokens.append((torch.tensor(got[0], dtype=torch.long), torch.tensor(got[1], dtype=torch.bool)))
            ids.append(str(r.get("id", n)))
        return cls(target, tokens, ids, dtype)

    def tokens(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._tokens[i]

    @torch.no_grad()
    def batch(self, idx: list[int]) -> FeatureBatch:
        ids, mask, att, lens = self._pad_tokens(idx)
        cap = self.target.capture(ids, attention_mask=att.to(self.target.device))
        keep = att.to(cap.last_hidden.device).bool()

        def clean(x: torch.Tensor, tokens_dim: int = 1) -> torch.Tensor:
            shape = [keep.shape[0]] + [1] * (x.dim() - 1)
            shape[tokens_dim] = keep.shape[1]
            m = keep.view(shape) if tokens_dim == 1 else keep[:, None, :, None]
            x = x.masked_fill(~m, 0)
            return x.to(self.dtype) if self.dtype is not None else x

        feats = [clean(f) for f in cap.features]
        kv = [(clean(k, 2), clean(v, 2)) for k, v in cap.kv]
        return FeatureBatch(ids, mask, att, feats, clean(cap.last_hidden), kv, [self.ids[i] for i in idx])


def open_features(directory: Path, target=None, dtype: torch.dtype | None = None) -> _Source:
    """The offline cache in `directory`, or (with `target`) its conversations run through the target online."""
    if target is None:
        return OfflineFeatures(directory)
    return OnlineFeatures.from_cache(directory, target, dtype)
