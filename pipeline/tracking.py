"""MLflow tracking: one experiment per study, a parent run per sweep, one child run per trial (DESIGN §8).

Only one process writes to the backend: the sweep driver. Trials send their metrics to the driver through Ray
Tune results and the driver logs them here, so concurrent trials never contend for the sqlite file ("database is
locked"); writes are still retried briefly in case another tool (a UI, a standalone stage) holds the lock.

Every experiment kvshot creates or reuses is tagged as a model-training experiment (mlflow.experimentKind), so
MLflow presents it as training runs rather than as a GenAI app's traces.

Tracking URI: MLFLOW_TRACKING_URI, else tracking.uri, else sqlite:///<root>/mlflow.db. Artifacts of a local
backend go to <root>/<tracking.artifact_root> (explicitly, never relative to the working directory); with a
remote server the server's artifact store is used unless tracking.artifact_root is itself a URI.
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from stages.code_hash import code_hash
from stages.common import Report

T = TypeVar("T")
_BAD_KEY = re.compile(r"[^A-Za-z0-9_\-. :/]")
_MAX_PARAM = 6000   # MLflow's limit on a param value
# MLflow 3 files an experiment under a kind; without one its UI treats it as a GenAI app (traces, no runs table).
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_KIND = "custom_model_development"
REUSED_FROM = "reused_from"   # tag of a child run whose trial was trained elsewhere: "<study>/<trial>"


def tracking_uri(params: Any, root: Path) -> str:
    """The backend: MLFLOW_TRACKING_URI, else `params.uri` (a TrackingParams), else the project's sqlite file."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    if params is not None and params.uri:
        return params.uri
    return f"sqlite:///{(Path(root).resolve() / 'mlflow.db').as_posix()}"


def artifact_location(params: Any, root: Path, uri: str) -> str | None:
    """Where an experiment's artifacts go; None lets a remote tracking server decide."""
    art = params.artifact_root if params is not None else "mlruns"
    if "://" in art:
        return art
    if uri.startswith(("http://", "https://", "databricks")):
        return None
    p = Path(art)
    return (p if p.is_absolute() else Path(root).resolve() / p).as_uri()


def experiment_name(params: Any, study: str) -> str:
    prefix = params.experiment_prefix if params is not None else "kvshot"
    return f"{prefix}-{study}"


def git_commit(root: Path) -> str:
    """HEAD of the project's git repo ('+dirty' when tracked files changed), or 'unknown'.

    dvc.lock is left out of the check: `dvc repro` itself rewrites it, so counting it would mark every run dirty.
    """
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no",
                                "--", ":/", ":(top,exclude)dvc.lock"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + ("+dirty" if dirty else "")) if head else "unknown"


def _retry(fn: Callable[[], T], attempts: int = 8) -> T:
    """Retry a backend write while sqlite reports a lock held by another process."""
    for i in range(attempts):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - MLflow wraps sqlite errors in several exception types
            if "database is locked" not in str(exc) or i == attempts - 1:
                raise
            time.sleep(0.05 * 2 ** i)
    raise AssertionError("unreachable")


def metric_key(key: str) -> str:
    return _BAD_KEY.sub("_", key)


def _param_value(v: Any) -> str:
    s = str(v)
    return s if len(s) <= _MAX_PARAM else s[: _MAX_PARAM - 3] + "..."


