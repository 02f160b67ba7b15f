"""Sweeps: plan a grid of trials, run them on Ray Tune, track them in MLflow, skip what is already done.

    trials = plan(cfg, parse_overrides(["depth=1,2,3,4"]))      # ad hoc grid -> study "adhoc"
    trials = plan(cfg, study="depth")                            # a study of the profile (grid + include + seeds)
    show_plan(trials)                                            # --dry-run
    result = run_sweep(trials, Paths(root))                      # result.exit_code for the CLI

Planning is pure (`pipeline.plan`; a study's parts: `pipeline.parts`; no Ray, no files). Running: every trial
gets a fingerprint (pipeline.fingerprint); a trial whose runs/<study>/<trial>/ holds the same fingerprint and a
result.json is skipped and its row reused, so a re-run does nothing, a grid grown by a value runs only the new
trials, and a killed sweep resumes. The rest run in one Ray Tune experiment, at most `ray.max_concurrent` at a
time with `ray.cpus_per_trial` / `ray.gpus_per_trial` each: a hybrid/cross_only child (or a continued eagle3)
starts as soon as the eagle3 whose checkpoint it loads has finished, not after every parent of the study, and of
the trials that may start the one with the most estimated training ahead of it (its own and its children's)
starts first, so the last trials of a study are short ones rather than one long trial running alone
(`schedule_order`). Trials report metrics to the driver through Tune results and only the driver writes MLflow.
A failing trial fails alone: it is marked failed in MLflow and in metrics/stepwise/<study>.json, the others
finish, and the result's exit code is 1.

Ray: RAY_ADDRESS (or ray.address) joins an existing cluster, else a local Ray starts in-process with
ray.num_cpus CPUs, temp files under scratch/ray, token auth disabled and usage stats off. Workers import the
`pipeline`, `stages` and `models` packages: on a remote cluster install kvshot on every node (`pip install -e .`
of the same checkout), or start the driver under `ray job submit --runtime-env-json
'{"working_dir": ".", "py_modules": ["pipeline", "stages", "models"]}'`. Trials write to absolute paths under
the project root, which must be storage shared by all nodes (the paper profile's setting).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from rich.console import Console
from rich.table import Table

from pipeline.config import Config, ConfigError, with_values
from pipeline.cpu_share import CpuShare
from pipeline.fingerprint import HashCache, data_hashes, fingerprint
from pipeline.plan import ADHOC, PARENT, VARIANT, lookup, trial_name, varying_keys, waves
from pipeline.trial import (Trial, TrialFn, adopt_finished, cached_result, evaluate_runs, execute, failed_row,
                            finished_elsewhere, json_safe, needs_parent, prepare_run_dir, run_trial, train_trial)
from stages.common import Paths, Report, duration, filter_text, write_json_atomic

# A trial's training time relative to another's, fitted to the study's own trials (results/study, 960 steps on 2
# cores: eagle3 25 min, kv_only 28 / 43 / 68 min at depth 1 / 2 / 4): per step 3.0 units, 1.6 more per drafter layer
# past the first, 0.31 more for reading the target's KV. Training is matmul-bound, so work grows with layers times
# steps. Only the order in which trials start and the sweep's estimate of the time left (scaled by the pace it
# measures) depend on these numbers.
_STEP_BASE, _STEP_PER_LAYER, _STEP_KV = 3.0, 1.6, 0.31


def estimated_cost(t: Trial) -> float:
    """A trial's training work in arbitrary units: estimated seconds per step x optimizer steps."""
    from stages.train import total_steps

    c = t.config
    d = c.drafter
    reads_kv = d.variant in ("kv_only", "hybrid", "cross_only") or (d.variant == "block" and d.context != "hidden")
    step = _STEP_BASE + _STEP_PER_LAYER * (max(1, d.depth) - 1) + (_STEP_KV if reads_kv else 0.0)
    conversations = c.data.scales.get(c.train.scale, max(c.data.scales.values()))
    return step * total_steps(c.train, conversations)


