"""Validation sets: conversations carved out of the training pool to choose settings on, never the eval split.

A study with `validation: N` (pipeline/config.py) evaluates its trials on `data/validation/<scale>-<N>.jsonl`
instead of the eval split: the first N training conversations (in the data's seeded order, `scale_rank`) beyond
the trial's scale, so none of them is trained on, leaving out every conversation whose normalised first prompt
appears among the scale's training conversations and the context-free ones (the held-out rules of
stages/prepare.py). A learning-rate grid evaluated there picks each drafter's learning rate without looking at
the conversations the study's verdicts are measured on (DESIGN §7).

The rows are the regenerated file's own (data/regenerated/): past `regenerate.original_answers_from` they carry
the dataset's answers rather than the target's, like the training rows at those ranks. The file's content is hashed
into every trial's fingerprint as its eval input (pipeline/fingerprint.py), so this module, like prepare, is not
part of a trial's code hash.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from stages.common import Paths, StageError, write_text_atomic
from stages.features import load_regenerated
from stages.prepare import CONTEXT_FREE, first_prompt, prompt_key

FOLDER = "data/validation"
_NAME = re.compile(r"^data/validation/(?P<scale>[A-Za-z0-9_.-]+)-(?P<size>[0-9]+)\.jsonl$")


def relative_path(scale: str, size: int) -> str:
    """Where the validation set of `size` conversations beyond scale `scale` lives, relative to the root."""
    return f"{FOLDER}/{scale}-{size}.jsonl"


def parse(path: str | None) -> tuple[str, int] | None:
    """(scale, size) of a validation set's path (as `relative_path` writes it), else None."""
    m = _NAME.match(path or "")
    return (m["scale"], int(m["size"])) if m else None


def choose(rows: list[dict], scales: dict[str, int], scale: str, size: int) -> list[dict]:
    """The first `size` training rows beyond `scale`, none whose first prompt is trained on or context-free."""
    if scale not in scales:
        raise StageError(f"validation: {scale!r} is not a data scale (data.scales: {', '.join(scales)})")
    limit = scales[scale]
    train = [r for r in rows if r.get("split") == "train"]
    trained = {prompt_key(first_prompt(r["messages"])) for r in train if r.get("scale_rank", limit) < limit}
    beyond = sorted((r for r in train if r.get("scale_rank", -1) >= limit), key=lambda r: r["scale_rank"])
    kept = [r for r in beyond if (key := prompt_key(first_prompt(r["messages"]))) not in trained
            and key not in CONTEXT_FREE]
    if len(kept) < size:
        raise StageError(f"validation: {size} conversations asked beyond scale {scale!r} ({limit:,}), "
                         f"{len(kept):,} found ({len(beyond):,} regenerated past it, the rest share a trained or "
                         f"context-free prompt); train at a smaller scale than the largest ({max(scales.values()):,}) "
                         f"or ask for fewer")
    return kept[:size]


def content(paths: Paths, data, scale: str, size: int) -> str:
    """The content of the validation set of `size` conversations beyond `scale`, from the regenerated data."""
    chosen = choose(load_regenerated(paths, data), dict(data.scales), scale, size)
    return "".join(json.dumps({"id": r["id"], "source": r.get("source"), "scale_rank": r["scale_rank"],
                               "messages": r["messages"]}, ensure_ascii=False) + "\n" for r in chosen)


def write(paths: Paths, data, scale: str, size: int) -> Path:
    """Write the validation set of `size` conversations beyond `scale` (atomically; unchanged content is left as it
    is, so a resumed sweep keeps its trials' fingerprints)."""
    path = Path(paths.root) / relative_path(scale, size)
    body = content(paths, data, scale, size)
    if not path.is_file() or path.read_text() != body:
        write_text_atomic(path, body)
    return path


__all__ = ["FOLDER", "choose", "parse", "content", "relative_path", "write"]
