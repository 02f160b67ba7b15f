"""One trial of a sweep: train a drafter into runs/<study>/<trial>/, then evaluate it step-wise.

A `Trial` is plain data (picklable, shipped to Ray workers); `run_trial` is the default trial function the sweep
runner calls in a worker, `execute` wraps any trial function with the run-directory bookkeeping that makes
sweeps resumable (fingerprint file, result.json).
"""
from __future__ import annotations

import inspect
import json
import math
import os
import shutil
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from stages.code_hash import code_hash
from stages.common import Paths, Report, write_json_atomic, write_text_atomic
from stages.sections import CKPT_CHILDREN, CONTINUED

RESULT_FILE = "result.json"
FINGERPRINT_FILE = "fingerprint"


@dataclass
class Trial:
    """A planned trial: its name in runs/<study>/, the values that vary, and the resolved config."""

    name: str
    study: str
    values: dict[str, Any]
    config: Any                               # pipeline.config.Config (kept untyped: no import cycle)
    depends_on: str | None = None             # the eagle3 trial a ckpt-initialised child loads
    baseline: str | None = None               # the trial it is compared with (pipeline.plan.baseline_of)
    role: str = "trial"                       # what it is in the study's experiment (pipeline.plan.role_of)
    fingerprint: str = ""                     # set by the runner before the trial starts
    data_hashes: dict[str, str] = field(default_factory=dict)
    commit: str = ""                          # the code it is trained with (set by the runner; kept in its row)
    choices: list = field(default_factory=list)   # values taken from a validation study (pipeline.choices.Choice)

    @property
    def variant(self) -> str:
        return self.config.drafter.variant

    def run_dir(self, paths: Paths) -> Path:
        return paths.run_dir(self.study, self.name)


TrialFn = Callable[[Trial, Paths, Report], dict]


def needs_parent(cfg: Any) -> bool:
    """Does this config initialise from a trained eagle3 drafter (a ckpt child, or the continued eagle3)?"""
    d = cfg.drafter
    return (d.variant in CKPT_CHILDREN and d.init == "ckpt") or (d.variant == "eagle3" and d.init == CONTINUED)


def is_continued(cfg: Any) -> bool:
    """The compute-matched control: an eagle3 continued from the trained eagle3 for a child's schedule."""
    return cfg.drafter.variant == "eagle3" and cfg.drafter.init == CONTINUED


# -- the run directory -------------------------------------------------------------------------------------------

def cached_result(trial: Trial, paths: Paths) -> dict | None:
    """The stored result row of a finished trial with the same fingerprint, else None."""
    run_dir = trial.run_dir(paths)
    fp_file, res_file = run_dir / FINGERPRINT_FILE, run_dir / RESULT_FILE
    if not (fp_file.is_file() and res_file.is_file()):
        return None
    if fp_file.read_text().strip() != trial.fingerprint:
        return None
    try:
        row = json.loads(res_file.read_text())
    except json.JSONDecodeError:
        return None   # a damaged result is re-computed, never trusted
    if row.get("fingerprint") != trial.fingerprint or row.get("status") != "ok":
        return None
    return row


def finished_elsewhere(trial: Trial, paths: Paths) -> tuple[Path, dict] | None:
    """The run directory and row of a finished trial with the same fingerprint in another study (or under
    another name), else None; reads only."""
    target_dir = trial.run_dir(paths)
    for fp_file in sorted((paths.root / "runs").glob(f"*/*/{FINGERPRINT_FILE}")):
        donor = fp_file.parent
        if donor == target_dir or fp_file.read_text().strip() != trial.fingerprint:
            continue
        donor_trial = Trial(name=donor.name, study=donor.parent.name, values={}, config=trial.config,
                            fingerprint=trial.fingerprint)
        row = cached_result(donor_trial, paths)
        if row is not None:
            return donor, row
    return None