def schedule_order(trials: list[Trial]) -> dict[str, float]:
    """Each trial's priority: its estimated cost plus the costliest chain of trials that wait for it (longest
    path first: a parent with long children starts before an equally long trial that nothing waits for)."""
    cost = {t.name: estimated_cost(t) for t in trials}
    children: dict[str, list[str]] = {}
    for t in trials:
        if t.depends_on:
            children.setdefault(t.depends_on, []).append(t.name)
    prio: dict[str, float] = {}

    def chain(name: str) -> float:
        if name not in prio:
            prio[name] = cost[name] + max((chain(c) for c in children.get(name, [])), default=0.0)
        return prio[name]

    for t in trials:
        chain(t.name)
    return prio


def time_left(costs: dict[str, float], finished: dict[str, float], running: dict[str, float],
              slots: int) -> float | None:
    """Seconds a sweep has left, estimated from what it measured: the finished trials' seconds per unit of
    `estimated_cost` (`finished`: name -> seconds it took) times the work still ahead (the trials of `costs` not
    finished, less the seconds each running one has run: `running`), shared by `slots` trials at a time but never
    under the longest single trial left. None until a trial has finished."""
    spent = sum(costs[n] for n in finished)
    if spent <= 0:
        return None
    rate = sum(finished.values()) / spent
    ahead = [max(0.0, costs[n] * rate - running.get(n, 0.0)) for n in costs if n not in finished]
    if not ahead:
        return 0.0
    return max(sum(ahead) / max(1, min(slots, len(ahead))), max(ahead))


