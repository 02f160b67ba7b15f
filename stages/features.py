"""features: regenerated conversations -> the offline feature cache data/features/<scale>/ (and data/features/eval/).

Loss mask: the template's own structure decides which tokens are the assistant's. Each assistant message is
rendered with a unique sentinel as its content; the span of message i runs from the end of the template's
generation prompt for messages[:i] to the end of what the template writes after the sentinel when message i is the
last one (trailing whitespace excluded: generation stops at the end-of-turn token). That covers the content, the
end-of-turn token and any template scaffolding the model generates itself (Qwen3's empty think block). Templates
with `{% generation %}` blocks use transformers' `return_assistant_tokens_mask` instead.

Layout of a cache directory: `shard-NNNNN.safetensors` files, packed along tokens (`offsets` [n+1] marks each
conversation), and `index.json` (shapes, dtypes, token counts, bytes per token, loss-masked token frequencies).
Training shard k holds the conversations with `scale_rank` in [k*shard_size, (k+1)*shard_size), so scales are
extracted once over the largest: a smaller scale hard-links the shared shards and slices its boundary shard, and
each scale directory is still complete on its own. With `offline: false` the shards hold only input_ids and
loss_mask (the trainer runs the target online).

Besides the features, the last hidden state and the KV, each position stores the target's full-vocabulary top-1
(`target_top1`, int32, and its logit `target_top1_logit`, fp32), computed from the last hidden state as stored:
training then multiplies only the draft vocabulary's rows of the LM head, and evaluation none. Caches written
before these two tensors existed still work (the trainer computes the top-1 itself).
"""
from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal

from pydantic import Field

from stages.common import (Paths, Report, Section, StageError, StageProgress, TargetParams, atomic_path,
                           read_jsonl, write_json_atomic)

FORMAT = "kvshot-features/1"
EVAL = "eval"
SENTINEL = "\ue000kvshot-{}\ue001"   # private-use characters: no template or text produces them


class FeaturesParams(Section):
    max_len: int = Field(512, ge=8)        # tokens per conversation after truncation
    shard_size: int = Field(128, ge=1)     # conversations per safetensors shard
    batch_size: int = Field(4, ge=1)
    offline: bool = True                   # false: no cache; training runs the target online
    dtype: Literal["bfloat16", "float32"] = "bfloat16"   # stored dtype of features, hidden states and KV


# -- tokenisation and the loss mask --------------------------------------------------------------------------------

def _render(tok, messages: list[dict], generation_prompt: bool = False, chat_template: str | None = None) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                   chat_template=chat_template)


def assistant_char_spans(tok, messages: list[dict], chat_template: str | None = None
                         ) -> tuple[str, list[tuple[int, int]]] | None:
    """The rendered conversation and the character spans of its assistant turns; None if the template rewrites
    assistant text (then no span can be trusted)."""
    marked = [dict(m, content=SENTINEL.format(i)) if m["role"] == "assistant" else m for i, m in enumerate(messages)]
    text_s = _render(tok, marked, chat_template=chat_template)
    spans_s = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        s = SENTINEL.format(i)
        pos = text_s.find(s)
        if pos < 0 or text_s.count(s) != 1:
            return None
        prompt = _render(tok, marked[:i], generation_prompt=True, chat_template=chat_template) if i else ""
        start = len(prompt) if i and text_s.startswith(prompt) and len(prompt) <= pos else pos
        alone = _render(tok, marked[:i + 1], chat_template=chat_template)
        close = alone[alone.find(s) + len(s):].rstrip()
        end = pos + len(s) + (len(close) if text_s.startswith(close, pos + len(s)) else 0)
        spans_s.append((start, end, i))
    # put the real contents back, shifting the spans by the length differences
    out, spans, cursor, shift = [], [], 0, 0
    for start, end, i in spans_s:
        s, content = SENTINEL.format(i), messages[i]["content"]
        pos = text_s.find(s)
        out.append(text_s[cursor:pos] + content)
        cursor = pos + len(s)
        spans.append((start + shift, end + shift + len(content) - len(s)))
        shift += len(content) - len(s)
    out.append(text_s[cursor:])
    text = "".join(out)
    if text != _render(tok, messages, chat_template=chat_template):
        return None
    return text, spans


