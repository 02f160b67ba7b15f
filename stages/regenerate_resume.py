"""The regenerate stage's resumption files: the partial files a killed run leaves and the record of a finished one.

A partial file (`.<name>.partial.w<k>`, one per worker) holds the conversations finished so far, appended and
fsynced as each finishes, under a header with the settings they were made under (`fingerprint_of`); a restarted
run skips them. The record beside a final file (`.<name>.done.json`) keeps those settings and a hash of each
conversation's input, so a later run reuses the conversations whose input is unchanged. How the stage uses them:
stages/regenerate.py.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from stages.common import StageError, TargetParams, atomic_path, read_jsonl
from stages.regenerate_backends import RegenerateParams


# -- partial files and resumption ----------------------------------------------------------------------------------

def partial_paths(final: Path) -> list[Path]:
    return sorted(final.parent.glob(f".{final.name}.partial*"))


def partial_path(final: Path, worker: int) -> Path:
    return final.parent / f".{final.name}.partial.w{worker}"


def read_partials(final: Path, fingerprint: dict) -> dict[str, dict]:
    """Conversations finished by earlier (killed) runs; partials of other settings are discarded."""
    done: dict[str, dict] = {}
    for p in partial_paths(final):
        lines = [line for line in p.read_text().split("\n") if line]   # not splitlines(): text may hold U+2028
        try:
            header = json.loads(lines[0]) if lines else {}
        except json.JSONDecodeError:
            header = {}
        if header.get("fingerprint") != fingerprint:
            p.unlink()
            continue
        for line in lines[1:]:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # the line a kill cut in half
                continue
            done[row["id"]] = row
    return done


class PartialWriter:
    """Append-only, fsynced record of finished conversations."""

    def __init__(self, path: Path, fingerprint: dict):
        path.parent.mkdir(parents=True, exist_ok=True)
        fresh = not path.exists() or path.stat().st_size == 0
        self.f = path.open("a")
        if not fresh:  # a kill may have cut the last line: start ours on a new one
            self.f.write("\n")
        else:
            self.f.write(json.dumps({"fingerprint": fingerprint}) + "\n")
        self._sync()

    def __call__(self, row: dict) -> None:
        self.f.write(json.dumps(row, ensure_ascii=False) + "\n")
        self._sync()

    def _sync(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())

    def close(self) -> None:
        self.f.close()


# -- the record of a finished run ----------------------------------------------------------------------------------

def finished_path(final: Path) -> Path:
    return final.parent / f".{final.name}.done.json"


def input_key(row: dict) -> str:
    """What a regenerated conversation was made from: its prepared messages."""
    return hashlib.sha256(json.dumps(row["messages"], sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]


def read_finished(final: Path, fingerprint: dict, rows: list[dict]) -> dict[str, dict]:
    """Conversations of an earlier finished run (same settings, same input) that `rows` asks for again."""
    record = finished_path(final)
    if not (record.is_file() and final.is_file()):
        return {}
    try:
        meta = json.loads(record.read_text())
    except json.JSONDecodeError:
        return {}                          # an unreadable record: nothing is reused, everything is regenerated
    if not isinstance(meta, dict) or meta.get("fingerprint") != fingerprint:
        return {}
    try:
        previous = read_jsonl(final) + list(meta.get("dropped", []))
    except StageError:
        return {}
    made_from = meta.get("inputs", {})
    wanted = {r["id"]: input_key(r) for r in rows}
    return {r["id"]: r for r in previous
            if isinstance(r, dict) and r.get("id") in wanted and made_from.get(r["id"]) == wanted[r["id"]]}


def write_finished(final: Path, fingerprint: dict, rows: list[dict], done: dict[str, dict]) -> None:
    record = {"fingerprint": fingerprint, "inputs": {r["id"]: input_key(r) for r in rows},
              "dropped": [done[r["id"]] for r in rows if "dropped" in done[r["id"]]]}
    with atomic_path(finished_path(final)) as tmp:
        tmp.write_text(json.dumps(record, ensure_ascii=False))


def fingerprint_of(params: RegenerateParams, target: TargetParams) -> dict:
    """Settings that change the answers: a partial file made under others is not resumed."""
    keep = ("backend", "server_model", "max_new_tokens", "temperature", "top_p", "batch_size", "window",
            "max_prompt_tokens", "sampling_seed", "original_answers_from")
    return {**{k: getattr(params, k) for k in keep}, "target": target.source, "dtype": target.dtype}
