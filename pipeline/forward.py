"""The sweep driver's sink of trial messages: what the trials report reaches MLflow here (one child run per trial
under the sweep's parent run) and the console, and their final rows are collected. Only the driver writes MLflow;
the trials send their messages through Ray Tune (`pipeline.executor`).
"""
from __future__ import annotations

from typing import Any

from rich.console import Console

from pipeline.cost import SweepProgress
from pipeline.trial import Trial


class Forward:
    """Driver-side sink of trial messages: MLflow child runs and the final rows (only the driver writes MLflow).
    `progress` follows the trials as they start and finish; its line is printed after each."""

    def __init__(self, tracker: Any, parent_id: str | None, trials: dict[str, Trial], commit: str,
                 console: Console):
        self.tracker, self.parent_id, self.trials = tracker, parent_id, trials
        self.commit, self.console = commit, console
        self.run_ids: dict[str, str] = {}
        self.rows: dict[str, dict] = {}
        self.reported: dict[str, set[str]] = {}   # metric keys a trial sent live, per trial
        self.progress = SweepProgress()

    def _params_tags(self, t: Trial) -> tuple[dict[str, Any], dict[str, Any]]:
        """A trial's child-run params (every resolved value, the swept ones also as sweep.*) and tags."""
        from pipeline.config import flatten

        tags = {"trial": t.name, "variant": t.variant, "fingerprint": t.fingerprint, "git_commit": self.commit,
                "depends_on": t.depends_on or "", "baseline": t.baseline or "", "role": t.role,
                **{f"data_hash.{k}": v for k, v in t.data_hashes.items()},
                **{f"chosen.{c.key}": c.text() for c in t.choices}}     # a value a validation study chose
        params = flatten(t.config)
        params.update({f"sweep.{k}": v for k, v in t.values.items()})
        return params, tags

    def start(self, name: str, announce: bool = True) -> None:
        t = self.trials[name]
        if announce:
            self.progress.started(name)
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
        self.progress.finished(name, ok)
        style = "green" if ok else "red"

        def number(key: str) -> bool:
            return isinstance(row.get(key), (int, float))

        detail = (f"step MAT {row['step_mat']:.3f}, chain MAT {row['chain_mat']:.3f}"
                  if ok and number("step_mat") and number("chain_mat")
                  else f"MAT {row['mat']:.3f}" if ok and number("mat") else row.get("error", ""))
        self.console.print(f"[{style}]{row['status']}[/] {self.trials[name].study}/{name} {detail}")
        line = self.progress.line()
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
