"""The report's provenance: where its numbers came from and what they cost. The run's own record (profile, target,
commit, machine, stage times, the metrics files' hashes), one row per study (its trials, the commits and code its
rows were computed at, its wall time and machine) and one per study part (`studies.STUDY.parts`, run in one go
with `kvshot repro --part`), plus the trials a profile plans that have no row yet, and the code most rows were
computed by (`main_code`; a setting computed by other code is marked `OTHER_CODE`). Also the key under which a
study's (or part's) stage time and machine are recorded (`study_key`), which the CLI writes them under.

Tables come back as DataFrames; `stages.report` writes them as markdown.
"""
from __future__ import annotations

import json

import pandas as pd

from stages.common import filter_text
from stages.results import Results, Setting
from stages.sections import ReportParams


def context_value(context: dict, key: str) -> str:
    """One item of the provenance the pipeline hands in, as text; "unknown" when it could not be read."""
    v = context.get(key)
    if v is None or v == "" or v == {}:
        return "unknown"
    if key == "wall_time_s" and isinstance(v, (int, float)):
        return f"{v:.0f} s ({v / 60:.1f} min)"
    if isinstance(v, dict):
        return ", ".join(f"{k}: {json.dumps(x) if isinstance(x, (dict, list)) else x}" for k, x in v.items())
    return str(v)


def provenance_table(context: dict, res: Results, params: ReportParams, paper_source: str) -> pd.DataFrame:
    """The run's own record: profile, target, data sizes, commit, date, machine and wall times (the context's),
    the studies configured, how the intervals were drawn, the sha256 of every metrics file read, and where the
    paper's numbers come from."""
    rows = [["profile", context_value(context, "profile")], ["target", context_value(context, "target")],
            ["data sizes", context_value(context, "data_sizes")], ["git commit", context_value(context, "git_commit")],
            ["date", context_value(context, "date")], ["hardware", context_value(context, "hardware")],
            ["total wall time", context_value(context, "wall_time_s")]]
    if context.get("regenerated"):   # `kvshot study-results`: written elsewhere than its rows were measured
        rows.insert(3, ["report", "regenerated from committed metrics (`kvshot study-results`): the commit, date "
                                  "and hardware below are the regeneration's; each study's machine is in the "
                                  "per-study table"])
    if isinstance(context.get("stage_times_s"), dict) and context["stage_times_s"]:
        rows.append(["stage wall times", _stage_times(context["stage_times_s"])])
    rows += [["studies configured", ", ".join(res.configured) or "unknown"],
             ["intervals", f"{round(params.level * 100)}% percentile bootstrap, {params.bootstrap_draws} draws, "
                           "seeded"],
             *[[f"input `{p}`", f"sha256 {h}"] for p, h in res.inputs],
             ["paper numbers", " ".join(str(paper_source).split())]]
    return pd.DataFrame(rows, columns=["item", "value"])


def _stage_times(times: dict) -> str:
    return ", ".join(f"{k} {v:.0f} s" if isinstance(v, (int, float)) else f"{k} {v}" for k, v in sorted(times.items()))


def study_key(command: str, study: str, parts: dict | None = None) -> str:
    """The stage record key of `command` (sweep, e2e) for `study`, or for a part of it run with `--only`
    (parts: resolved KEY -> values): `sweep:STUDY --only KEY=V1,V2`."""
    only = sorted((parts or {}).items())
    return f"{command}:{study}" + "".join(f" --only {k}={','.join(map(str, vs))}" for k, vs in only)


def study_entries(record: dict, command: str, study: str) -> list:
    """What a stage record (timings, machines) holds for `command` (sweep, e2e) of `study`: its whole run's entry
    and those of its parts (`sweep:STUDY --only KEY=V`, run in one workspace one after the other)."""
    key = study_key(command, study)
    return [v for k, v in record.items() if k == key or k.startswith(key + " --only ")]


def study_time(times: dict, command: str, study: str) -> float | None:
    """Seconds `command` took for `study`, its parts summed; None when none is recorded."""
    parts = [v for v in study_entries(times, command, study) if isinstance(v, (int, float))]
    return round(sum(parts), 1) if parts else None


