"""What each part of a profile's studies would take in one go from a fresh workspace, from the committed rows'
measured trial times: the part's trials replayed as one sweep (`pipeline.cost.replay`: `ray.max_concurrent` at a
time, in dependency waves as the executor runs them, in the sweep's own order; beside it the same with each child
started right after its parent, i.e. what the waves cost), plus the data stages (without regenerate where the
results folder holds the target's committed answers, which a fresh workspace reuses) and the part's end-to-end
decoding as the results folder's stage times record them; beside it, the part's wall time when it ran in one go
(`kvshot repro --part`, the folder's parts.json). A study without parts is one part. A trial without a row yet
is estimated from the paces of its drafter setting's rows (`pipeline.budget.estimated_seconds`), and says so.

    python benchmarks/study_parts.py                       # the study profile against results/study/
    python benchmarks/study_parts.py --profile study --results results/study
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.budget import replayed_parts  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from stages.report_provenance import DATA_STAGE_NAMES, study_key  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="study")
    ap.add_argument("--results", type=Path, default=Path("results/study"))
    args = ap.parse_args()
    cfg = load_config(args.profile)
    times = json.loads((args.results / "timings.json").read_text())
    # a fresh workspace seeded from the committed answers (pipeline.conversations) reuses them: its regenerate
    # stage asks the target for nothing, so the regenerate time recorded when they were generated is not counted
    seeded = any((args.results / "conversations").glob("*.jsonl.gz"))
    counted = [k for k in DATA_STAGE_NAMES if not (seeded and k == "regenerate")]
    data_s = sum(times.get(k, 0.0) for k in counted)
    parts_file = args.results / "parts.json"
    in_one_go = json.loads(parts_file.read_text()) if parts_file.is_file() else {}
    stages = ", ".join(f"{k} {times.get(k, 0.0) / 60:.1f}" for k in DATA_STAGE_NAMES)
    print(f"data stages as recorded: {stages} min; counted per part: {' + '.join(counted)} = {data_s / 60:.1f} min"
          + (" (regenerate reuses the answers committed in conversations/)" if seeded else "")
          + f"; slots: {cfg.ray.max_concurrent}")
    print("| part | trials | sweep replayed | children right after their parent | decoding recorded "
          "| with the data stages | measured in one go |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for key, got in replayed_parts(cfg, args.results / "metrics" / "stepwise").items():
        if "replayed_s" not in got and "estimated_s" not in got:
            print(f"| {key} | {got['trials']} | not measured: {', '.join(got['missing'])} | | | | |")
            continue
        estimated = "replayed_s" not in got
        sweep_s = got["estimated_s"] if estimated else got["replayed_s"]
        study, _, name = key.partition("/")
        only = cfg.studies[study].parts.get(name)
        decode = times.get(study_key("e2e", study, only)) if only else times.get(f"e2e:{study}")
        recorded = got["decodes"] and isinstance(decode, (int, float))
        decode_text = "–" if not got["decodes"] else f"{decode / 60:.1f} min" if recorded else \
            "not recorded for this part"
        total = sweep_s + data_s + (decode if recorded else 0.0)
        run = in_one_go.get(key)
        before = f", {run['begun_before']} of its trials begun before" if run and run.get("begun_before") else ""
        measured = "–" if not run else f"{run['wall_s'] / 60:.1f} min{', fresh workspace' if run.get('fresh') else ''}" \
            f"{before} ({run.get('commit', '?')})"
        sweep_text = f"about {sweep_s / 60:.0f} min ({len(got['estimated'])} trials estimated from paces)" \
            if estimated else f"{sweep_s / 60:.1f} min"
        waves = f"{got['unwaved_s'] / 60:.1f} min ({got['unwaved_s'] / sweep_s:.2f}x)" if sweep_s else "–"
        print(f"| {key} | {got['trials']} | {sweep_text} | {waves} | {decode_text} | {'about ' if estimated else ''}"
              f"{total / 60:.1f} min | {measured} |")

if __name__ == "__main__":
    main()