def tokenize_conversation(tok, messages: list[dict], max_len: int | None = None,
                          chat_template: str | None = None) -> tuple[list[int], list[int]] | None:
    """input_ids and the assistant loss mask (1 = the target generated this token) of one conversation."""
    template = chat_template or getattr(tok, "chat_template", None) or ""
    if "generation %}" in template:
        enc = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                      chat_template=chat_template)
        ids, mask = list(enc["input_ids"]), [int(x) for x in enc["assistant_masks"]]
    else:
        found = assistant_char_spans(tok, messages, chat_template)
        if found is None:
            return None
        text, spans = found
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        mask = []
        for a, _ in enc["offset_mapping"]:
            mask.append(int(any(s <= a < e for s, e in spans)))
    if max_len is not None:
        ids, mask = ids[:max_len], mask[:max_len]
    return ids, mask


@dataclass
class Item:
    id: str
    source: str
    rank: int
    ids: list[int]
    mask: list[int]


def tokenize_rows(rows: Iterable[dict], tok, max_len: int, drops: list[tuple[int, str]]) -> list[Item]:
    """Tokenized conversations with their loss masks; each dropped one is appended to `drops` as (rank, reason)."""
    items = []
    for r in rows:
        got = tokenize_conversation(tok, r["messages"], max_len)
        rank = int(r.get("scale_rank", len(items)))
        if got is None:
            drops.append((rank, "template rewrites assistant text"))
        elif not any(got[1]):
            drops.append((rank, "no assistant token within max_len"))
        else:
            items.append(Item(r["id"], r.get("source", ""), rank, *got))
    return items


# -- extraction ----------------------------------------------------------------------------------------------------

def capture_items(target, items: list[Item], batch_size: int, dtype) -> list[dict]:
    """Target tensors per conversation (unpadded, token-major), from right-padded, length-sorted batches."""
    import torch

    out: list[dict | None] = [None] * len(items)
    order = sorted(range(len(items)), key=lambda i: len(items[i].ids))
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        width = max(len(items[i].ids) for i in idx)
        ids = torch.zeros((len(idx), width), dtype=torch.long)
        att = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, :len(items[i].ids)] = torch.tensor(items[i].ids)
            att[r, :len(items[i].ids)] = 1
        cap = target.capture(ids, attention_mask=att.to(target.device))
        top1 = target_top1(target, cap.last_hidden.to(dtype))
        for r, i in enumerate(idx):
            n = len(items[i].ids)
            t = {f"feature_{j}": f[r, :n] for j, f in enumerate(cap.features)}
            t["last_hidden"] = cap.last_hidden[r, :n]
            for j, (k, v) in enumerate(cap.kv):
                t[f"k_{j}"] = k[r, :, :n].transpose(0, 1)   # [T, Hkv, hd]: packed along tokens
                t[f"v_{j}"] = v[r, :, :n].transpose(0, 1)
            out[i] = {name: x.to(dtype).contiguous().cpu() for name, x in t.items()}
            out[i]["target_top1"] = top1.indices[r, :n].to(torch.int32).contiguous().cpu()
            out[i]["target_top1_logit"] = top1.values[r, :n].float().contiguous().cpu()
    return out  # type: ignore[return-value]


def target_top1(target, last_hidden):
    """The target's full-vocabulary top-1 (values, indices) per position, from its last hidden state as the cache
    stores it, in the LM head's dtype: the logits the trainer and the evaluation would compute from the cache."""
    import torch
    import torch.nn.functional as F

    w = target.lm_head.weight
    with torch.no_grad():
        return F.linear(last_hidden.to(device=w.device, dtype=w.dtype), w).max(-1)


def pack(items: list[Item], tensors: list[dict] | None) -> dict:
    """One shard's tensors: conversations concatenated along tokens, `offsets` marking each."""
    import torch

    lengths = [len(it.ids) for it in items]
    offsets = torch.zeros(len(items) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    out = {"input_ids": torch.tensor([t for it in items for t in it.ids], dtype=torch.int32),
           "loss_mask": torch.tensor([m for it in items for m in it.mask], dtype=torch.uint8),
           "offsets": offsets, "ranks": torch.tensor([it.rank for it in items], dtype=torch.int64)}
    if tensors:
        for name in tensors[0]:
            out[name] = torch.cat([t[name] for t in tensors], 0)
    return out


def shard_meta(items: list[Item], fingerprint: dict) -> dict[str, str]:
    return {"format": FORMAT, "ids": json.dumps([it.id for it in items]),
            "sources": json.dumps([it.source for it in items]), "fingerprint": json.dumps(fingerprint, sort_keys=True)}


def shard_is_current(path: Path, items: list[Item], fingerprint: dict) -> bool:
    """A shard left by an earlier (interrupted) run is reused when it holds the same conversations and settings."""
    if not path.is_file():
        return False
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
    except Exception:  # a foreign or damaged file is simply recomputed
        return False
    want = shard_meta(items, fingerprint)
    return meta.get("ids") == want["ids"] and meta.get("fingerprint") == want["fingerprint"]


def write_shard(path: Path, tensors: dict, meta: dict[str, str]) -> None:
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=meta)