def study_provenance(res: Results, context: dict) -> pd.DataFrame:
    """Per study: trials, the commits its rows came from, its wall time (the sweep command's, else the sum of its
    trials' own), the time its end-to-end decoding took (when it decoded alone) and the machine its sweep ran on
    (studies combined from several workspaces ran on several)."""
    times = context.get("stage_times_s") if isinstance(context.get("stage_times_s"), dict) else {}
    machines = context.get("stage_machines") if isinstance(context.get("stage_machines"), dict) else {}
    records = []
    for name in res.names:
        rows = res.raw.get(name)
        if rows is None:
            continue
        commits = sorted({str(r.get("git_commit")) for r in rows if r.get("git_commit")})
        wall = study_time(times, "sweep", name)
        trained = [r.get("wall_s") for r in rows if isinstance(r.get("wall_s"), (int, float)) and not r.get("cached")
                   and not r.get("reused_from")]
        wall_text = f"{wall / 60:.1f} min (sweep)" if isinstance(wall, (int, float)) else \
            f"{sum(trained) / 60:.1f} min (sum of trials)" if trained else "unknown"
        decoding = study_time(times, "e2e", name)
        codes = sorted({str(r.get("code"))[:12] for r in rows if r.get("code")})
        records.append({"study": name, "trials": str(len(rows)), "commits": ", ".join(commits) or "unknown",
                        "code": ", ".join(codes) + (f" ({sum(not r.get('code') for r in rows)} rows not recorded)"
                                                     if codes and not all(r.get("code") for r in rows) else "")
                        or "not recorded",
                        "wall time": wall_text,
                        "end to end": f"{decoding / 60:.1f} min" if isinstance(decoding, (int, float)) else "–",
                        "machine": "; ".join(sorted(set(map(str, study_entries(machines, "sweep", name)))))
                        or "not recorded"})
    return pd.DataFrame.from_records(records, columns=["study", "trials", "commits", "code", "wall time",
                                                       "end to end", "machine"])


def planned_not_run(context: dict, measured: set[str] | None = None) -> dict[str, dict[str, str]]:
    """Per study (that has metrics, when `measured` names those): the trials the profile plans for which no row of
    their settings exists yet (the parts' `missing` trials, `pipeline.budget`), each with the part that runs it
    (`(whole)` for a study without parts)."""
    replayed = context.get("parts_replayed") if isinstance(context.get("parts_replayed"), dict) else {}
    out: dict[str, dict[str, str]] = {}
    for key, got in replayed.items():
        study, _, part = key.partition("/")
        wanted = isinstance(got, dict) and (measured is None or study in measured)
        for trial in (got.get("missing") or []) if wanted else []:
            out.setdefault(study, {}).setdefault(str(trial), part)
    return out


PROVISIONAL = "provisional"


def waiting_studies(reads: dict[str, tuple[str, ...]], pending: dict[str, dict[str, str]]) -> dict[str, list[str]]:
    """Per claim, the studies it reads (`reads`) that hold planned trials without rows yet (`planned_not_run`)."""
    return {claim: [s for s in studies if s in pending] for claim, studies in reads.items()}


def provisional_note(waiting: dict[str, list[str]], pending: dict[str, dict[str, str]]) -> str:
    """The findings' sentence on provisional verdicts: per waiting study its trials not run yet and its claims."""
    studies = sorted({s for names in waiting.values() for s in names})
    return (f"**{PROVISIONAL.capitalize()}**: a verdict that reads a study whose plan holds trials without rows yet; "
            "it may change when they run. "
            + "; ".join(f"{s}: {len(pending[s])} planned trials not run yet, read by "
                        f"{', '.join(c for c, names in waiting.items() if s in names)}" for s in studies)
            + " (each trial and the part that runs it: *Failed and missing trials*).")


def not_run_yet(context: dict, measured: set[str]) -> list[list[str]]:
    """One problem row per planned trial without a row yet (`planned_not_run`), naming the part that runs it."""
    out = []
    for study, trials in planned_not_run(context, measured).items():
        for trial, part in trials.items():
            where = f"`kvshot repro --part {study}/{part}`" if part != "(whole)" else f"`kvshot repro --part {study}`"
            out.append([study, trial, "–", "not run yet", f"planned by the profile; {where} runs it"])
    return out


def _replayed_text(got: dict) -> str:
    """A part's trials replayed as one sweep: measured, or with the trials that have no row yet estimated from
    the paces of their drafter settings (`pipeline.budget.estimated_seconds`)."""
    if isinstance(got.get("replayed_s"), (int, float)):
        return f"{got['replayed_s'] / 60:.1f} min"
    if isinstance(got.get("estimated_s"), (int, float)):
        n = len(got.get("estimated") or [])
        return f"about {got['estimated_s'] / 60:.0f} min ({n} of {got.get('trials', '?')} trials not run yet, " \
               f"estimated from paces)"
    return "–"