def _short(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def _print_table(console: Console, table: Table) -> None:
    """Print at the table's natural width when the output is not a terminal (logs, pipes), so nothing folds."""
    from rich.measure import Measurement

    natural = Measurement.get(console, console.options.update_width(1000), table).maximum
    if console.is_terminal or natural <= console.width:
        console.print(table)
        return
    saved = console._width   # rich caps print(width=) at the console width, so widen the console briefly
    console.width = natural
    try:
        console.print(table)
    finally:
        console._width = saved


def _name_columns(table: Table, trials: list[Trial]) -> None:
    """Trial and variant columns wide enough that names never wrap (other columns give way)."""
    table.add_column("trial", style="bold", no_wrap=True, min_width=max((len(t.name) for t in trials), default=5))
    table.add_column("variant", no_wrap=True, min_width=max((len(t.variant) for t in trials), default=7))


def show_plan(trials: list[Trial], console: Console | None = None, paths: Paths | None = None) -> Table:
    """Render the planned trials as a rich table (the varying keys plus key settings); runs nothing.

    With `paths`, a status column says which trials are already done (same fingerprint: in this study, or in
    another that the sweep adopts it from) and would be skipped, and a line estimates the training left from the
    pace of the plan's finished trials (`time_left`).
    """
    console = console or Console()
    keys = varying_keys(trials)
    study = trials[0].study if trials else ADHOC
    table = Table(title=f"sweep {study}: {len(trials)} trials", title_justify="left")
    table.add_column("#", justify="right")
    _name_columns(table, trials)
    shown = [k for k in keys if k != VARIANT]
    for k in shown:
        table.add_column(_short(k), overflow="fold")
    settings = {"train.scale": "scale", "train.seed": "seed", "train.epochs": "epochs",
                "drafter.draft_vocab_size": "vocab"}
    settings = {k: v for k, v in settings.items() if k not in shown}
    for col in settings.values():
        table.add_column(col)
    table.add_column("after", overflow="fold")
    took: dict[str, float] = {}
    if paths is not None:
        fingerprint_trials(trials, paths)
        table.add_column("status")
    for i, t in enumerate(trials, 1):
        flat = {k: lookup(t.config, k) for k in settings}
        cells = [str(i), t.name, t.config.drafter.variant]
        cells += [str(t.values.get(k, "·")) for k in shown]
        cells += [f"{v:g}" if isinstance(v, float) else str(v) for v in flat.values()]
        cells.append(t.depends_on or "")
        if paths is not None:
            row = cached_result(t, paths)
            elsewhere = None if row else finished_elsewhere(t, paths)
            if elsewhere:
                row = elsewhere[1]
            if row is not None and isinstance(row.get("wall_s"), (int, float)):
                took[t.name] = float(row["wall_s"])
            if elsewhere:
                cells.append(f"done in {elsewhere[0].parent.name}/{elsewhere[0].name}")
            else:
                cells.append("done" if row else "to run")
        table.add_row(*cells)
    _print_table(console, table)
    if paths is not None:
        console.print(plan_estimate(trials, took, trials[0].config.ray.max_concurrent if trials else 1), soft_wrap=True)
    return table


def plan_estimate(trials: list[Trial], took: dict[str, float], slots: int) -> str:
    """`sweep S: 4 of 8 trials to train, about 2:03:10 at 2 at a time (at the pace of the 4 finished)`: the
    training left, from the seconds the plan's finished trials took (`took`) and `estimated_cost`."""
    study = trials[0].study if trials else ADHOC
    todo = [t for t in trials if t.name not in took]
    text = f"sweep {study}: {len(todo)} of {len(trials)} trials to train"
    if not todo:
        return text
    costs = {t.name: estimated_cost(t) for t in trials}
    left = time_left(costs, took, {}, slots)
    if left is None:
        return text + " (no finished trial of the plan to estimate their time from)"
    return text + f", about {duration(left)} at {slots} at a time (at the pace of the {len(took)} finished)"


def show_parts(parts: dict[str, list[Trial]], console: Console, paths: Paths) -> Table:
    """The parts of a study (`--dry-run` without --part): each one's filter, trials, how many are left to train
    and the training time they would take at the pace of the plan's finished trials."""
    every = {t.name: t for ts in parts.values() for t in ts}
    fingerprint_trials(list(every.values()), paths)
    took = {}
    for name, t in every.items():
        row = cached_result(t, paths) or (finished_elsewhere(t, paths) or (None, None))[1]
        if row is not None and isinstance(row.get("wall_s"), (int, float)):
            took[name] = float(row["wall_s"])
    first = next(iter(every.values()), None)
    slots = first.config.ray.max_concurrent if first else 1
    table = Table(title=f"parts of {first.study if first else ADHOC} (`kvshot repro --part STUDY/PART` runs one "
                  "from a fresh workspace)", title_justify="left")
    for col in ("part", "filter", "trials", "to train", "training left", "its trials' times replayed"):
        table.add_column(col, overflow="fold")
    spent = sum(estimated_cost(every[n]) for n in took)
    rate = sum(took.values()) / spent if spent > 0 else None   # seconds per unit of work, as measured
    for name, trials in parts.items():
        spec = first.config.studies[first.study].parts[name] if first else {}
        todo = [t for t in trials if t.name not in took]
        left = "–" if not todo else "unknown" if rate is None else duration(rate * max(
            sum(estimated_cost(t) for t in todo) / min(slots, len(todo)),
            max(schedule_order(todo).values())))   # never under its longest chain of parent and child
        replayed = "–" if todo else duration(replay(trials, took, slots))
        table.add_row(name, filter_text(spec), str(len(trials)), str(len(todo)), left, replayed)
    _print_table(console, table)
    return table


def replay(trials: list[Trial], took: dict[str, float], slots: int) -> float:
    """Seconds a sweep of `trials` takes from scratch if each trains for the seconds it took (`took`): `slots` at a
    time, a child once its parent has finished, in the sweep's own order (`schedule_order`). What a part of a
    study run in pieces would take in one go, its data stages and decoding aside."""
    import heapq

    prio = schedule_order(trials)
    pending, running, ended, now = {t.name: t for t in trials}, [], set(), 0.0
    while pending or running:
        ready = sorted((t for t in pending.values() if t.depends_on is None or t.depends_on in ended
                        or t.depends_on not in prio), key=lambda t: -prio[t.name])
        for t in ready[:slots - len(running)]:
            heapq.heappush(running, (now + took[t.name], t.name))
            del pending[t.name]
        now, name = heapq.heappop(running)
        ended.add(name)
    return now


def single_trial(cfg: Config, study: str = ADHOC) -> Trial:
    """The one trial of a resolved config (`kvshot train`), named like a sweep trial of its variant."""
    values = {"drafter.depth": cfg.drafter.depth}
    if cfg.drafter.variant == "kv_only":
        values.update({"drafter.injection": cfg.drafter.injection, "drafter.rope_fix": cfg.drafter.rope_fix})
    if cfg.drafter.variant in ("hybrid", "cross_only"):
        values["drafter.init"] = cfg.drafter.init
    name = trial_name(cfg.drafter.variant, values, list(values))
    trial = Trial(name=name, study=study, values=values, config=cfg)
    if needs_parent(cfg):
        if cfg.train.parent:
            raise ConfigError(f"{PARENT}={cfg.train.parent}: a parent trained on other settings is planned by a "
                              f"sweep (`kvshot sweep ...`), not by `kvshot train`")
        parent = with_values(cfg, {VARIANT: "eagle3"})
        trial.depends_on = trial_name("eagle3", {"drafter.depth": parent.drafter.depth}, ["drafter.depth"])
    return trial


# -- fingerprints ------------------------------------------------------------------------------------------------

def fingerprint_trials(trials: list[Trial], paths: Paths) -> None:
    """Set every trial's data hashes and fingerprint (parents first: a child's includes its parent's)."""
    cache = HashCache(paths.scratch / "hash-cache.json")
    by_name = {t.name: t for t in trials}
    for wave in waves(trials):
        for t in wave:
            t.data_hashes = data_hashes(t.config, paths, cache)
            parent = by_name[t.depends_on].fingerprint if t.depends_on else None
            t.fingerprint = fingerprint(t.config, t.data_hashes, parent)
    cache.save()


# -- Ray ---------------------------------------------------------------------------------------------------------

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
    a local one (shut down again at the end)."""
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

    row = execute(trial, paths, report, trial_fn)
    config_json = trial.run_dir(paths) / "config.json"
    ckpt_config = None
    if row["status"] == "ok" and config_json.is_file():
        try:
            ckpt_config = json.loads(config_json.read_text())
        except json.JSONDecodeError:
            ckpt_config = None
    _tune_report("done", row=row, checkpoint_config=ckpt_config)


class _Forward:
    """Driver-side sink of trial messages: MLflow child runs and the final rows (only the driver writes MLflow)."""

    def __init__(self, tracker: Any, parent_id: str | None, trials: dict[str, Trial], commit: str,
                 console: Console):
        self.tracker, self.parent_id, self.trials = tracker, parent_id, trials
        self.commit, self.console = commit, console
        self.run_ids: dict[str, str] = {}
        self.rows: dict[str, dict] = {}
        self.reported: dict[str, set[str]] = {}   # metric keys a trial sent live, per trial
        # progress of the trials this sweep trains (`track_progress`): when each started, how long each took
        self.costs: dict[str, float] = {}
        self.slots = 1
        self.started_at: dict[str, float] = {}
        self.took: dict[str, float] = {}

    def track_progress(self, todo: list[Trial], slots: int) -> None:
        self.costs = {t.name: estimated_cost(t) for t in todo}
        self.slots = slots

    def progress(self) -> str | None:
        """`sweep S: 3/8 trials done, 2 running, about 1:04:00 left` (None when the sweep trains one trial)."""
        if len(self.costs) < 2:
            return None
        now = time.time()
        done = [n for n in self.costs if n in self.rows]
        running = {n: now - t for n, t in self.started_at.items() if n in self.costs and n not in self.rows}
        text = f"sweep {self.trials[next(iter(self.costs))].study}: {len(done)}/{len(self.costs)} trials done"
        if running:
            text += f", {len(running)} running"
        left = time_left({n: c for n, c in self.costs.items() if n not in self.rows or n in self.took},
                         self.took, running, self.slots)
        if left is not None and left >= 1 and len(done) < len(self.costs):   # 0: running past the estimate
            text += f", about {duration(left)} left"
        return text

    def _params_tags(self, t: Trial) -> tuple[dict[str, Any], dict[str, Any]]:
        """A trial's child-run params (every resolved value, the swept ones also as sweep.*) and tags."""
        from pipeline.config import flatten

        tags = {"trial": t.name, "variant": t.variant, "fingerprint": t.fingerprint, "git_commit": self.commit,
                "depends_on": t.depends_on or "", **{f"data_hash.{k}": v for k, v in t.data_hashes.items()}}
        params = flatten(t.config)
        params.update({f"sweep.{k}": v for k, v in t.values.items()})
        return params, tags

    def start(self, name: str, announce: bool = True) -> None:
        t = self.trials[name]
        if announce:
            self.started_at.setdefault(name, time.time())
            self.console.print(f"[cyan]start[/] {t.study}/{name}")
        if self.tracker is None or name in self.run_ids:
            return
        params, tags = self._params_tags(t)
        self.run_ids[name] = self.tracker.start_run(name, self.parent_id, params=params, tags=tags)

    def reused(self, name: str, row: dict) -> None:
        """A finished child run for a trial this sweep did not train (its fingerprint finished before, in this
        study or another): the same params and the row's metrics, tagged with where it was trained, so the parent
        run lists every trial of the study and MLflow can compare them all in one place."""
        from pipeline.tracking import REUSED_FROM, run_link

        if self.tracker is None or name in self.run_ids:
            return
        t = self.trials[name]
        origin = row.get(REUSED_FROM) or f"{t.study}/{name}"
        params, tags = self._params_tags(t)
        tags[REUSED_FROM] = origin
        note = f"Not trained in this sweep: the result of {origin}, a trial with the same fingerprint."
        source = self.tracker.trained_run(t.fingerprint)
        if source is not None:
            tags["reused_from_run_id"] = source.info.run_id
            note += f" [Its training run]({run_link(source)})."
        tags["mlflow.note.content"] = note
        run_id = self.tracker.start_run(name, self.parent_id, params=params, tags=tags)
        self.run_ids[name] = run_id
        self.tracker.log_row(run_id, row)
        self.tracker.end_run(run_id)

    def message(self, name: str, msg: dict) -> None:
        if name not in self.run_ids:
            self.start(name)
        run_id = self.run_ids.get(name)
        if msg["kind"] == "metrics" and run_id:
            self.reported.setdefault(name, set()).update(msg["metrics"])
            self.tracker.log_metrics(run_id, msg["metrics"], msg.get("step"))
        elif msg["kind"] == "done":
            self.finish(name, msg["row"], msg.get("checkpoint_config"))

    def finish(self, name: str, row: dict, checkpoint_config: dict | None = None) -> None:
        if name in self.rows:
            return
        self.rows[name] = row
        ok = row["status"] == "ok"
        if ok and name in self.started_at:      # a failed trial's time says nothing of the others' pace
            self.took[name] = time.time() - self.started_at[name]
        style = "green" if ok else "red"
        detail = (f"step MAT {row['step_mat']:.3f}, chain MAT {row['chain_mat']:.3f}"
                  if ok and isinstance(row.get("step_mat"), (int, float)) and isinstance(row.get("chain_mat"), (int, float))
                  else f"MAT {row['mat']:.3f}" if ok and isinstance(row.get("mat"), (int, float)) else row.get("error", ""))
        self.console.print(f"[{style}]{row['status']}[/] {self.trials[name].study}/{name} {detail}")
        line = self.progress()
        if line:
            self.console.print(line)
        run_id = self.run_ids.get(name)
        if run_id is None:
            return
        if ok:
            self.tracker.log_row(run_id, row, skip=self.reported.get(name, set()))
            if checkpoint_config:
                self.tracker.log_dict(run_id, checkpoint_config, "config.json")
        else:
            self.tracker.log_dict(run_id, {"error": row.get("error"), "traceback": row.get("traceback")},
                                  "error.json")
        self.tracker.end_run(run_id, ok=ok, error=None if ok else row.get("error"))


# Tune pickles its callbacks with the experiment state; the live sink (an MLflow client) stays in this registry.
_SINKS: dict[str, _Forward] = {}


def _callback(key: str):
    from ray.tune import Callback

    class Forward(Callback):
        # The registry is looked up at call time (by module), so pickling this class never captures it.
        def on_trial_start(self, iteration, trials, trial, **info):
            from pipeline.sweep import _SINKS
            _SINKS[key].start(trial.config["trial"])

        def on_trial_result(self, iteration, trials, trial, result, **info):
            from pipeline.sweep import PAYLOAD, _SINKS
            if PAYLOAD in result:
                _SINKS[key].message(trial.config["trial"], json.loads(result[PAYLOAD]))

    return Forward()


def _row_status(result: dict | None) -> str | None:
    """The status of the row a trial sent as its last Tune result (None when it sent none)."""
    try:
        msg = json.loads((result or {})[PAYLOAD])
    except (KeyError, TypeError, json.JSONDecodeError):
        return None
    return msg.get("row", {}).get("status") if msg.get("kind") == "done" else None


def _dependency_searcher(trials: list[Trial], done: dict[str, dict], started: list[str]):
    """A Tune searcher that hands out the trials in dependency order without waves: a trial is suggested once the
    trial it depends on finished ok (in this sweep, or before it: the rows of `done`), the ready trial of highest
    `schedule_order` first, and appended to `started`; trials behind a failed parent are never suggested (the
    sweep marks them failed)."""
    from ray.tune.search import Searcher

    class DependencyOrder(Searcher):
        def __init__(self):
            super().__init__()
            prio = schedule_order(trials)
            # highest priority first, plan order among equals (a stable sort)
            self.pending = sorted(trials, key=lambda t: -prio[t.name])
            self.ok = {n for n, r in done.items() if r.get("status") == "ok"}
            self.failed = set(done) - self.ok
            self.names: dict[str, str] = {}

        def blocked(self) -> set[str]:
            out: set[str] = set()
            grew = True
            while grew:
                grew = False
                for t in self.pending:
                    if t.name not in out and t.depends_on and (t.depends_on in self.failed or t.depends_on in out):
                        out.add(t.name)
                        grew = True
            return out

        def suggest(self, trial_id: str):
            ready = [t for t in self.pending if t.depends_on is None or t.depends_on in self.ok]
            if not ready:
                return Searcher.FINISHED if len(self.blocked()) == len(self.pending) else None
            pick = ready[0]
            self.pending.remove(pick)
            self.names[trial_id] = pick.name
            started.append(pick.name)
            return {"trial": pick.name}

        def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
            name = self.names.get(trial_id)
            if name is not None:
                (self.ok if not error and _row_status(result) == "ok" else self.failed).add(name)

        def save(self, checkpoint_path: str) -> None:
            state = {"pending": [t.name for t in self.pending], "ok": sorted(self.ok), "failed": sorted(self.failed),
                     "names": self.names}
            Path(checkpoint_path).write_text(json.dumps(state))

        def restore(self, checkpoint_path: str) -> None:
            state = json.loads(Path(checkpoint_path).read_text())
            by_name = {t.name: t for t in trials}
            self.pending = [by_name[n] for n in state["pending"]]
            self.ok, self.failed, self.names = set(state["ok"]), set(state["failed"]), state["names"]

    return DependencyOrder()


def _run_trials(todo: list[Trial], done: dict[str, dict], paths: Paths, cfg: Config, trial_fn: TrialFn,
                forward: _Forward, label: str, started: list[str]) -> None:
    """Run the trials on Tune in dependency order (`_dependency_searcher`; the names it starts are appended to
    `started`); a trial that died without a final message is recorded as failed, and one whose parent failed as
    never run, saying why."""
    from ray import tune

    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    by_name = {t.name: t for t in todo}
    _SINKS[label] = forward
    resources = {"cpu": cfg.ray.cpus_per_trial, "gpu": cfg.ray.gpus_per_trial}
    trainable = tune.with_resources(
        tune.with_parameters(_trainable, trials=by_name, paths=paths, trial_fn=trial_fn), resources)
    tuner = tune.Tuner(
        trainable,
        tune_config=tune.TuneConfig(search_alg=_dependency_searcher(todo, done, started), num_samples=len(todo),
                                    max_concurrent_trials=cfg.ray.max_concurrent,
                                    trial_name_creator=lambda tr: tr.config["trial"],
                                    trial_dirname_creator=lambda tr: tr.config["trial"],
                                    reuse_actors=True),
        run_config=tune.RunConfig(name=label, storage_path=str(paths.scratch / "tune"), verbose=0,
                                  callbacks=[_callback(label)],
                                  failure_config=tune.FailureConfig(max_failures=0)),
    )
    # Tune looks for per-trial result files we do not write (results go to MLflow): silence its warning.
    logging.getLogger("ray.tune.analysis.experiment_analysis").setLevel(logging.ERROR)
    try:
        grid = tuner.fit()
    finally:
        _SINKS.pop(label, None)
    for res in grid:
        name = res.config.get("trial") if res.config else None
        if name in by_name and name not in forward.rows:
            err = res.error
            text = str(err).strip().splitlines()[-1] if err else "trial ended without a result"
            forward.finish(name, failed_row(by_name[name], f"{type(err).__name__ if err else 'Error'}: {text}"))
    for t in todo:   # never started: behind a failed parent (or, which should not happen, not run by Tune)
        if t.name not in forward.rows:
            parent = (forward.rows.get(t.depends_on) or done.get(t.depends_on)) if t.depends_on else None
            forward.start(t.name, announce=False)   # a FAILED child run says why it never ran
            if parent is not None and parent.get("status") != "ok":
                forward.finish(t.name, failed_row(t, f"depends on {t.depends_on}, which failed"))
            else:
                forward.finish(t.name, failed_row(t, "trial did not run"))


# -- the sweep ---------------------------------------------------------------------------------------------------

@dataclass
class SweepResult:
    """What a sweep did: one row per planned trial (plan order), and which trials ran, were skipped, failed."""

    study: str
    rows: list[dict]
    ran: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed_names: list[str] = field(default_factory=list)
    metrics_path: Path | None = None
    parent_run_id: str | None = None

    @property
    def failed(self) -> int:
        return len(self.failed_names)

    @property
    def exit_code(self) -> int:
        return 1 if self.failed_names else 0


def run_sweep(trials: list[Trial], paths: Paths, trial_fn: TrialFn = run_trial, console: Console | None = None,
              track: bool = True) -> SweepResult:
    """Run the planned trials (see module doc) and write metrics/stepwise/<study>.json; never raises for a
    failing trial (see SweepResult.exit_code). `trial_fn(trial, paths, report) -> row` runs inside a worker."""
    from pipeline.tracking import Tracker, git_commit

    if not trials:
        raise ConfigError("the sweep has no trials")
    console = console or Console()
    study = trials[0].study
    cfg: Config = trials[0].config
    paths = Paths(root=Path(paths.root).resolve(), cache=getattr(paths, "cache", None))
    start = time.perf_counter()
    fingerprint_trials(trials, paths)
    by_name = {t.name: t for t in trials}

    rows: dict[str, dict] = {}
    for t in trials:
        row = cached_result(t, paths) or adopt_finished(t, paths)
        if row is not None:
            rows[t.name] = {**row, "cached": True}
    skipped = [t.name for t in trials if t.name in rows]
    todo = [t for t in trials if t.name not in rows]
    console.print(f"sweep [bold]{study}[/]: {len(trials)} trials, {len(skipped)} already done, {len(todo)} to run")

    tracker = Tracker(cfg.tracking, paths.root, study) if track else None
    commit = git_commit(paths.root)
    for t in todo:
        t.commit = commit
    parent_id = None
    if tracker:
        parent_id = tracker.start_run(
            f"sweep-{study}-{time.strftime('%Y%m%d-%H%M%S')}",
            params={"sweep.study": study, "sweep.trials": len(trials), "sweep.keys": ",".join(varying_keys(trials))},
            tags={"sweep": "parent", "git_commit": commit, "skipped": ",".join(skipped)})
    forward = _Forward(tracker, parent_id, by_name, commit, console)
    for t in trials:   # trials already finished get their child run now: the parent lists the whole study
        if t.name in rows:
            forward.reused(t.name, rows[t.name])
    submitted: list[str] = []

    try:
        if todo:
            waves(todo, finished=set(rows))          # every parent is planned or finished (else a ConfigError)
            with ray_session(cfg.ray, paths):
                forward.track_progress(todo, trial_slots(cfg.ray))
                _run_trials(todo, rows, paths, cfg, trial_fn, forward, f"{study}-{time.strftime('%Y%m%d-%H%M%S')}",
                            submitted)
        rows.update(forward.rows)
    finally:
        ordered = [rows.get(t.name) or failed_row(t, "sweep interrupted") for t in trials]
        failed = [r["trial"] for r in ordered if r.get("status") != "ok"]
        result = SweepResult(study=study, rows=ordered, ran=submitted,
                             skipped=skipped, failed_names=failed, metrics_path=paths.stepwise_metrics(study),
                             parent_run_id=parent_id)
        write_json_atomic(result.metrics_path, [_public(r) for r in ordered])
        if tracker and parent_id:
            tracker.log_metrics(parent_id, {"trials_ran": len(result.ran), "trials_skipped": len(skipped),
                                            "trials_failed": len(failed),
                                            "wall_s": time.perf_counter() - start})
            tracker.end_run(parent_id, ok=not failed, error=f"{len(failed)} failed: {', '.join(failed)}"
                            if failed else None)
    show_summary(result, trials, console)
    return result


def _public(row: dict) -> dict:
    """A row as written to metrics/stepwise/<study>.json (the traceback stays in MLflow)."""
    return json_safe({k: v for k, v in row.items() if k != "traceback"})


def _fmt(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, (int, float)) and not isinstance(v, bool) else "–"


def show_summary(result: SweepResult, trials: list[Trial], console: Console | None = None) -> Table:
    """The end-of-sweep table: the values that vary, acc_0, acc_6, step MAT, chain α_6 and MAT, status, time."""
    console = console or Console()
    keys = [k for k in varying_keys(trials) if k != VARIANT]
    table = Table(title=f"sweep {result.study}: {len(result.ran)} ran, {len(result.skipped)} reused, "
                        f"{result.failed} failed", title_justify="left")
    _name_columns(table, trials)
    for k in keys:
        table.add_column(_short(k), overflow="fold")
    for col in ("acc_0", "acc_6", "step MAT", "α_6 (chain)", "chain MAT", "status", "wall s"):
        table.add_column(col, justify="left" if col == "status" else "right")
    by_name = {t.name: t for t in trials}
    errors = []
    for row in result.rows:
        t = by_name[row["trial"]]
        alpha, acc = row.get("alpha") or [], row.get("acc") or []
        status = row.get("status", "?")
        if status == "ok" and row.get("cached"):
            status = "reused"
        elif status != "ok":
            errors.append(f"[red]{t.name}[/]: {row.get('error', '')}")
            status = f"[red]{status}[/]"
        table.add_row(t.name, t.variant, *[str(t.values.get(k, "·")) for k in keys],
                      _fmt(acc[0] if acc else None), _fmt(acc[6] if len(acc) > 6 else None), _fmt(row.get("step_mat")),
                      _fmt(alpha[6] if len(alpha) > 6 else None), _fmt(row.get("chain_mat", row.get("mat"))), status,
                      f"{row['wall_s']:.1f}" if isinstance(row.get("wall_s"), (int, float)) else "–")
    _print_table(console, table)
    for line in errors:
        console.print(line, highlight=False)
    return table


# -- one stage alone (kvshot train / kvshot evaluate) ------------------------------------------------------------

def train_one(trial: Trial, paths: Paths, report: Report) -> Path:
    """Train one trial in this process (no Ray): its run directory gets the fingerprint, then the checkpoint."""
    parent = None
    if trial.depends_on:
        parent_fp = paths.run_dir(trial.study, trial.depends_on) / "fingerprint"
        if not parent_fp.is_file():
            raise ConfigError(f"{trial.name} (init=ckpt) needs the trained eagle3 drafter runs/{trial.study}/"
                              f"{trial.depends_on}; train it first or use drafter.init=random")
        parent = parent_fp.read_text().strip()
    trial.data_hashes = data_hashes(trial.config, paths)
    trial.fingerprint = fingerprint(trial.config, trial.data_hashes, parent)
    prepare_run_dir(trial, paths)
    return train_trial(trial, paths, report)


def evaluate_study(cfg: Config, study: str, paths: Paths, report: Report) -> list[dict]:
    """Evaluate every trained drafter of runs/<study>/ in this process -> metrics/stepwise/<study>.json."""
    base = paths.root / "runs" / study
    run_dirs = sorted(p for p in base.glob("*") if (p / "model.safetensors").is_file()) if base.is_dir() else []
    if not run_dirs:
        raise ConfigError(f"study {study!r}: no trained drafters under runs/{study}/ (run `kvshot train` or "
                          f"`kvshot sweep --study {study}` first)")
    rows = evaluate_runs(cfg, run_dirs, paths, report)
    out = [json_safe({**r, "study": study, "status": r.get("status", "ok")}) for r in rows]
    write_json_atomic(paths.stepwise_metrics(study), out)
    return out
