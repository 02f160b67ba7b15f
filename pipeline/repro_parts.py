"""`kvshot repro --part`: a profile's study parts run one after another in its workspace, each in one go, those
done there skipped, so a study of many parts runs across interruptions with one command that is run again.

    for study, part in expand_parts(cfg, ["all"]):
        state = part_state(cfg, "study", study, part)        # its trials, what of it is finished, begun, done
        print(state.line())                                  # `--dry-run`
        run_part(cfg, "study", state, echo=print)            # nothing when done
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.choices import chosen_keys
from pipeline.config import ROOT, Config, ConfigError, check_hardware
from pipeline.conversations import results_folder
from pipeline.dvc_workspace import done_part, repro_data_stages, repro_part, workspace
from pipeline.parts import WHOLE, check_parts, decodes_any, part_filter, plan_part
from pipeline.plan import plan
from pipeline.sweep import check_chosen, finished_rows_in
from pipeline.trial import Trial, begun
from stages.common import Paths


@dataclass
class PartState:
    """Where a part stands in the workspace: its trials (with the parents and controls they need), whether the
    study decodes some of them, how many are finished (same fingerprint, in this study or adopted from another),
    begun here (a run directory of their fingerprint: what a run of the part resumes) and begun but not finished,
    its record when done (`done_part`), and why it cannot start yet (a value its validation study has not
    chosen)."""
    study: str
    part: str
    trials: list[Trial]
    decode: bool
    finished: int
    begun: int
    in_progress: int
    done: dict | None
    waits: str | None

    @property
    def name(self) -> str:
        return f"{self.study}/{self.part}"

    def line(self) -> str:
        n = len(self.trials)
        if self.done is not None:
            took, before = self.done.get("wall_s", 0) / 60, self.done.get("begun_before")
            # a run resumed after an interruption timed its last sitting only, not the whole part
            day = self.done.get("date", "?")
            when = (f"{took:.1f} min on {day} in its last sitting, {before} of its trials begun before" if before
                    else f"{took:.1f} min in one go on {day}")
            return (f"part {self.name}: done in this workspace ({n} trials finished{', decoded' if self.decode else ''}"
                    f"; {when})")
        if self.waits:
            return f"part {self.name}: waits ({self.waits})"
        if not self.finished and not self.in_progress:
            return f"part {self.name}: not begun ({n} trials{', decoded' if self.decode else ''})"
        more = f", {self.in_progress} more begun" if self.in_progress else ""
        then = "; then decoded" if self.decode else ""
        return f"part {self.name}: {self.finished} of {n} trials finished{more}{then}"


def part_state(cfg: Config, profile: str, study: str, part: str) -> PartState:
    """The state of one part (`expand_parts` gives the names) in the profile's workspace; reads only."""
    ws = _paths(profile)
    rows_of = finished_rows_in(ws, results_folder(cfg))
    trials = plan(cfg, {}, study, rows_of=rows_of)
    check_parts(trials, cfg, study)
    mine = trials if part == WHOLE else plan_part(trials, part_filter(cfg, study, part))
    try:
        check_chosen(mine, cfg)
        waits = None
    except ConfigError as e:
        waits = str(e)
        if checks_committed_first(cfg, study, ws):
            waits += (f"; or the rows of it committed in {results_folder(cfg)}, checked against this workspace's "
                      "conversations once its data stages have run (the part runs them first)")
    decode = decodes_any(cfg, study, mine)
    here = ws.root.is_dir()
    finished = rows_of(mine) if here else {}
    started = [t.name for t in mine if here and begun(t, ws)]
    done = done_part(ws.root, study, part, mine, finished, decode)
    return PartState(study, part, mine, decode, len(finished), len(started),
                     sum(name not in finished for name in started), done, waits)


def run_part(cfg: Config, profile: str, state: PartState, echo=lambda line: None,
             committed_answers: bool = True) -> int:
    """Run a part in one go unless it is done (its recorded time kept); a part whose validation study has not
    chosen its values yet is a one-line error before the data stages. Returns the first nonzero exit code."""
    if state.done is not None:
        echo(state.line() + "; nothing to run")
        return 0
    first = bool(state.waits) and checks_committed_first(cfg, state.study, _paths(profile))
    if state.waits and not first:
        raise ConfigError(state.waits)
    check_hardware(cfg)
    if first:
        echo(f"part {state.name}: its values wait for a validation study; the data stages first, then the "
             f"validation rows committed in {results_folder(cfg)} are checked against this workspace's conversations")
        code = repro_data_stages(cfg, profile, echo=echo, committed_answers=committed_answers)
        if code:
            return code
        state = part_state(cfg, profile, state.study, state.part)
        if state.waits:
            raise ConfigError(state.waits)
    return repro_part(cfg, profile, state.study, state.part, state.decode, echo=echo, begun_before=state.begun,
                      committed_answers=committed_answers)


def checks_committed_first(cfg: Config, study: str, ws: Paths) -> bool:
    """Whether a part of `study` waiting for a validation study can only tell after the data stages: the workspace
    has no feature cache yet (so no conversations to check rows against) and the profile's results folder holds
    rows of that validation study (`pipeline.choices.committed_rows`)."""
    if (Path(ws.root) / "data" / "features").exists():
        return False
    stepwise = results_folder(cfg) / "metrics" / "stepwise"
    return any((stepwise / f"{by}.json").is_file() for by in chosen_keys(cfg, study).values())


def _paths(profile: str) -> Paths:
    return Paths(ROOT if profile == "default" else workspace(profile))