def _finite(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


class Tracker:
    """The MLflow client for one study's experiment; all writes of a sweep go through one instance."""

    def __init__(self, params: Any, root: Path, study: str):
        from mlflow.tracking import MlflowClient

        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        self.root = Path(root).resolve()
        self.uri = tracking_uri(params, self.root)
        self.client = MlflowClient(tracking_uri=self.uri)
        self.study = study
        self.prefix = params.experiment_prefix if params is not None else "kvshot"
        self.experiment = experiment_name(params, study)
        self.experiment_id = self._experiment(artifact_location(params, self.root, self.uri))

    def _experiment(self, location: str | None) -> str:
        exp = _retry(lambda: self.client.get_experiment_by_name(self.experiment))
        if exp is not None:
            mark_training(self.client, exp)   # an experiment of an older workspace gets its kind too
            return exp.experiment_id
        try:
            return _retry(lambda: self.client.create_experiment(
                self.experiment, artifact_location=location, tags={EXPERIMENT_KIND_TAG: TRAINING_KIND}))
        except Exception:  # noqa: BLE001 - another process created it first
            exp = self.client.get_experiment_by_name(self.experiment)
            if exp is None:
                raise
            mark_training(self.client, exp)
            return exp.experiment_id

    def trained_run(self, fingerprint: str) -> Any | None:
        """The latest finished run, in any of this project's experiments, that trained the trial with this
        fingerprint (a run that itself reused a result does not count), or None."""
        if not fingerprint:
            return None
        exps = _retry(lambda: self.client.search_experiments(filter_string=f"name LIKE '{self.prefix}-%'"))
        if not exps:
            return None
        runs = _retry(lambda: self.client.search_runs(
            [e.experiment_id for e in exps], filter_string=f"tags.fingerprint = '{fingerprint}'",
            order_by=["attributes.start_time DESC"], max_results=50))
        return next((r for r in runs if r.info.status == "FINISHED" and REUSED_FROM not in r.data.tags), None)

    # -- runs ------------------------------------------------------------------------------------------------

    def start_run(self, name: str, parent_id: str | None = None, params: dict[str, Any] | None = None,
                  tags: dict[str, str] | None = None) -> str:
        """Create a run (nested under `parent_id` if given) with params and tags; return its id. Every run is
        tagged with the code hash it ran with (`code`, as in the metrics rows; DESIGN §8)."""
        all_tags = {"study": self.study, "code": code_hash(), **(tags or {})}
        if parent_id:
            all_tags["mlflow.parentRunId"] = parent_id
        run = _retry(lambda: self.client.create_run(self.experiment_id, run_name=name,
                                                    tags={k: str(v) for k, v in all_tags.items()}))
        if params:
            self.log_params(run.info.run_id, params)
        return run.info.run_id

    def log_params(self, run_id: str, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(metric_key(k), _param_value(v)) for k, v in params.items()]
        for i in range(0, len(items), 100):   # MLflow's batch limit for params
            batch = items[i:i + 100]
            _retry(lambda: self.client.log_batch(run_id, params=batch))

    def set_tags(self, run_id: str, tags: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        batch = [RunTag(metric_key(k), _param_value(v)) for k, v in tags.items()]
        _retry(lambda: self.client.log_batch(run_id, tags=batch))

    def log_metrics(self, run_id: str, metrics: dict[str, Any], step: int | None = None) -> None:
        """Log finite numeric metrics (non-numeric and NaN values are skipped) at `step` (0 when None)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(metric_key(k), f, now, int(step or 0)) for k, v in metrics.items()
                 if (f := _finite(v)) is not None]
        if batch:
            _retry(lambda: self.client.log_batch(run_id, metrics=batch))

    def log_row(self, run_id: str, row: dict, skip: set[str] | frozenset = frozenset()) -> None:
        """A trial's step-wise result: α_k and acc_k as curves (step=k), MAT and retention, an α_k plot.

        Metrics in `skip` were already reported live by the stage (same values) and are not logged twice."""
        for name in ("alpha", "acc"):
            if name not in skip:
                for k, v in enumerate(row.get(name) or []):
                    self.log_metrics(run_id, {name: v}, step=k)
        self.log_metrics(run_id, {k: row.get(k) for k in ("mat", "retention", "step_mat", "step_retention", "chain_mat",
                                                          "chain_retention", "agreement", "wall_s") if k not in skip})
        alpha = row.get("alpha") or []
        if alpha:
            self.log_metrics(run_id, {f"alpha_{k}": v for k, v in enumerate(alpha)})
            curve = [a if a is not None else float("nan") for a in alpha]
            _retry(lambda: self.client.log_figure(run_id, alpha_figure({row.get("trial", "trial"): curve}),
                                                  "alpha.png"))

    def log_dict(self, run_id: str, obj: dict, name: str) -> None:
        _retry(lambda: self.client.log_dict(run_id, obj, name))

    def end_run(self, run_id: str, ok: bool = True, error: str | None = None) -> None:
        if error:
            self.set_tags(run_id, {"error": error})
        _retry(lambda: self.client.set_terminated(run_id, status="FINISHED" if ok else "FAILED"))


def mark_training(client: Any, experiment: Any) -> None:
    """Tag an experiment as model training unless it already is (or a user gave it another kind)."""
    if EXPERIMENT_KIND_TAG not in (experiment.tags or {}):
        _retry(lambda: client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, TRAINING_KIND))


def mark_project_experiments(params: Any, root: Path) -> list[Any]:
    """Tag every experiment of the project (`<prefix>-*`) as model training; returns them (oldest first)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri(params, Path(root)))
    prefix = params.experiment_prefix if params is not None else "kvshot"
    exps = _retry(lambda: client.search_experiments(filter_string=f"name LIKE '{prefix}-%'"))
    for exp in exps:
        mark_training(client, exp)
    return sorted(exps, key=lambda e: int(e.experiment_id) if str(e.experiment_id).isdigit() else 0)


def run_link(run: Any) -> str:
    """The UI's address of a run, relative to the server (`#/experiments/<id>/runs/<run>`)."""
    return f"#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"


def alpha_figure(curves: dict[str, list[float]]):
    """α_k against k, one line per trial (a matplotlib Figure; no pyplot, so no GUI backend is touched)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.5, 3.2), dpi=100)
    ax = fig.add_subplot()
    for name, alpha in curves.items():
        ax.plot(range(len(alpha)), alpha, marker="o", label=name)
    ax.set_xlabel("speculative step k")
    ax.set_ylabel("α_k (step-wise acceptance)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    if len(curves) > 1:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


# -- standalone stage runs ---------------------------------------------------------------------------------------

class RunReport:
    """A `Report` callback that logs to one MLflow run (a stage run alone, outside a sweep)."""

    def __init__(self, tracker: Tracker, run_id: str):
        self.tracker, self.run_id = tracker, run_id

    def __call__(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.tracker.log_metrics(self.run_id, metrics, step)


@contextmanager
def stage_run(cfg: Any, stage: str, paths: Any, study: str = "stages") -> Iterator[Report]:
    """An MLflow run for one stage invocation (experiment `<prefix>-<study>`): the resolved config as params,
    the git commit as a tag, FINISHED or FAILED at the end. Yields the stage's `report` callback; when the
    tracking backend cannot be reached the stage still runs, with a warning, and its metrics are dropped."""
    import warnings

    from pipeline.config import flatten
    from stages.common import console_report

    try:
        tracker = Tracker(cfg.tracking, paths.root, study)
        run_id = tracker.start_run(stage, params=flatten(cfg),
                                   tags={"stage": stage, "git_commit": git_commit(paths.root)})
    except Exception as exc:  # noqa: BLE001 - a stage never fails because of tracking
        warnings.warn(f"MLflow tracking unavailable ({type(exc).__name__}: {exc}); metrics are not logged")
        yield console_report
        return
    try:
        yield RunReport(tracker, run_id)
    except BaseException as exc:
        tracker.end_run(run_id, ok=False, error=f"{type(exc).__name__}: {exc}"[:500])
        raise
    tracker.end_run(run_id, ok=True)