def adopt_finished(trial: Trial, paths: Paths) -> dict | None:
    """Reuse a finished trial of the same fingerprint from another study (the EAGLE-3 baseline every study
    includes, a scale-study trial that another study already trained): its run directory is copied in with hard
    links and its row renamed. None when no such trial exists."""
    found = finished_elsewhere(trial, paths)
    if found is None:
        return None
    donor, row = found
    target_dir = trial.run_dir(paths)
    if target_dir.exists():
        shutil.rmtree(target_dir)
    target_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = target_dir.with_name(f".{target_dir.name}.adopting")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(donor, tmp, copy_function=_link_or_copy)
    row = {k: v for k, v in row.items() if k != "baseline"}      # the donor's, named in its own study
    row = {**row, "trial": trial.name, "study": trial.study, "values": trial.values,
           **({"baseline": trial.baseline} if trial.baseline else {}), "role": trial.role,
           "reused_from": f"{donor.parent.name}/{donor.name}"}
    (tmp / RESULT_FILE).unlink()
    write_json_atomic(tmp / RESULT_FILE, row)
    os.replace(tmp, target_dir)
    return row


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def begun(trial: Trial, paths: Paths) -> bool:
    """Whether the trial's run directory holds a run of its current fingerprint (finished, or stopped with a
    checkpoint that training resumes from)."""
    fp_file = trial.run_dir(paths) / FINGERPRINT_FILE
    return fp_file.is_file() and fp_file.read_text().strip() == trial.fingerprint


def prepare_run_dir(trial: Trial, paths: Paths) -> Path:
    """Make runs/<study>/<trial>/ ready: a run of another fingerprint is stale and removed (so training never
    resumes from its checkpoint); a run of the same fingerprint is kept (training resumes from its checkpoint)."""
    run_dir = trial.run_dir(paths)
    fp_file = run_dir / FINGERPRINT_FILE
    if run_dir.exists() and (not fp_file.is_file() or fp_file.read_text().strip() != trial.fingerprint):
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RESULT_FILE).unlink(missing_ok=True)
    write_text_atomic(fp_file, trial.fingerprint + "\n")
    return run_dir


def json_safe(obj: Any) -> Any:
    """NaN and infinities (an α_k with no valid position) as null, so the files stay strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def base_row(trial: Trial) -> dict:
    """The identifying columns of a stepwise row (DESIGN §10), before any metric is known; `code` is the hash of the
    code that determines its numbers (part of its fingerprint), which evaluate's own row repeats."""
    d, t = trial.config.drafter, trial.config.train
    return {"trial": trial.name, "study": trial.study, "variant": d.variant, "depth": d.depth,
            "injection": d.injection, "rope_fix": d.rope_fix, "init": d.init, "scale": t.scale, "seed": t.seed,
            "lr": t.lr,
            "values": trial.values, "fingerprint": trial.fingerprint, "code": code_hash(),
            **({"baseline": trial.baseline} if trial.baseline else {}), "role": trial.role,
            **({"data": trial.data_hashes} if trial.data_hashes else {}),
            **({"eval_data": trial.config.eval.data} if trial.config.eval.data else {}),
            **({"git_commit": trial.commit} if trial.commit else {})}


def failed_row(trial: Trial, error: str, wall_s: float | None = None) -> dict:
    return {**base_row(trial), "alpha": None, "acc": None, "mat": None, "retention": None,
            "status": "failed", "error": error, "wall_s": wall_s}


def ran_on(threads: Callable[[], float] | None = None) -> dict:
    """Where a trial's `wall_s` was measured: the machine (`pipeline.machine.hardware`) and the torch threads it
    computed on, averaged over its time (`threads`, else the current count): a pace is only comparable with paces
    measured alike (`pipeline.budget.estimated_seconds`)."""
    import torch

    from pipeline.machine import hardware

    return {"machine": hardware(), "threads": round(threads() if threads else float(torch.get_num_threads()), 2)}


