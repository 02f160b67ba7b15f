"""Trial fingerprints: a content hash of what a trial computes from, so a finished trial is never run twice.

fingerprint = sha256 over
  * the resolved config sections that affect a trial (target, data, regenerate, features, drafter, train, eval),
  * the content hashes of its input data (the regenerated conversations, the feature cache of its scale, a custom
    eval set),
  * the hash of the code that determines its numbers (`stages.code_hash.TRIAL_CODE`: models/ and the stages a trial
    runs), so a trial trained before a code change is stale after it: retrained, never adopted (DESIGN §8), and
  * the fingerprint of the trial it is initialised from (hybrid/cross_only with init=ckpt), if any.

Data hashes are content hashes, so they agree across clones and machines. Where `dvc.lock` records an output
(DVC's own md5 of a file, or of a directory's manifest) that md5 is used as is; otherwise files are hashed with
sha256, and a local cache in scratch/ keyed by (size, mtime) keeps re-hashing cheap. The cache only saves time: a
stale stat key misses and the file is hashed again, it never yields a wrong hash for a changed file's stat.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import yaml

from stages.code_hash import code_hash
from stages.common import Paths, write_json_atomic

# The sections of the resolved config that change what a trial trains or measures.
TRIAL_SECTIONS = ("target", "data", "regenerate", "features", "drafter", "train", "eval")
MISSING = "missing"
# Keys added after results were recorded: left out of the config hash while they hold these defaults. Before the
# code hash was part of a fingerprint this kept a trial that does not use a new key reusable; now any change of the
# code (a new key comes with one) gives every trial a new fingerprint: it no longer keeps anything reusable. It is
# kept for one purpose: `config_hash`, the settings part of a fingerprint, stays equal for the same settings across
# code versions, so plans dumped before and after a change compare setting by setting (their fingerprints differ by
# the code hash alone). A new key whose default changes nothing may be listed here for that reason only.
ADDED_DEFAULTS = {"drafter.fc_norm": False, "drafter.norm_output": False, "drafter.no_target": False,
                  "drafter.block_size": 8, "drafter.context": "hidden", "drafter.token_context": False,
                  "train.block_anchors": 0, "train.bucket_window": 1, "train.parent": {}}
_CHUNK = 1 << 20


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def config_hash(cfg: Any) -> str:
    """sha256 of the trial-relevant sections of a resolved `pipeline.config.Config` (a model or its dump)."""
    tree = cfg.model_dump() if hasattr(cfg, "model_dump") else dict(cfg)
    part = {k: dict(tree[k]) if isinstance(tree.get(k), dict) else tree.get(k) for k in TRIAL_SECTIONS}
    for key, default in ADDED_DEFAULTS.items():
        section, name = key.split(".", 1)
        if isinstance(part.get(section), dict) and part[section].get(name, default) == default:
            part[section].pop(name, None)
    return hashlib.sha256(_canonical(part).encode()).hexdigest()


class HashCache:
    """Content hashes of files, remembered per (path, size, mtime_ns) in a JSON file under scratch/."""

    def __init__(self, path: Path | None):
        self.path = Path(path) if path else None
        self.entries: dict[str, list] = {}
        if self.path and self.path.is_file():
            try:
                self.entries = json.loads(self.path.read_text())
            except (json.JSONDecodeError, OSError):
                self.entries = {}   # a damaged cache is only a slower run
        self.dirty = False

    def file(self, path: Path) -> str:
        st = path.stat()
        key = str(path.resolve())
        hit = self.entries.get(key)
        if hit and hit[0] == st.st_size and hit[1] == st.st_mtime_ns:
            return hit[2]
        h = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        digest = h.hexdigest()
        self.entries[key] = [st.st_size, st.st_mtime_ns, digest]
        self.dirty = True
        return digest

    def save(self) -> None:
        if self.path and self.dirty:
            write_json_atomic(self.path, self.entries)
            self.dirty = False


def _dvc_lock_md5s(root: Path) -> dict[str, str]:
    """{output path relative to root: md5} from dvc.lock, {} when there is none or it cannot be read."""
    lock = root / "dvc.lock"
    if not lock.is_file():
        return {}
    try:
        tree = yaml.safe_load(lock.read_text()) or {}
    except yaml.YAMLError:
        return {}
    out: dict[str, str] = {}
    for stage in (tree.get("stages") or {}).values():
        for o in (stage or {}).get("outs") or []:
            if isinstance(o, dict) and o.get("path") and o.get("md5"):
                out[os.path.normpath(o["path"])] = f"md5:{o['md5']}"
    return out


def path_hash(path: Path, root: Path, cache: HashCache, lock: dict[str, str] | None = None) -> str:
    """Content hash of a file or a directory tree; `missing` when it does not exist (yet).

    A dvc.lock entry for the path itself, or for a directory above it, is not used for the part: only an exact
    entry counts, since a directory md5 does not say which of its files changed.
    """
    path = Path(path)
    lock = lock if lock is not None else {}
    try:
        rel = os.path.normpath(str(path.resolve().relative_to(root.resolve())))
    except ValueError:
        rel = None   # outside the project (a user's eval set): hash it
    if rel is not None and rel in lock and path.exists():
        return lock[rel]
    if path.is_file():
        return "sha256:" + cache.file(path)
    if path.is_dir():
        h = hashlib.sha256()
        for f in sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")):
            h.update(f"{f.relative_to(path).as_posix()}\0{cache.file(f)}\n".encode())
        return "dir-sha256:" + h.hexdigest()
    return MISSING


def trial_inputs(cfg: Any, paths: Paths) -> dict[str, Path]:
    """The data files a trial reads, by a readable name: regenerated conversations, its feature cache, eval set."""
    inputs: dict[str, Path] = {}
    for source in cfg.data.sources:
        inputs[f"regenerated/{source}"] = paths.regenerated(source)
    if cfg.features.offline:
        inputs[f"features/{cfg.train.scale}"] = paths.features(cfg.train.scale)
    if cfg.eval.data:
        p = Path(cfg.eval.data)
        inputs["eval"] = p if p.is_absolute() else paths.root / p
    return inputs


def data_hashes(cfg: Any, paths: Paths, cache: HashCache | None = None) -> dict[str, str]:
    """{input name: content hash} for a trial's inputs (see trial_inputs)."""
    own = cache is None
    cache = cache or HashCache(paths.scratch / "hash-cache.json")
    lock = _dvc_lock_md5s(paths.root)
    hashes = {name: path_hash(p, paths.root, cache, lock) for name, p in trial_inputs(cfg, paths).items()}
    if own:
        cache.save()
    return hashes


def fingerprint(cfg: Any, hashes: dict[str, str], parent: str | None = None, code: str | None = None) -> str:
    """The trial fingerprint: config sections + input data hashes + code hash (+ the parent trial's fingerprint).
    `code` defaults to the project's `code_hash()` (tests pass their own)."""
    blob = _canonical({"config": config_hash(cfg), "data": hashes, "parent": parent,
                       "code": code if code is not None else code_hash()})
    return hashlib.sha256(blob.encode()).hexdigest()
