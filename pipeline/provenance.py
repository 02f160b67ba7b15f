"""What the report states about the run that produced it: profile, target, data, commit, date, hardware, time."""
from __future__ import annotations

import datetime as dt
import json
import platform
from pathlib import Path

from pipeline.config import ROOT, Config

TIMINGS = "scratch/timings.json"


def short_commit(root: Path = ROOT) -> str:
    """The run's commit as the report prints it: tracking's HEAD (with its '+dirty' mark) shortened to 7 digits."""
    from pipeline.tracking import git_commit

    head, mark, rest = git_commit(root).partition("+")
    return head if head == "unknown" else head[:7] + mark + rest


def hardware() -> str:
    import psutil
    import torch

    cpu = platform.processor() or platform.machine()
    mem = psutil.virtual_memory().total / 2**30
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{psutil.cpu_count(logical=True)} CPU cores ({cpu}), {mem:.0f} GiB RAM, {gpu}"


def record_time(root: Path, command: str, seconds: float) -> None:
    """Remember the latest wall time of each stage command in the workspace (summed by the report)."""
    path = Path(root) / TIMINGS
    path.parent.mkdir(parents=True, exist_ok=True)
    times = json.loads(path.read_text()) if path.exists() else {}
    times[command] = round(seconds, 1)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(times, indent=1, sort_keys=True))
    tmp.replace(path)


def provenance(cfg: Config, paths) -> dict:
    """The context the report stage prints: everything optional is 'unknown' when it cannot be read."""
    times_path = Path(paths.root) / TIMINGS
    times = json.loads(times_path.read_text()) if times_path.exists() else {}
    return {
        "profile": cfg.profile,
        "target": cfg.target.source,
        "data_sizes": {"eval": cfg.data.eval_size, **cfg.data.scales},
        "git_commit": short_commit(),
        "date": dt.date.today().isoformat(),
        "hardware": hardware(),
        "wall_time_s": sum(times.values()) if times else None,
        "stage_times_s": times,
        "studies": list(cfg.studies),
    }
