"""Running a sweep's trials on Ray Tune: the Ray session, the function trainable a worker runs for one trial, and
one Tune experiment per dependency wave (parents before the children that load their checkpoints).

Ray: RAY_ADDRESS (or ray.address) joins an existing cluster, else a local Ray starts in-process with
ray.num_cpus CPUs, temp files under scratch/ray, token auth disabled and usage stats off. Workers import the
`pipeline`, `stages` and `models` packages: on a remote cluster install kvshot on every node (`pip install -e .`
of the same checkout), or start the driver under `ray job submit --runtime-env-json
'{"working_dir": ".", "py_modules": ["pipeline", "stages", "models"]}'`. Trials write to absolute paths under
the project root, which must be storage shared by all nodes (the paper profile's setting).

Trials report to the driver through Tune results (one JSON message under `PAYLOAD`); a Tune callback on the driver
hands each to the sweep's `Forward` sink (`pipeline.forward`), which alone writes MLflow.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from pipeline.config import Config
from pipeline.cost import schedule_order
from pipeline.cpu_share import CpuShare
from pipeline.forward import Forward
from pipeline.plan import waves
from pipeline.stopping import KILL_SIGNALS, stop_on_signals
from pipeline.trial import Trial, TrialFn, execute, failed_row
from stages.common import Paths


def ray_temp_dir(paths: Paths) -> Path:
    """scratch/ray, or a short folder in the system temp dir when that path would overflow Ray's socket names
    (<temp>/session_<date>_<time>_<usec>_<pid>/sockets/plasma_store must stay under 107 characters)."""
    tmp = paths.scratch / "ray"
    if len(str(tmp)) <= 44:
        return tmp
    digest = hashlib.sha256(str(paths.root).encode()).hexdigest()[:8]
    return Path(tempfile.gettempdir()) / f"kvshot-ray-{digest}"


def quiet_ray_output() -> None:
    """What the workers print reaches the driver's log as they print it: without Ray's `(pid=...)` prefix (every
    line kvshot prints names its study and trial) and without folding similar lines of several workers into
    "[repeated 2x across cluster]" (which would swallow progress lines). Ray reads both when first imported."""
    os.environ.setdefault("RAY_DISABLE_WORKER_LOG_PREFIX", "1")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@contextmanager
def ray_session(params: Any, paths: Paths) -> Iterator[None]:
    """Ray for a sweep: reuse one already initialised in this process, join RAY_ADDRESS / ray.address, or start
    a local one (shut down again at the end, also when a SIGTERM or SIGHUP stops the driver)."""
    quiet_ray_output()
    import ray

    if ray.is_initialized():
        yield
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = os.environ.get("RAY_ADDRESS") or params.address
    if address:
        ray.init(address=address, logging_level="WARNING", log_to_driver=True)
    else:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        temp = ray_temp_dir(paths)
        temp.mkdir(parents=True, exist_ok=True)
        ray.init(num_cpus=params.num_cpus, _temp_dir=str(temp), include_dashboard=False,
                 logging_level="WARNING", log_to_driver=True)
    # a SIGTERM or SIGHUP to the driver ends the sweep through here, so the local cluster and its trials stop too
    with stop_on_signals(KILL_SIGNALS):
        try:
            yield
        finally:
            ray.shutdown()


PAYLOAD = "kvshot"   # the one key of every Tune result a trial sends: a JSON message for the driver


def trial_slots(params: Any) -> int:
    """How many trials the connected Ray runs at once: `max_concurrent`, or fewer when the cluster's CPUs (GPUs)
    hold fewer trials of `cpus_per_trial` (`gpus_per_trial`)."""
    import ray

    total = ray.cluster_resources()
    fits = [int(total.get("CPU", 0) // params.cpus_per_trial)]
    if params.gpus_per_trial:
        fits.append(int(total.get("GPU", 0) // params.gpus_per_trial))
    return max(1, min(params.max_concurrent, *fits))


def _tune_report(kind: str, **body: Any) -> None:
    from ray import tune

    tune.report({PAYLOAD: json.dumps({"kind": kind, **body}, default=str)})


def _worker_report(metrics: dict[str, float], step: int | None = None) -> None:
    """The `report` callback a stage gets inside a Ray worker: metrics travel to the driver as Tune results."""
    clean = {}
    for k, v in metrics.items():
        try:
            clean[k] = float(v)
        except (TypeError, ValueError):
            continue
    _tune_report("metrics", metrics=clean, step=step)


def _trainable(config: dict, trials: dict[str, Trial], paths: Paths, trial_fn: TrialFn) -> None:
    """The Tune function trainable: one trial, its row sent back as the last result. While it is the only trial
    holding CPUs it computes on all of them (`pipeline.cpu_share`), checked as it reports."""
    trial = trials[config["trial"]]
    share = CpuShare(trial.config.ray.cpus_per_trial, trial.config.ray.gpus_per_trial)

    def report(metrics: dict[str, float], step: int | None = None) -> None:
        threads = share.update()
        if threads is not None:
            why = "no other trial holds a CPU" if threads > share.own else "another trial holds CPUs again"
            print(f"{trial.name}: {threads} torch thread(s) ({why})", flush=True)
        _worker_report(metrics, step)

    row = execute(trial, paths, report, trial_fn, share.mean_threads)
    config_json = trial.run_dir(paths) / "config.json"
    ckpt_config = None
    if row["status"] == "ok" and config_json.is_file():
        try:
            ckpt_config = json.loads(config_json.read_text())
        except json.JSONDecodeError:
            ckpt_config = None
    _tune_report("done", row=row, checkpoint_config=ckpt_config)


def _callback(forward: Forward | None, started: list[str] | None):
    from ray.tune import Callback

    class ToSink(Callback):
        """Hands every trial's start and messages to the sweep's live sink, and notes the trials started. Tune
        pickles its callbacks with the experiment (tuner.pkl, for `Tuner.restore`, which kvshot does not use: a
        killed sweep resumes by fingerprint); the live sink (an MLflow client, the console) is left out of that
        copy."""

        def __init__(self):
            super().__init__()
            self.sink, self.started = forward, started

        def __reduce__(self):
            return _callback, (None, None)

        def __deepcopy__(self, memo):
            return self          # a copy in this process keeps the live sink

        def on_trial_start(self, iteration, trials, trial, **info):
            if self.sink is not None:
                self.started.append(trial.config["trial"])
                self.sink.start(trial.config["trial"])

        def on_trial_result(self, iteration, trials, trial, result, **info):
            if self.sink is not None and PAYLOAD in result:
                self.sink.message(trial.config["trial"], json.loads(result[PAYLOAD]))

    return ToSink()


def run_trials(todo: list[Trial], done: dict[str, dict], paths: Paths, cfg: Config, trial_fn: TrialFn,
               forward: Forward, label: str, started: list[str]) -> None:
    """Run the trials on Ray Tune, one experiment per dependency wave (`pipeline.plan.waves`): a wave starts once
    the wave before it has ended, its trials in `schedule_order` (the most training ahead first), at most
    `ray.max_concurrent` at a time; the names started are appended to `started`. A trial whose parent failed is not
    started and is recorded failed, saying why; one that died without a final message is recorded failed too."""
    from ray import tune

    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    # Tune looks for per-trial result files we do not write (results go to MLflow): silence its warning.
    logging.getLogger("ray.tune.analysis.experiment_analysis").setLevel(logging.ERROR)
    prio = schedule_order(todo)
    resources = {"cpu": cfg.ray.cpus_per_trial, "gpu": cfg.ray.gpus_per_trial}

    def parent_ok(t: Trial) -> bool:
        return t.depends_on is None or (forward.rows.get(t.depends_on) or done.get(t.depends_on) or {}).get(
            "status") == "ok"

    for i, wave in enumerate(waves(todo, finished=set(done))):
        ready = sorted((t for t in wave if parent_ok(t)), key=lambda t: -prio[t.name])   # stable: plan order
        if not ready:
            continue
        trainable = tune.with_resources(tune.with_parameters(
            _trainable, trials={t.name: t for t in ready}, paths=paths, trial_fn=trial_fn), resources)
        tuner = tune.Tuner(
            trainable,
            param_space={"trial": tune.grid_search([t.name for t in ready])},   # started in this order
            tune_config=tune.TuneConfig(max_concurrent_trials=cfg.ray.max_concurrent,
                                        trial_name_creator=lambda tr: tr.config["trial"],
                                        trial_dirname_creator=lambda tr: tr.config["trial"],
                                        reuse_actors=True),
            run_config=tune.RunConfig(name=f"{label}-wave{i}", storage_path=str(paths.scratch / "tune"), verbose=0,
                                      callbacks=[_callback(forward, started)],
                                      failure_config=tune.FailureConfig(max_failures=0)),
        )
        _record_died(tuner.fit(), ready, forward)
    _record_never_started(todo, done, forward)


def _record_died(grid: Any, ready: list[Trial], forward: Forward) -> None:
    """A failed row for every trial of a wave that died without sending its row, saying why."""
    by_name = {t.name: t for t in ready}
    for res in grid:
        name = res.config.get("trial") if res.config else None
        if name in by_name and name not in forward.rows:
            err = res.error
            text = str(err).strip().splitlines()[-1] if err else "trial ended without a result"
            forward.finish(name, failed_row(by_name[name], f"{type(err).__name__ if err else 'Error'}: {text}"))


def _record_never_started(todo: list[Trial], done: dict[str, dict], forward: Forward) -> None:
    """A failed row for every trial of `todo` never started: behind a failed parent (or, which should not happen,
    not run by Tune), saying why."""
    for t in todo:
        if t.name not in forward.rows:
            parent = (forward.rows.get(t.depends_on) or done.get(t.depends_on)) if t.depends_on else None
            forward.start(t.name, announce=False)   # a FAILED child run says why it never ran
            if parent is not None and parent.get("status") != "ok":
                forward.finish(t.name, failed_row(t, f"depends on {t.depends_on}, which failed"))
            else:
                forward.finish(t.name, failed_row(t, "trial did not run"))
