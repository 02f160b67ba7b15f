"""The committed results of a profile's studies (results/study/): the metrics of studies run at different times,
in different workspaces, on different machines, combined into one folder and one report.

`kvshot study-results WS` folds one workspace into the folder: each study whose metrics the workspace holds
replaces that study's committed metrics; every other study's stay as committed. Stage wall times, the machines the
stages ran on, the study parts run in one go (`kvshot repro --part`) and the `dvc.lock` stages merge the same way
(the workspace's entries win); so do the end-to-end rows,
by study (the workspace's rows replace those of the studies it decoded). The report is then
regenerated from the merged files alone, so every row keeps the commit and fingerprint it was trained at. The plans
the studies' sweeps executed (runs/<study>/plan.json) are kept beside the metrics, in metrics/plans/.

A study the workspace began without finishing a trial of it (a part cut off in its first trials leaves an empty
metrics file and the plan it was executing) is not one the workspace ran: its committed rows and plan stay.

A study run in parts (say seed 0 in one workspace, seeds 1 and 2 in another) combines instead of replacing, but only
on the same conversations: a committed row of a trial the workspace did not run stays when its regenerated
conversations (and eval set) have the hashes of a workspace row's, and the study's sweep time is then the sum of
its parts. The feature caches of the parts may differ in bf16 rounding (the target run on another CPU); seeds
pooled across parts carry that difference as part of their run-to-run variation.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from pipeline.config import ConfigError
from pipeline.conversations import pack
from pipeline.plan_file import PLAN_FILE, PlanFile, read_plan
from pipeline.metrics_files import conversations, read_json, read_rows
from pipeline.provenance import MACHINES, PARTS, TIMINGS
from stages.common import StageError, write_json_atomic, write_text_atomic
from stages.engine_report import ENGINE_METRICS

# where each file lies in a workspace -> where it lies in the results folder
_JSON_RECORDS = {TIMINGS: "timings.json", MACHINES: "machines.json", PARTS: "parts.json"}


@dataclass(frozen=True)
class Merged:
    """What `merge` put in the staging root: studies taken from the workspace and those kept as committed."""
    root: Path
    from_workspace: list[str]
    kept: list[str]
    e2e: str   # where metrics/e2e.json came from: "the workspace" (with committed rows of other studies), "as
    #            committed" or "none"
    # studies whose committed rows on the same conversations were kept
    combined: list[str] = field(default_factory=list)
    # studies begun in the workspace without a finished trial: kept as committed (listed in `kept` too)
    unfinished: list[str] = field(default_factory=list)
    # per study, its committed rows left out for being on other conversations than the workspace's (those of
    # trials the workspace ran again are its own rows' to replace, not counted)
    other_data: dict[str, int] = field(default_factory=dict)


def _study_metrics(folder: Path) -> dict[str, Path]:
    return {p.stem: p for p in sorted(folder.glob("*.json"))} if folder.is_dir() else {}


def _read_record(path: Path) -> dict:
    return read_json(path, dict, "a JSON object of stage -> value") if path.is_file() else {}


def merge(workspace: Path, results: Path, staging: Path) -> Merged:
    """Lay out under `staging` (emptied first) the metrics/ and scratch/ a report reads: the committed `results`
    folder's, overlaid with the `workspace`'s. Reads only; `results` and `workspace` are left as they are."""
    workspace, results = Path(workspace), Path(results)
    began = {name: read_rows(path) for name, path in _study_metrics(workspace / "metrics" / "stepwise").items()}
    ws_metrics = {name: rows for name, rows in began.items() if rows}    # a study begun without a finished trial: none
    if not ws_metrics:
        raise StageError(f"{workspace}: no rows in metrics/stepwise/*.json (run a study there first)")
    if staging.exists():
        shutil.rmtree(staging)
    (staging / "metrics" / "stepwise").mkdir(parents=True)
    (staging / "scratch").mkdir()
    committed = _study_metrics(results / "metrics" / "stepwise")
    combined, other_data = [], {}
    for name in {**committed, **ws_metrics}:
        before = read_rows(committed[name]) if name in committed else []
        rows = ws_metrics.get(name)
        if rows is None:
            rows = before
        else:
            kept = same_data_rows(before, rows)
            if kept:
                combined.append(name)
            ran = {(r.get("trial"), r.get("seed")) for r in rows if isinstance(r, dict)}
            left_out = sum(isinstance(r, dict) and (r.get("trial"), r.get("seed")) not in ran for r in before) \
                - len(kept)
            if left_out:
                other_data[name] = left_out
            rows = kept + rows
        write_json_atomic(staging / "metrics" / "stepwise" / f"{name}.json", rows)
    _merge_plans(workspace / "runs", results / "metrics" / "plans", staging / "metrics" / "plans", set(combined),
                 set(ws_metrics))
    e2e_from = _merge_e2e(workspace / "metrics" / "e2e.json", results / "metrics" / "e2e.json",
                          staging / "metrics" / "e2e.json", set(combined))
    # the serving engines' rows (e2e.engines) merge as the e2e rows do
    _merge_e2e(workspace / ENGINE_METRICS, results / ENGINE_METRICS, staging / ENGINE_METRICS, set(combined))
    for ws_rel, kept_name in _JSON_RECORDS.items():
        kept_record, ws_record = _read_record(results / kept_name), _read_record(workspace / ws_rel)
        record = {**kept_record, **ws_record}
        if ws_rel == TIMINGS:   # a study run in parts took the time of its parts
            for key in (f"{command}:{name}" for name in combined for command in ("sweep", "e2e")):
                if key in kept_record and key in ws_record:
                    record[key] = round(kept_record[key] + ws_record[key], 1)
        if record:
            write_json_atomic(staging / ws_rel, record)
    return Merged(staging, sorted(ws_metrics), sorted(set(committed) - set(ws_metrics)), e2e_from, combined,
                  sorted(set(began) - set(ws_metrics)), other_data)


def _merge_plans(ws_runs: Path, kept: Path, out: Path, combined: set[str], ran: set[str]) -> None:
    """metrics/plans/<study>.json, the plans the studies' sweeps executed (runs/<study>/plan.json in a workspace):
    a study the workspace ran (`ran`: it has rows of it) replaces the committed plan, or adds its trials to it by
    name when the study combines (run in parts); the plans of other studies stay as committed."""
    fresh = ({p.parent.name: p for p in sorted(ws_runs.glob(f"*/{PLAN_FILE}")) if p.parent.name in ran}
             if ws_runs.is_dir() else {})
    committed = _study_metrics(kept)
    for study in sorted({*fresh, *committed}):
        plan = _read_plan(fresh.get(study) or committed[study])
        if study in fresh and study in combined and study in committed:
            names = {e.name for e in plan.trials}
            plan.trials = [e for e in _read_plan(committed[study]).trials if e.name not in names] + plan.trials
        out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out / f"{study}.json", plan.model_dump_json(indent=1) + "\n")


def _read_plan(path: Path) -> PlanFile:
    try:
        return read_plan(path)
    except ConfigError as exc:
        raise StageError(str(exc)) from None


def _merge_e2e(ws_e2e: Path, kept_e2e: Path, out: Path, combined: set[str] = frozenset()) -> str:
    """metrics/e2e.json: the workspace's rows replace the committed rows of the studies it decoded; the committed
    rows of other studies stay (the scale and block studies decoded in different workspaces), and so do those of
    a study run in parts (`combined`: its committed step-wise rows were kept) for the trials the workspace did not
    decode. Says where the rows came from."""
    if not ws_e2e.is_file():
        if not kept_e2e.is_file():
            return "none"
        shutil.copy2(kept_e2e, out)
        return "as committed"
    fresh = read_rows(ws_e2e)
    decoded = {r.get("study") for r in fresh if isinstance(r, dict)}
    ran = {(r.get("study"), r.get("trial"), r.get("seed")) for r in fresh if isinstance(r, dict)}
    kept = [r for r in (read_rows(kept_e2e) if kept_e2e.is_file() else [])
            if isinstance(r, dict) and r.get("study")
            and (r["study"] not in decoded or (r["study"] in combined and (r["study"], r.get("trial"), r.get("seed"))
                                               not in ran))]
    write_json_atomic(out, kept + fresh)
    others = sorted({r["study"] for r in kept})
    return "the workspace" + (f", with the committed rows of {', '.join(others)}" if others else "")


def same_data_rows(committed: list, fresh: list) -> list:
    """The committed rows to keep beside a workspace's rows of the same study: those of trials the workspace did
    not run (a trial is its name and seed: a grid cut to one seed names its trials without it), on the same
    conversations as some workspace row. Rows without data hashes, or on other conversations, are not comparable
    with the workspace's and go (the study is replaced)."""
    fresh_data = [conversations(r) for r in fresh if isinstance(r, dict) and conversations(r)]
    ran = {(r.get("trial"), r.get("seed")) for r in fresh if isinstance(r, dict)}
    return [r for r in committed if isinstance(r, dict) and (r.get("trial"), r.get("seed")) not in ran
            and conversations(r) and conversations(r) in fresh_data]


