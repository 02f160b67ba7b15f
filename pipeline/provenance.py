"""What the report states about the run that produced it: profile, target, data, commit, date, hardware, time."""
from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from pipeline.config import ROOT, Config
from pipeline.machine import hardware

TIMINGS = "scratch/timings.json"
MACHINES = "scratch/machines.json"   # the machine each stage command last ran on (studies run on different ones)
PARTS = "scratch/parts.json"         # each study part run in one go (`kvshot repro --part`): its wall time and where


def short_commit(root: Path = ROOT) -> str:
    """The run's commit as the report prints it: tracking's HEAD (with its '+dirty' mark) shortened to 7 digits."""
    from pipeline.tracking import git_commit

    head, mark, rest = git_commit(root).partition("+")
    return head if head == "unknown" else head[:7] + mark + rest


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _update_json(path: Path, key: str, value: object) -> None:
    from stages.common import write_json_atomic

    data = {**_read_json(path), key: value}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, dict(sorted(data.items())))


def record_time(root: Path, command: str, seconds: float, machine: str | None = None) -> None:
    """Remember the latest wall time of each stage command in the workspace (summed by the report) and the
    machine it ran on (this one unless given)."""
    _update_json(Path(root) / TIMINGS, command, round(seconds, 1))
    _update_json(Path(root) / MACHINES, command, machine or hardware())


def record_part(root: Path, part: str, seconds: float, data_stages_s: float, fresh: bool,
                begun_before: int = 0) -> None:
    """Remember the latest run of a study part in one go (`STUDY/PART`): its whole wall time, the data stages'
    share of it, whether they ran from a fresh workspace, how many of its trials had begun before it (a run
    resumed after an interruption: its time is then not the whole part's), the commit and machine, and the hash of
    the decoding code its end-to-end rows came from. Kept apart from the stage times, which hold the same work
    stage by stage (the report's total sums those)."""
    from stages.code_hash import DECODE_CODE, code_hash

    _update_json(Path(root) / PARTS, part, {"wall_s": round(seconds, 1), "data_stages_s": round(data_stages_s, 1),
                                            "fresh": fresh, **({"begun_before": begun_before} if begun_before else {}),
                                            "commit": short_commit(), "machine": hardware(),
                                            "date": dt.date.today().isoformat(),
                                            "decode_code": code_hash(patterns=DECODE_CODE)})


def part_record(root: Path, part: str) -> dict | None:
    """The latest run in one go of a study part (`STUDY/PART`) in the workspace, None when it has none."""
    record = _read_json(Path(root) / PARTS).get(part)
    return record if isinstance(record, dict) else None


def provenance(cfg: Config, paths) -> dict:
    """The context the report stage prints: everything optional is 'unknown' when it cannot be read."""
    times = _read_json(Path(paths.root) / TIMINGS)
    return {
        "profile": cfg.profile,
        "target": cfg.target.source,
        "data_sizes": {"eval": cfg.data.eval_size, **cfg.data.scales},
        "git_commit": short_commit(),
        "date": dt.date.today().isoformat(),
        "hardware": hardware(),
        "wall_time_s": sum(times.values()) if times else None,
        "stage_times_s": times,
        "stage_machines": _read_json(Path(paths.root) / MACHINES),
        "studies": list(cfg.studies),
        "study_parts": {name: study.parts for name, study in cfg.studies.items() if study.parts},
        "parts_run": _read_json(Path(paths.root) / PARTS),
        "parts_replayed": _replayed(cfg, paths),
    }


def _replayed(cfg: Config, paths) -> dict:
    """Each study part's trials replayed as one sweep from their measured rows (pipeline.budget), the trials not
    run yet paced by rows measured on this machine where there are any; {} when the profile names no parts."""
    from pipeline.budget import replayed_parts
    from pipeline.config import ConfigError

    if not any(study.parts for study in cfg.studies.values()):
        return {}
    try:
        return replayed_parts(cfg, Path(paths.root) / "metrics" / "stepwise", hardware())
    except ConfigError:   # parts that no longer fit the plan: every sweep of the study says so
        return {}
