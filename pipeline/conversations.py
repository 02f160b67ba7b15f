"""The target's answers a profile's studies train and are evaluated on, committed beside its results
(results/<profile>/conversations/<source>.jsonl.gz), so that every part of a study reads the same conversations,
whichever machine and session runs it.

Why: a study runs in parts over many sessions, often in a fresh workspace, and the target's greedy answers are
computed in bf16, whose rounding differs from one CPU to another (AVX512_BF16, AMX): where two tokens nearly tie,
another CPU answers otherwise, and a part regenerated there trains on other conversations than the committed rows,
which the results folder then cannot combine with them (`pipeline.study_results.same_data_rows`). It also spares
each fresh workspace the regeneration (about 18 minutes of the study's data stages on 2 cores).

`pack` (run by `kvshot study-results`) writes the answers the workspace's regenerate stage generated, headed by
that stage's record of a finished run (its settings and each conversation's input hash). `seed` (run when a
workspace is made or refreshed, before its data stages) lays them out as such a finished run; the regenerate
stage then reuses each conversation whose settings and prepared input are unchanged and generates the others
(`stages.regenerate_resume.read_finished`), so a changed profile or split never reuses what does not fit it.
"""
from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

from pipeline.config import ROOT, Config
from stages.common import StageError, atomic_path
from stages.regenerate_resume import finished_path, partial_paths

FOLDER = "conversations"   # in a results folder
SUFFIX = ".jsonl.gz"


def results_folder(cfg: Config) -> Path:
    """A profile's committed results, results/<profile>/ (or under KVSHOT_RESULTS when set: tests)."""
    base = os.environ.get("KVSHOT_RESULTS")
    return (Path(base) if base else ROOT / "results") / cfg.profile


def committed_files(results: Path) -> dict[str, Path]:
    """{source: its committed answers} in a results folder."""
    folder = Path(results) / FOLDER
    return {p.name[: -len(SUFFIX)]: p for p in sorted(folder.glob(f"*{SUFFIX}"))} if folder.is_dir() else {}


def _regenerated(root: Path, source: str) -> Path:
    return Path(root) / "data" / "regenerated" / f"{source}.jsonl"


def pack(workspace: Path, results: Path) -> list[str]:
    """Commit the workspace's generated answers (each source with a finished regenerate run) into `results`;
    returns the sources written. The gzip header carries no time, so the same answers give the same bytes."""
    packed = []
    for final in sorted((Path(workspace) / "data" / "regenerated").glob("*.jsonl")):
        record_file = finished_path(final)
        if not record_file.is_file():
            continue
        record = json.loads(record_file.read_text())
        generated = record.get("inputs", {})
        rows = [line for line in final.read_text().split("\n")
                if line and json.loads(line).get("id") in generated]
        out = Path(results) / FOLDER / f"{final.stem}{SUFFIX}"
        with atomic_path(out) as tmp:
            with tmp.open("wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
                gz.write("\n".join([json.dumps(record, ensure_ascii=False), *rows, ""]).encode())
        packed.append(final.stem)
    return packed


def read_committed(path: Path) -> tuple[dict, str]:
    """A committed file's record and its rows as JSON lines; a file that is not one is a one-line error."""
    try:
        text = gzip.decompress(Path(path).read_bytes()).decode()
        header, _, rows = text.partition("\n")
        record = json.loads(header)
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StageError(f"{path}: not a file of committed conversations ({exc})") from None
    if not isinstance(record, dict) or not isinstance(record.get("inputs"), dict):
        raise StageError(f"{path}: its first line is not the regenerate stage's record of a finished run")
    return record, rows


def seed(results: Path, workspace: Path) -> list[str]:
    """Lay out `results`' committed answers in a workspace that has not regenerated a source yet (no final
    file, no partial files of a run under way) as a finished run the regenerate stage resumes; returns the
    sources seeded. A workspace that holds its own answers keeps them."""
    seeded = []
    for source, path in committed_files(results).items():
        final = _regenerated(workspace, source)
        if final.exists() or partial_paths(final):
            continue
        record, rows = read_committed(path)
        with atomic_path(final) as tmp:
            tmp.write_text(rows)
        with atomic_path(finished_path(final)) as tmp:
            tmp.write_text(json.dumps(record, ensure_ascii=False))
        seeded.append(source)
    return seeded


__all__ = ["FOLDER", "committed_files", "pack", "read_committed", "results_folder", "seed"]
