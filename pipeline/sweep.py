"""Sweeps: plan a grid of trials, run them on Ray Tune, track them in MLflow, skip what is already done.

    trials = plan(cfg, parse_overrides(["depth=1,2,3,4"]))      # pipeline.plan: ad hoc grid -> study "adhoc"
    trials = plan(cfg, study="depth")                            # a study of the profile (grid + include + seeds)
    show_plan(trials)                                            # pipeline.console: --dry-run
    result = run_sweep(trials, Paths(root))                      # result.exit_code for the CLI

Planning is pure (`pipeline.plan`: no Ray, no files). Running: every trial gets a fingerprint
(pipeline.fingerprint), and the trials with their fingerprints, roles and baselines are written into
runs/<study>/plan.json (`pipeline.plan_file`), which the e2e stage reads; a trial whose runs/<study>/<trial>/ holds
the same fingerprint and a result.json is skipped and its row reused, so a re-run does nothing, a grid grown by a
value runs only the new trials, and a killed sweep resumes. The rest run on Ray Tune (`pipeline.executor`), one
experiment per dependency wave: the parents first, then the hybrid/cross_only children and continued eagle3s that
load their checkpoints; at most `ray.max_concurrent` at a time with `ray.cpus_per_trial` / `ray.gpus_per_trial`
each, and within a wave the trial with the most estimated training ahead of it (its own and its children's) first,
so a wave ends on short trials rather than one long trial running alone (`pipeline.cost.schedule_order`). Trials
report metrics to the driver through Tune results and only the driver writes MLflow (`pipeline.forward`). A failing
trial fails alone: it is marked failed in MLflow and in metrics/stepwise/<study>.json, the others finish, and the
result's exit code is 1. A study that takes a value from a validation study (`choose`, pipeline.choices) is planned
with the finished rows of this workspace (`finished_rows_in`) and does not start while a choice waits for them
(`check_chosen`).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from pipeline.choices import RowsOf, committed_rows
from pipeline.config import Config, ConfigError, lookup
from pipeline.conversations import results_folder
from pipeline.console import show_summary
from pipeline.executor import ray_session, run_trials, trial_slots
from pipeline.forward import Forward
from pipeline.parts import check_parts
from pipeline.plan import plan, varying_keys, waves
from pipeline.plan_file import read_study_plan, write_study_plan
from pipeline.result import SweepResult
from pipeline.standalone import fingerprint_trials
from pipeline.trial import (Trial, TrialFn, adopt_finished, cached_result, finished_elsewhere, json_safe,
                           run_trial)
from stages.common import Paths, write_json_atomic


def run_sweep(trials: list[Trial], paths: Paths, trial_fn: TrialFn = run_trial, console: Console | None = None,
              track: bool = True, parts: dict[str, list[Trial]] | None = None,
              study_trials: list[Trial] | None = None) -> SweepResult:
    """Run the planned trials (see module doc) and write metrics/stepwise/<study>.json and the plan it executes,
    runs/<study>/plan.json (`parts`: the study's parts with their trials, `check_parts`); never raises for a failing
    trial (see SweepResult.exit_code). `trial_fn(trial, paths, report) -> row` runs inside a worker. `trials` a
    part of `study_trials` (the whole plan): the metrics file holds the rows of the study's other trials finished
    in this workspace beside the part's (`_with_other_parts`), as the plan file does."""
    from pipeline.tracking import Tracker, git_commit

    if not trials:
        raise ConfigError("the sweep has no trials")
    console = console or Console()
    study = trials[0].study
    cfg: Config = trials[0].config
    paths = Paths(root=Path(paths.root).resolve(), cache=getattr(paths, "cache", None))
    start = time.perf_counter()
    write_validation_sets(trials, paths)
    fingerprint_trials(trials, paths)
    plan_path = write_study_plan(trials, paths, parts)

    rows = _finished_rows(trials, paths)
    skipped = [t.name for t in trials if t.name in rows]
    todo = [t for t in trials if t.name not in rows]
    console.print(f"sweep [bold]{study}[/]: {len(trials)} trials, {len(skipped)} already done, {len(todo)} to run")

    tracker = Tracker(cfg.tracking, paths.root, study) if track else None
    commit = git_commit(paths.root)
    for t in todo:
        t.commit = commit
    parent_id = _start_parent_run(tracker, trials, commit, skipped, plan_path)
    forward = Forward(tracker, parent_id, {t.name: t for t in trials}, commit, console)
    for t in trials:   # trials already finished get their child run now: the parent lists the whole study
        if t.name in rows:
            forward.reused(t.name, rows[t.name])
    submitted: list[str] = []

    try:
        if todo:
            waves(todo, finished=set(rows))          # every parent is planned or finished (else a ConfigError)
            with ray_session(cfg.ray, paths):
                forward.progress.track(todo, trial_slots(cfg.ray))
                run_trials(todo, rows, paths, cfg, trial_fn, forward, f"{study}-{time.strftime('%Y%m%d-%H%M%S')}",
                           submitted)
    finally:
        rows.update(forward.rows)      # with the rows of the trials that finished before a stop
        # a trial without a row was cut off by a stop (SIGTERM, Ctrl-C): it is not a result, failed or not, and
        # the next run resumes it, so the metrics file leaves it out (a report lists it as not run yet)
        ordered = [rows[t.name] for t in trials if t.name in rows]
        failed = [r["trial"] for r in ordered if r.get("status") != "ok"]
        result = SweepResult(study=study, rows=ordered, ran=submitted,
                             skipped=skipped, failed_names=failed, metrics_path=paths.stepwise_metrics(study),
                             parent_run_id=parent_id)
        write_json_atomic(result.metrics_path,
                          [_public(r) for r in _with_other_parts(ordered, trials, study_trials, paths)])
        _end_parent_run(tracker, result, time.perf_counter() - start)
    show_summary(result, trials, console)
    return result


def write_validation_sets(trials: list[Trial], paths: Paths) -> None:
    """The validation sets the trials evaluate on (a study with `validation`), written before their fingerprints
    hash them."""
    from stages import validation

    wanted = {validation.parse(t.config.eval.data): t.config.data for t in trials}
    for (scale, size), data in sorted((k, v) for k, v in wanted.items() if k is not None):
        validation.write(paths, data, scale, size)


def finished_rows_in(paths: Paths, committed: Path | None = None) -> RowsOf:
    """What the planner reads a validation study's outcome from (`plan(..., rows_of=)`): the finished rows of its
    trials in this workspace, by fingerprint (a row of other code or data is not its trial's), else those of the
    results folder `committed` that stand for them here (`pipeline.choices.committed_rows`); reads only."""
    def rows_of(trials: list[Trial]) -> dict[str, dict]:
        fingerprint_trials(trials, paths)          # a validation set not written yet: no trial of it finished
        found = {t.name: cached_result(t, paths) or (finished_elsewhere(t, paths) or (None, None))[1] for t in trials}
        rows = {name: row for name, row in found.items() if row is not None}
        if committed is not None and len(rows) < len(trials):
            rows.update(committed_rows([t for t in trials if t.name not in rows], committed, paths))
        return rows
    return rows_of


def check_chosen(trials: list[Trial], cfg: Config) -> None:
    """A one-line error while a trial's value waits for its validation study (`choose`), naming the parts of that
    study to run first."""
    waiting = [(t, c) for t in trials for c in t.choices if c.value is None]
    if not waiting:
        return
    by = waiting[0][1].by
    missing = {name for _, c in waiting if c.by == by for name in c.waiting}
    parts = check_parts(plan(cfg, study=by), cfg, by)
    first = [f"{by}/{p}" for p, members in parts.items() if any(m.name in missing for m in members)]
    todo = (f"its parts {', '.join(first)}" if first else f"`kvshot sweep --study {by}`")
    names = sorted({t.name for t, c in waiting if c.by == by})
    raise ConfigError(f"study {trials[0].study}: {waiting[0][1].key} of {', '.join(names[:3])}"
                      f"{', ...' if len(names) > 3 else ''} is chosen by {by}, which has not finished "
                      f"{len(missing)} of the trials it needs in this workspace; run {todo} here first")


def stale_choices(cfg: Config, paths: Paths, rows_of: RowsOf | None = None) -> dict[str, list[str]]:
    """The studies whose executed plan (runs/<study>/plan.json) holds other chosen values than their validation
    studies' finished rows choose now (say `block_lr` was rerun with another grid): DVC does not see that
    dependency, so `kvshot repro` reruns them. {study: one line per trial that would change}."""
    out: dict[str, list[str]] = {}
    for study, spec in cfg.studies.items():
        written = {e.name: e for e in read_study_plan(paths, study) or []} if spec.choose else {}
        if not written:
            continue
        for t in plan(cfg, study=study, rows_of=rows_of or finished_rows_in(paths, results_folder(cfg))):
            for c in t.choices:
                ran = written.get(t.name)
                if c.value is not None and ran is not None and lookup(ran.config, c.key) != c.value:
                    out.setdefault(study, []).append(f"{t.name}: {c.key} {lookup(ran.config, c.key)} -> {c.value}")
    return out


def _finished_rows(trials: list[Trial], paths: Paths) -> dict[str, dict]:
    """The rows of the trials already done: in this study's run directory, or adopted from another study's run of
    the same fingerprint; marked `cached`."""
    rows: dict[str, dict] = {}
    for t in trials:
        row = cached_result(t, paths) or adopt_finished(t, paths)
        if row is not None:
            rows[t.name] = {**row, "cached": True}
    return rows


def _with_other_parts(rows: list[dict], trials: list[Trial], study_trials: list[Trial] | None,
                      paths: Paths) -> list[dict]:
    """A part's rows with the rows of the study's other trials finished in this workspace (their own run
    directories, same fingerprint: current code and data), in the plan's order, so the metrics file of a study run
    part by part holds every part run so far."""
    if not study_trials:
        return rows
    own = {r["trial"]: r for r in rows}
    fingerprint_trials(study_trials, paths)
    found = {t.name: cached_result(t, paths) for t in study_trials if t.name not in own}
    return [own[t.name] if t.name in own else {**found[t.name], "cached": True}
            for t in study_trials if t.name in own or found.get(t.name) is not None]


def _start_parent_run(tracker: Any, trials: list[Trial], commit: str, skipped: list[str],
                      plan_path: Path) -> str | None:
    """The sweep's MLflow parent run, holding the study's plan as it executes it (`plan.json`); None without
    tracking."""
    if not tracker:
        return None
    study = trials[0].study
    run_id = tracker.start_run(
        f"sweep-{study}-{time.strftime('%Y%m%d-%H%M%S')}",
        params={"sweep.study": study, "sweep.trials": len(trials), "sweep.keys": ",".join(varying_keys(trials))},
        tags={"sweep": "parent", "git_commit": commit, "skipped": ",".join(skipped)})
    tracker.log_dict(run_id, json.loads(plan_path.read_text()), "plan.json")
    return run_id


def _end_parent_run(tracker: Any, result: SweepResult, wall_s: float) -> None:
    if tracker and result.parent_run_id:
        failed = result.failed_names
        tracker.log_metrics(result.parent_run_id, {"trials_ran": len(result.ran), "trials_skipped": len(result.skipped),
                                                   "trials_failed": len(failed), "wall_s": wall_s})
        tracker.end_run(result.parent_run_id, ok=not failed, error=f"{len(failed)} failed: {', '.join(failed)}"
                        if failed else None)


def _public(row: dict) -> dict:
    """A row as written to metrics/stepwise/<study>.json (the traceback stays in MLflow)."""
    return json_safe({k: v for k, v in row.items() if k != "traceback"})