def merged_lock(workspace: Path, results: Path) -> str | None:
    """The results folder's dvc.lock with the workspace's stages put over it (a stage the workspace ran replaces
    the committed one; the rest stay)."""
    def stages(path: Path) -> tuple[dict, dict]:
        if not path.is_file():
            return {}, {}
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise StageError(f"{path}: not a dvc.lock (expected a mapping)")
        return data, data.get("stages") or {}

    ws_lock, ws_stages = stages(Path(workspace) / "dvc.lock")
    kept_lock, kept_stages = stages(Path(results) / "dvc.lock")
    if not ws_stages and not kept_stages:
        return None
    lock = {**kept_lock, **ws_lock, "stages": {**kept_stages, **ws_stages}}
    return yaml.safe_dump(lock, sort_keys=False)


def install(staging: Path, workspace: Path, results: Path) -> list[str]:
    """Copy the staged metrics, records, report and figures (and the merged dvc.lock) into `results`, and the
    target's answers the workspace trained on (`pipeline.conversations.pack`: later parts start from them); a file
    is replaced only once its successor is complete. Returns the sources whose answers were committed."""
    results.mkdir(parents=True, exist_ok=True)
    report = staging / "reports" / "README.md"
    if not report.is_file():
        raise StageError(f"{report}: the report was not written")
    lock = merged_lock(workspace, results)
    for sub, fresh in (("metrics", staging / "metrics"), ("figures", staging / "reports" / "figures")):
        incoming = results / f".{sub}.incoming"
        if incoming.exists():
            shutil.rmtree(incoming)
        if fresh.is_dir():
            shutil.copytree(fresh, incoming)
        else:
            incoming.mkdir()
        old = results / f".{sub}.old"
        if old.exists():
            shutil.rmtree(old)
        if (results / sub).exists():
            (results / sub).rename(old)
        incoming.rename(results / sub)
        if old.exists():
            shutil.rmtree(old)
    write_text_atomic(results / "report.md", report.read_text())
    for ws_rel, kept_name in _JSON_RECORDS.items():
        if (staging / ws_rel).is_file():
            write_text_atomic(results / kept_name, (staging / ws_rel).read_text())
    if lock is not None:
        write_text_atomic(results / "dvc.lock", lock)
    return pack(workspace, results)


__all__ = ["Merged", "conversations", "install", "merge", "merged_lock", "same_data_rows"]