def execute(trial: Trial, paths: Paths, report: Report, trial_fn: TrialFn,
            threads: Callable[[], float] | None = None) -> dict:
    """Run `trial_fn` in a prepared run directory; return its row (status ok) or a failed row, never raise. The row
    says where its time was measured (`ran_on`, with `threads` the trial's mean torch threads).

    On success result.json is written last and atomically, so its presence marks a finished trial.
    """
    start = time.perf_counter()
    try:
        run_dir = prepare_run_dir(trial, paths)
        row = trial_fn(trial, paths, report)
        if not isinstance(row, dict):
            raise TypeError(f"trial function returned {type(row).__name__}, expected a result row dict")
        row = json_safe({**base_row(trial), **row, "trial": trial.name, "study": trial.study,
                         "fingerprint": trial.fingerprint, "status": "ok", "error": None,
                         "wall_s": round(time.perf_counter() - start, 3), **ran_on(threads)})
        write_json_atomic(run_dir / RESULT_FILE, row)
        return row
    except BaseException as exc:  # noqa: BLE001 - a trial's failure is data for the sweep, not a crash
        if isinstance(exc, KeyboardInterrupt):
            raise
        first = str(exc).splitlines()[0] if str(exc) else ""
        err = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
        row = failed_row(trial, err, round(time.perf_counter() - start, 3))
        row["traceback"] = traceback.format_exc(limit=20)
        return row


# -- the default trial: the real stages --------------------------------------------------------------------------

def _call(fn: Callable, *args: Any, required: tuple[str, ...] = (), **kwargs: Any) -> Any:
    """Call a stage entry with the keyword arguments it declares (all of them if it takes **kwargs).

    Extra context (target, data, ...) is offered to every stage; a stage that does not declare one simply does
    not need it. A keyword in `required` that the stage cannot take is an error, not a silent drop.
    """
    sig = inspect.signature(fn)
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    accepted = {k: v for k, v in kwargs.items() if takes_all or k in sig.parameters}
    missing = [k for k in required if k not in accepted]
    if missing:
        raise TypeError(f"{fn.__module__}.{fn.__name__} does not accept {', '.join(missing)}")
    return fn(*args, **accepted)


def train_trial(trial: Trial, paths: Paths, report: Report) -> Path:
    """Train the trial's drafter into its run directory (a ckpt-initialised child loads its parent's run)."""
    from stages import train

    cfg = trial.config
    run_dir = trial.run_dir(paths)
    init_from = paths.run_dir(trial.study, trial.depends_on) if trial.depends_on else None
    required = ("init_from",) if init_from else ()
    _call(train.run, cfg.drafter, cfg.train, run_dir, paths, report, required=required,
          init_from=init_from, target=cfg.target, data=cfg.data, features=cfg.features)
    return run_dir


def evaluate_runs(cfg: Any, run_dirs: list[Path], paths: Paths, report: Report) -> list[dict]:
    """Step-wise evaluation of trained run directories (one row each, DESIGN §10)."""
    from stages import evaluate

    params = cfg.eval
    if params.data and not Path(params.data).is_absolute():   # a worker's cwd need not be the root
        params = params.model_copy(update={"data": str(Path(paths.root) / params.data)})
    return _call(evaluate.run, params, run_dirs, paths, report, target=cfg.target, data=cfg.data,
                 features=cfg.features, train=cfg.train)


def run_trial(trial: Trial, paths: Paths, report: Report) -> dict:
    """The default trial: train, then evaluate. Both report through `report`: training curves by optimizer step,
    then α_k / acc_k by speculative step k (`alpha`, `acc`), MAT and retention."""
    run_dir = train_trial(trial, paths, report)
    rows = evaluate_runs(trial.config, [run_dir], paths, report)
    if len(rows) != 1:
        raise RuntimeError(f"evaluate returned {len(rows)} rows for one run directory {run_dir.name}")
    return rows[0]
