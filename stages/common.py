"""What every stage shares: artifact paths, atomic writes, the metrics callback type, the target section and the
progress display of a stage's loops."""
from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
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


def quiet_library_bars() -> None:
    """Off a terminal, silence the weight-loading and download bars of transformers / huggingface_hub: in a log
    (DVC, Ray workers, nohup) each is a burst of carriage-return lines, not progress anyone can read."""
    if sys.stderr.isatty():
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()


def native_bf16(device: str = "cpu") -> bool:
    """Whether bf16 matmuls run natively on `device`: CUDA's own answer, or on CPU whether oneDNN has bf16
    kernels (AVX512_BF16 or AMX). Elsewhere PyTorch emulates bf16, several times slower than fp32."""
    import torch

    if str(device).startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):   # a build without oneDNN: nothing to tell, assume it is fine
        return True


def load_target_for(params: TargetParams, paths: Paths):
    """Load the configured target (the embedded one cached as safetensors under scratch/ for fast reloads)."""
    from models.target import load_target

    quiet_library_bars()
    set_threads(params.threads)
    return load_target(params.source, dtype=params.dtype, device=params.device, cache_dir=paths.model_cache,
                       feature_layers=params.feature_layers, kv_layers=params.kv_layers)


# -- progress --------------------------------------------------------------------------------------------------------

PROGRESS_EVERY_S = 20.0   # how often a log gets a progress line of a running task


@dataclass
class _Task:
    description: str
    total: float | None
    unit: str
    note: str
    completed: float
    fields: dict[str, Any]
    t0: float
    last_line: float
    start_completed: float = 0.0
    printed: float | None = None      # `completed` at the last line printed
    ended: bool = False


def filter_text(only: dict) -> str:
    """A settings filter (KEY -> allowed values) as the command line spells it: `KEY=V1,V2 KEY2=V3`."""
    return " ".join(f"{k}={','.join(map(str, v))}" for k, v in only.items())


def fmt(x: float | None, digits: int = 3) -> str:
    """A number as the reports and progress lines print it; '–' where it is undefined (say, α_k with no chain)."""
    return "–" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def duration(seconds: float) -> str:
    """h:mm:ss (m:ss under an hour), as the progress lines print a time."""
    s = int(round(max(seconds, 0.0)))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def _count(x: float) -> str:
    return f"{int(x):,}" if float(x).is_integer() else f"{x:,.1f}"


def _rate(per_s: float, unit: str) -> str:
    if per_s >= 10:
        return f"{per_s:,.0f} {unit}/s"
    if per_s >= 1:
        return f"{per_s:.1f} {unit}/s"
    if per_s * 60 >= 0.1:
        return f"{per_s * 60:.1f} {unit}/min"
    return f"{per_s * 3600:.1f} {unit}/h"


class StageProgress:
    """The progress of a stage's loops: a live rich bar on a terminal; anywhere else (the logs of DVC, Ray workers,
    nohup) a line every `every_s` seconds and one when a task ends, with done/total, rate and time left, so a long
    stage never looks hung in a log.

        with StageProgress() as bar:
            task = bar.add_task("regenerate sharegpt", total=400, unit="conv", note="{tokens:,} tok", tokens=0)
            bar.advance(task, 1, tokens=1234)

    `note` is formatted with the task's fields (given to add_task, advance or update) and shown after the counts.
    """

    def __init__(self, console: Any = None, every_s: float = PROGRESS_EVERY_S,
                 clock: Callable[[], float] = time.monotonic):
        from rich.console import Console

        self.console = console or Console(stderr=True)
        self.live = self.console.is_terminal
        self.every_s, self._clock = every_s, clock
        self._tasks: dict[int, _Task] = {}
        self._bar = self._rich_bar() if self.live else None

    def _rich_bar(self):
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)
        from rich.text import Text

        class Note(ProgressColumn):
            def render(self, task):
                return Text(task.fields["note"].format(**task.fields) if task.fields.get("note") else "")

        return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[unit]}"), Note(), TimeElapsedColumn(), TimeRemainingColumn(),
                        console=self.console, transient=False)

    def __enter__(self) -> "StageProgress":
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.stop()
            return
        for task_id, t in self._tasks.items():   # a task left short of its total (stopped early, interrupted)
            if not t.ended and t.completed != t.printed:
                self._print(task_id, self._clock())

    def add_task(self, description: str, total: float | None, unit: str = "items", note: str = "",
                 completed: float = 0, **fields: Any) -> int:
        now = self._clock()
        if self._bar is not None:
            task_id = self._bar.add_task(description, total=total, completed=completed, unit=unit, note=note,
                                         **fields)
        else:
            task_id = len(self._tasks)
        self._tasks[task_id] = _Task(description, total, unit, note, completed, dict(fields), now, now,
                                     start_completed=completed)
        self._maybe_print(task_id, now)
        return task_id

    def advance(self, task_id: int, n: float = 1, **fields: Any) -> None:
        self.update(task_id, completed=self._tasks[task_id].completed + n, **fields)

    def skip(self, task_id: int, n: float = 1, **fields: Any) -> None:
        """Count `n` items done without work (dropped, already there): they move the count, not the rate, so an
        early line made of skipped items alone shows no time left rather than an absurd one."""
        self._tasks[task_id].start_completed += n
        self.advance(task_id, n, **fields)

    def update(self, task_id: int, completed: float | None = None, **fields: Any) -> None:
        t = self._tasks[task_id]
        if completed is not None:
            t.completed = completed
        t.fields.update(fields)
        if self._bar is not None:
            self._bar.update(task_id, completed=t.completed, **fields)
        self._maybe_print(task_id, self._clock())

    def line(self, task_id: int, now: float | None = None) -> str:
        """`regenerate sharegpt: 120/400 conv (30%), 1.6 conv/min, 2:55:00 left; 12,345 tok`."""
        t = self._tasks[task_id]
        now = self._clock() if now is None else now
        elapsed = now - t.t0
        rate = (t.completed - t.start_completed) / elapsed if elapsed > 0 else 0.0
        text = f"{t.description}: {_count(t.completed)}"
        if t.total:
            text += f"/{_count(t.total)} {t.unit}"
            if not t.ended:
                text += f" ({100 * t.completed / t.total:.0f}%)"
        else:
            text += f" {t.unit}"
        if t.ended:
            text += f" in {duration(elapsed)}"
        if rate > 0:
            text += f", {_rate(rate, t.unit)}"
            if t.total and not t.ended:
                text += f", {duration((t.total - t.completed) / rate)} left"
        if t.note:
            text += "; " + t.note.format(**t.fields)
        return text

    def _maybe_print(self, task_id: int, now: float) -> None:
        """Off a terminal: a line when the task ends, else when `every_s` passed since its last line."""
        if self.live:
            return
        t = self._tasks[task_id]
        if t.ended:
            return
        t.ended = bool(t.total) and t.completed >= t.total
        if t.ended or now - t.last_line >= self.every_s:
            self._print(task_id, now)

    def _print(self, task_id: int, now: float) -> None:
        t = self._tasks[task_id]
        t.last_line, t.printed = now, t.completed
        self.console.print(self.line(task_id, now), highlight=False, markup=False, soft_wrap=True)
