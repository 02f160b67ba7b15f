"""What each part of a profile's studies would take in one go from a fresh workspace, from the committed rows'
measured trial times: the part's trials replayed as one sweep (`pipeline.sweep.replay`: `ray.max_concurrent` at a
time, each child after its parent, in the sweep's own order), plus the data stages and the part's end-to-end
decoding as the results folder's stage times record them. A study without parts is one part.

    python benchmarks/study_parts.py                       # the study profile against results/study/
    python benchmarks/study_parts.py --profile study --results results/study
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.config import load_config  # noqa: E402
from pipeline.sweep import Trial, check_parts, plan, replay, trial_matches  # noqa: E402
from stages.report import study_key  # noqa: E402
from stages.train import DrafterParams  # noqa: E402

# the row fields that tell one drafter setting from another (a row written before a field existed lacks it)
SETTING = ("variant", "depth", "injection", "rope_fix", "init", "context", "no_target", "fc_norm", "norm_output")


def setting_of(t: Trial) -> dict:
    d = t.config.drafter
    return {**{k: getattr(d, k) for k in SETTING}, "scale": t.config.train.scale, "seed": t.config.train.seed}


def row_matches(row: dict, want: dict) -> bool:
    """A row of the trial's setting; a field the row lacks (written before the field existed) held its default."""
    default = DrafterParams().model_dump()
    return all(row.get(k) == v or (row.get(k) is None and default.get(k, object()) == v) for k, v in want.items())


def measured_seconds(trials: list[Trial], rows: list[dict]) -> dict[str, float]:
    """Each trial's own training and evaluation time (`wall_s`) from the first row of its setting that has one."""
    took = {}
    for t in trials:
        want = setting_of(t)
        found = [r["wall_s"] for r in rows if isinstance(r.get("wall_s"), (int, float)) and row_matches(r, want)]
        if found:
            took[t.name] = float(found[0])
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="study")
    ap.add_argument("--results", type=Path, default=Path("results/study"))
    args = ap.parse_args()
    cfg = load_config(args.profile)
    times = json.loads((args.results / "timings.json").read_text())
    data_s = sum(times.get(k, 0.0) for k in ("prepare", "regenerate", "features"))
    print(f"data stages as recorded: {data_s / 60:.1f} min; slots: {cfg.ray.max_concurrent}")
    print("| part | trials | sweep replayed | decoding recorded | with the data stages |")
    print("| --- | --- | --- | --- | --- |")
    for study in cfg.studies:
        path = args.results / "metrics" / "stepwise" / f"{study}.json"
        rows = json.loads(path.read_text()) if path.is_file() else []
        trials = plan(cfg, study=study)
        parts = check_parts(trials, cfg, study) or {"(whole)": trials}
        for name, part in parts.items():
            took = measured_seconds(part, rows)
            missing = [t.name for t in part if t.name not in took]
            if missing:
                print(f"| {study}/{name} | {len(part)} | not measured: {', '.join(missing)} | | |")
                continue
            sweep_s = replay(part, took, cfg.ray.max_concurrent)
            only = cfg.studies[study].parts.get(name)
            decode = times.get(study_key("e2e", study, only)) if only else times.get(f"e2e:{study}")
            decodes = cfg.studies[study].e2e is True or (isinstance(cfg.studies[study].e2e, dict) and any(
                trial_matches(t, cfg.studies[study].e2e) for t in part))
            decode_text = "–" if not decodes else f"{decode / 60:.1f} min" if isinstance(decode, (int, float)) \
                else "not recorded for this part"
            total = sweep_s + data_s + (decode if isinstance(decode, (int, float)) else 0.0)
            print(f"| {study}/{name} | {len(part)} | {sweep_s / 60:.1f} min | {decode_text} | {total / 60:.1f} min |")


if __name__ == "__main__":
    main()
