"""What every stage shares: artifact paths, atomic writes, the metrics callback type and the target section."""
from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field


class Section(BaseModel):
    """Base of every params section: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Report(Protocol):
    """Where a stage sends its metrics: MLflow, Ray Tune or the console, as the pipeline decides."""

    def __call__(self, metrics: dict[str, float], step: int | None = None) -> None: ...


def console_report(metrics: dict[str, float], step: int | None = None) -> None:
    """Fallback callback that drops metrics (the stage's own progress output is what a user sees)."""


class StageError(RuntimeError):
    """Bad input to a stage; the message is one line naming the input and what is wrong."""


class TargetParams(Section):
    """The target LLM (DESIGN §3): 'embedded' SmolLM2-135M, an HF hub id, or a local model folder."""

    source: str = "embedded"
    dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    device: str = "cpu"                       # cpu | cuda | cuda:N | auto
    feature_layers: list[int] | None = None   # default [2, L//2, L-3]
    kv_layers: list[int] | None = None        # default: the same three
    threads: int = Field(0, ge=0)             # torch CPU threads; 0 = torch's default


@dataclass(frozen=True)
class Paths:
    """Artifact locations of DESIGN §10, relative to the project root."""

    root: Path
    cache: Path | None = None   # converted-model cache shared between workspaces (default scratch/models)

    @property
    def scratch(self) -> Path:
        return self.root / "scratch"

    @property
    def model_cache(self) -> Path:
        return self.cache or self.scratch / "models"

    def prepared(self, source: str) -> Path:
        return self.root / "data" / "prepared" / f"{source}.jsonl"

    def regenerated(self, source: str) -> Path:
        return self.root / "data" / "regenerated" / f"{source}.jsonl"

    def features(self, scale: str) -> Path:
        return self.root / "data" / "features" / scale

    def run_dir(self, study: str, trial: str) -> Path:
        return self.root / "runs" / study / trial

    def stepwise_metrics(self, study: str) -> Path:
        return self.root / "metrics" / "stepwise" / f"{study}.json"

    @property
    def e2e_metrics(self) -> Path:
        return self.root / "metrics" / "e2e.json"

    @property
    def reports(self) -> Path:
        return self.root / "reports"


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; it replaces `path` only if the block finishes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; artifacts get the usual permissions
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_text_atomic(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json_atomic(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    """Read a JSONL file; a malformed line is a one-line error naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise StageError(f"{path}: no such file")
    rows = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise StageError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
    return rows


def set_threads(n: int) -> None:
    import torch

    if n > 0:
        torch.set_num_threads(n)


def load_target_for(params: TargetParams, paths: Paths):
    """Load the configured target (the embedded one cached as safetensors under scratch/ for fast reloads)."""
    from models.target import load_target

    set_threads(params.threads)
    return load_target(params.source, dtype=params.dtype, device=params.device, cache_dir=paths.model_cache,
                       feature_layers=params.feature_layers, kv_layers=params.kv_layers)
