"""The code that determines a trial's numbers and a decoding's, and their content hashes.

A trial's fingerprint (pipeline.fingerprint) includes `code_hash()`, so a trial trained before a change of its code
is stale after it (retrained, never adopted), and every metrics row the study stages write carries it as `code`, so
rows computed by different code can be told apart. The study stages of dvc.yaml list the same files among their
deps (tests/test_repro.py checks that they agree).

TRIAL_CODE is that file set, in one place: the source of models/ and of the stages a trial runs (train; evaluate;
features, which computes the target information online in training and offline for the cache) with the helpers
they import. DECODE_CODE adds the e2e stage, which decodes trained drafters (with kvshot's loop and, when asked,
a serving engine): its rows carry
`code_hash(DECODE_CODE)`, and a change of the decoding loop reruns the decoding, not the training. Left out on
purpose:
  * the data stages' own modules (prepare, sources, regenerate with its resume files and eval choice, validation):
    their outputs are hashed as data, content by content;
  * the report's modules (report, results, findings, baselines): they read metrics and change no trial's numbers;
  * pipeline/: which trials run and where their results are tracked, not what a trial computes;
  * stages/sections.py, the params sections: the resolved values they validate are hashed as the trial's config.
It lives in stages/ (not pipeline/) because the stages write it into their rows and never import pipeline.
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TRIAL_CODE: tuple[str, ...] = (
    "models/**/*.py",            # every module and tensor algorithm: drafters, TTT unroll, metrics, decoding
    "stages/common.py",          # target loading, paths, shared helpers
    "stages/features.py",        # target features, offline (the cache) and online (inside training)
    "stages/feature_cache.py",
    "stages/regenerate_backends.py",  # load_tokenizer: the chat tokenisation features and training use
    "stages/train.py",
    "stages/checkpoint.py",      # how a trained drafter is saved and rebuilt
    "stages/run_files.py",       # a drafter's files, which checkpoint and export read and write
    "stages/export.py",          # checkpoint reads exported drafters through it (with the three below)
    "stages/export_verifier.py",
    "stages/export_mapping.py",
    "stages/export_card.py",
    "stages/evaluate.py",
)
DECODE_CODE: tuple[str, ...] = (
    *TRIAL_CODE,
    "stages/e2e.py",
    "stages/engine.py",          # a serving engine beside kvshot's decoding (e2e.engines)
    "stages/engine_env.py",
    "stages/engine_report.py",   # the engine rows' file name
    "stages/vllm_generate.py",   # run by path in the engine's own environment
    "stages/vllm_proposer.py",    # kvshot's drafters as a proposer inside the engine
)


def code_files(root: Path = ROOT, patterns: tuple[str, ...] = TRIAL_CODE) -> list[Path]:
    """The files of `patterns` under `root`, sorted and without duplicates (compiled caches excluded)."""
    root = Path(root)
    found = {p for pattern in patterns for p in root.glob(pattern) if p.is_file() and "__pycache__" not in p.parts}
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def hash_files(root: Path, files: list[Path]) -> str:
    """sha256 over (path relative to root, content sha256) of each file: a rename or an edit changes it."""
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.relative_to(root).as_posix()}\0{hashlib.sha256(f.read_bytes()).hexdigest()}\n".encode())
    return h.hexdigest()


@functools.lru_cache(maxsize=8)
def _cached(root: str, patterns: tuple[str, ...]) -> str:
    return hash_files(Path(root), code_files(Path(root), patterns))


def code_hash(root: Path | None = None, patterns: tuple[str, ...] = TRIAL_CODE) -> str:
    """The content hash of `patterns` (a trial's code, TRIAL_CODE, by default) under `root` (the project by
    default), computed once per process: a trial's code does not change while a sweep runs, and a new process sees
    a new code state."""
    return _cached(str(Path(root or ROOT).resolve()), tuple(patterns))