def shard_groups(items: list[Item], shard_size: int, by_rank: bool) -> list[list[Item]]:
    """Shard k = ranks [k*size, (k+1)*size) (aligned, so smaller scales share shards), else consecutive items."""
    if not by_rank:
        return [items[i:i + shard_size] for i in range(0, len(items), shard_size)]
    groups: dict[int, list[Item]] = {}
    for it in items:
        groups.setdefault(it.rank // shard_size, []).append(it)
    return [groups[k] for k in sorted(groups)]


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


def extract(items: list[Item], out_dir: Path, params: FeaturesParams, target, fingerprint: dict,
            by_rank: bool, progress=None) -> list[dict]:
    """Write (or reuse) the shards of `items` in `out_dir`; returns one record per shard for the index."""
    import torch

    dtype = getattr(torch, params.dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    records = []
    groups = shard_groups(items, params.shard_size, by_rank)
    keys = [(g[0].rank // params.shard_size) if by_rank else k for k, g in enumerate(groups)]
    for key, group in zip(keys, groups):
        path = out_dir / shard_name(key)
        if not shard_is_current(path, group, fingerprint):
            tensors = capture_items(target, group, params.batch_size, dtype) if params.offline else None
            write_shard(path, pack(group, tensors), shard_meta(group, fingerprint))
        records.append(shard_record(path, group, params.shard_size, key))
        if progress is not None:
            progress(sum(len(it.ids) for it in group), len(group))
    return records


def shard_record(path: Path, group: list[Item], shard_size: int, key: int) -> dict:
    return {"file": path.name, "conversations": len(group), "tokens": sum(len(it.ids) for it in group),
            "loss_tokens": sum(sum(it.mask) for it in group), "bytes": path.stat().st_size,
            "first_rank": group[0].rank, "last_rank": group[-1].rank}


def derive_scale(src_dir: Path, src_records: list[dict], items: list[Item], dst_dir: Path, limit: int,
                 shard_size: int, fingerprint: dict) -> list[dict]:
    """A smaller scale from the largest one's shards: whole shards are hard-linked, the boundary one sliced."""
    from safetensors import safe_open

    dst_dir.mkdir(parents=True, exist_ok=True)
    by_key = {r["file"]: r for r in src_records}
    records = []
    groups = shard_groups([it for it in items if it.rank < limit], shard_size, True)
    for group in groups:
        key = group[0].rank // shard_size
        name = shard_name(key)
        src, dst = src_dir / name, dst_dir / name
        if len(group) == by_key[name]["conversations"]:
            if not (dst.is_file() and os.path.samefile(src, dst)):
                _link(src, dst)
        elif not shard_is_current(dst, group, fingerprint):
            n = len(group)
            with safe_open(str(src), "pt") as f:
                offsets = f.get_tensor("offsets")
                cut = int(offsets[n])
                tensors = {}
                for k in f.keys():
                    x = f.get_tensor(k)
                    tensors[k] = (offsets[:n + 1] if k == "offsets" else x[:n] if k == "ranks" else x[:cut]).clone()
            write_shard(dst, tensors, shard_meta(group, fingerprint))
        records.append(shard_record(dst, group, shard_size, key))
    return records


def _link(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f".{dst.name}.link")
    if tmp.exists():
        tmp.unlink()
    try:
        os.link(src, tmp)
    except OSError:  # another file system: copy instead
        shutil.copy2(src, tmp)
    os.replace(tmp, dst)


def token_frequencies(items: Iterable[Item]) -> Counter:
    """How often each token is a loss-masked (assistant) token: the draft vocabulary's ranking."""
    c: Counter = Counter()
    for it in items:
        c.update(t for t, m in zip(it.ids, it.mask) if m)
    return c


def write_index(out_dir: Path, name: str, items: list[Item], records: list[dict], params: FeaturesParams,
                target_info: dict, drops: dict, fingerprint: dict) -> dict:
    """index.json: everything a reader needs to know about the cache without opening a shard."""
    from safetensors import safe_open

    tensors = {}
    if records:
        with safe_open(str(out_dir / records[0]["file"]), "pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                tensors[k] = {"dtype": sl.get_dtype(), "shape": sl.get_shape()[1:] if k not in ("offsets",) else [],
                              "per": "conversation" if k in ("offsets", "ranks") else "token"}
    keep = {r["file"] for r in records}
    for stale in out_dir.glob("shard-*.safetensors"):
        if stale.name not in keep:
            stale.unlink()
    tokens = sum(r["tokens"] for r in records)
    nbytes = sum(r["bytes"] for r in records)
    freq = token_frequencies(items)
    index = {"format": FORMAT, "name": name, "offline": params.offline, "target": target_info,
             "max_len": params.max_len, "dtype": params.dtype if params.offline else None,
             "conversations": sum(r["conversations"] for r in records), "tokens": tokens,
             "loss_tokens": sum(r["loss_tokens"] for r in records), "bytes": nbytes,
             "bytes_per_token": nbytes / max(tokens, 1), "tensors": tensors, "shards": records,
             "dropped": dict(drops), "fingerprint": fingerprint,
             "token_freq": {str(t): n for t, n in freq.most_common()}}
    write_json_atomic(out_dir / "index.json", index)
    return index


def target_info(target, tp: TargetParams) -> dict:
    info = {"source": tp.source, "dtype": tp.dtype}
    if target is not None:
        info.update(num_layers=target.num_layers, hidden_size=target.hidden_size, num_heads=target.num_heads,
                    num_kv_heads=target.num_kv_heads, head_dim=target.head_dim, vocab_size=target.vocab_size,
                    feature_layers=target.feature_layers, kv_layers=target.kv_layers)
    return info


# -- the stage -----------------------------------------------------------------------------------------------------

def load_regenerated(paths: Paths, data) -> list[dict]:
    rows = []
    for source in data.sources:
        rows += read_jsonl(paths.regenerated(source))
    return rows


def run(params: FeaturesParams, target: TargetParams, data, paths: Paths, report: Report) -> None:
    """Tokenise, mask and (offline) run the target over the eval split and every scale; write the caches."""
    from rich.console import Console

    from stages.regenerate_backends import load_tokenizer

    console = Console(stderr=True)
    rows = load_regenerated(paths, data)
    loaded = None
    if params.offline:
        from stages.common import load_target_for

        loaded = load_target_for(target, paths)
        tok = loaded.tokenizer
    else:
        tok = load_tokenizer(target, paths)
    info = target_info(loaded, target)
    # "teacher": shards written before the cached top-1 existed are not current (they lack it)
    fp = {"max_len": params.max_len, "offline": params.offline, "dtype": params.dtype, "teacher": "top1", **info}
    largest_name, largest = max(data.scales.items(), key=lambda kv: kv[1])
    metrics: dict[str, float] = {}
    sets = {EVAL: sorted((r for r in rows if r.get("split") == EVAL), key=lambda r: r["scale_rank"]),
            largest_name: sorted((r for r in rows if r.get("split") == "train" and r["scale_rank"] < largest),
                                 key=lambda r: r["scale_rank"])}
    if not sets[largest_name]:
        raise StageError(f"{paths.regenerated(next(iter(data.sources)))}: no training conversations "
                         "(run regenerate first)")
    drops: dict[str, list[tuple[int, str]]] = {k: [] for k in sets}
    items = {k: tokenize_rows(v, tok, params.max_len, drops[k]) for k, v in sets.items()}
    total_tokens = sum(len(it.ids) for v in items.values() for it in v)
    with StageProgress(console) as bar:
        task = bar.add_task("features", total=total_tokens, unit="tok", note="{conv:,} conv", conv=0)
        convs = [0]

        def step(ntok: int, nconv: int) -> None:
            convs[0] += nconv
            bar.advance(task, ntok, conv=convs[0])
        records = {}
        for name in (EVAL, largest_name):
            out = paths.features(name)
            records[name] = extract(items[name], out, params, loaded, fp, by_rank=(name != EVAL), progress=step)
            write_index(out, name, items[name], records[name], params, info,
                        Counter(reason for _, reason in drops[name]), fp)
    for name, limit in data.scales.items():
        if name == largest_name:
            continue
        sub = [it for it in items[largest_name] if it.rank < limit]
        recs = derive_scale(paths.features(largest_name), records[largest_name], items[largest_name],
                            paths.features(name), limit, params.shard_size, fp)
        write_index(paths.features(name), name, sub, recs, params, info,
                    Counter(reason for rank, reason in drops[largest_name] if rank < limit), fp)
    for name in [EVAL, *data.scales]:
        idx = json.loads((paths.features(name) / "index.json").read_text())
        console.print(f"features {name}: {idx['conversations']:,} conversations, {idx['tokens']:,} tokens "
                      f"({idx['loss_tokens']:,} loss-masked), {idx['bytes_per_token']:,.0f} B/token")
        metrics.update({f"features/{name}/conversations": idx["conversations"], f"features/{name}/tokens":
                        idx["tokens"], f"features/{name}/bytes_per_token": idx["bytes_per_token"]})
    report(metrics)