DATA_STAGE_NAMES = ("prepare", "regenerate", "features")   # their times, in order of running


def _data_stages_s(context: dict) -> float | None:
    """The data stages' wall time as the workspace last ran them (None unless all three are recorded)."""
    times = context.get("stage_times_s") if isinstance(context.get("stage_times_s"), dict) else {}
    found = [times.get(s) for s in DATA_STAGE_NAMES]
    return sum(found) if all(isinstance(t, (int, float)) for t in found) else None


def _within_budget(run: dict, budget_min: float, fresh_data: float | None) -> str:
    """Whether a part's run in one go fits the budget from a fresh workspace: as it ran when it ran from one; a run
    where the data stages were already there with their time as recorded in its place; never for a resumed run."""
    wall = run["wall_s"] / 60
    if run.get("begun_before"):
        return "– (resumed)"
    if run.get("fresh"):
        return "yes" if wall <= budget_min else "no"
    if fresh_data is None:
        return "– (not from a fresh workspace)"
    total = wall + (fresh_data - float(run.get("data_stages_s") or 0)) / 60
    return f"{'yes' if total <= budget_min else 'no'} ({total:.0f} min with the data stages as recorded)"


def parts_provenance(context: dict, budget_min: float | None) -> pd.DataFrame:
    """Per study part (`studies.STUDY.parts`; a study without parts is one, `(whole)`): its filter, its trials'
    measured times replayed as one sweep (`parts_replayed`) and, when it ran in one go (`kvshot repro --part`),
    that run's wall time, the data stages' share, whether the workspace was fresh, and where and at which
    commit."""
    parts = context.get("study_parts") if isinstance(context.get("study_parts"), dict) else {}
    runs = context.get("parts_run") if isinstance(context.get("parts_run"), dict) else {}
    replayed = context.get("parts_replayed") if isinstance(context.get("parts_replayed"), dict) else {}
    if not parts:
        return pd.DataFrame()
    named_parts = {study: parts.get(study) or {"(whole)": {}} for study in context.get("studies") or parts}
    fresh_data = _data_stages_s(context)
    records = []
    for study, named in named_parts.items():
        for name, only in named.items():
            run = runs.get(f"{study}/{name}")
            got = replayed.get(f"{study}/{name}") or {}
            row = {"study": study, "part": name,
                   "filter": filter_text(only or {}) or "–",
                   "trials": str(got.get("trials", "–")),
                   "trials' times replayed": _replayed_text(got)}
            if isinstance(run, dict) and isinstance(run.get("wall_s"), (int, float)):
                wall, data = run["wall_s"] / 60, float(run.get("data_stages_s") or 0) / 60
                before = run.get("begun_before") or 0      # a run resumed after an interruption
                row.update({"wall time (one go)": f"{wall:.1f} min" + (f" ({before} of its trials begun before)"
                                                                        if before else ""),
                            "data stages": f"{data:.1f} min" + (", fresh workspace" if run.get("fresh") else
                                                                ", already there"),
                            "commit": str(run.get("commit", "unknown")), "machine": str(run.get("machine", "unknown"))})
                if budget_min is not None:
                    row["within budget"] = _within_budget(run, budget_min, fresh_data)
            else:
                row.update({"wall time (one go)": "not run in one go", "data stages": "–", "commit": "–",
                            "machine": "–"})
                if budget_min is not None:
                    row["within budget"] = "–"
            records.append(row)
    return pd.DataFrame.from_records(records)


# -- which code computed the rows ----------------------------------------------------------------------------------

OTHER_CODE = "‡"     # marks a setting whose rows were computed by other code than the rest of the report's


def main_code(studies: dict[str, list[Setting] | None]) -> str | None:
    """The code hash most of the report's trials were computed by (None: no row records one)."""
    counts: dict[str, int] = {}
    for settings in studies.values():
        for s in settings or []:
            for c in s.codes:
                counts[c] = counts.get(c, 0) + s.n
    return max(sorted(counts), key=counts.get) if counts else None


def on_other_code(s: Setting, main: str | None) -> bool:
    return main is not None and bool(s.codes) and s.codes != [main]


__all__ = ["OTHER_CODE", "context_value", "main_code", "not_run_yet", "on_other_code", "parts_provenance",
           "provenance_table", "study_entries", "study_key", "study_provenance", "study_time"]
