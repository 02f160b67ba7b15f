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

from pipeline.budget import rows_in, training_left_s
from pipeline.choices import chosen_keys
from pipeline.config import ROOT, Config, ConfigError, check_hardware
from pipeline.conversations import results_folder
from pipeline.dvc_workspace import done_part, repro_data_stages, repro_part, workspace
from pipeline.machine import hardware
from pipeline.parts import WHOLE, check_parts, decodes_any, part_filter, plan_part
from pipeline.plan import plan
from pipeline.sweep import check_chosen, finished_rows_in
from pipeline.trial import Trial, begun
from stages.common import Paths, duration


@dataclass
class PartState:
    """Where a part stands in the workspace: its trials (with the parents and controls they need), whether the
    study decodes some of them, how many are finished (same fingerprint, in this study or adopted from another),
    begun here (a run directory of their fingerprint: what a run of the part resumes) and begun but not finished,
    its record when done (`done_part`), why it cannot start yet (a value its validation study has not
    chosen), and the training it has left at the paces measured so far (`budget.training_left_s`; None: unknown)."""
    study: str
    part: str
    trials: list[Trial]
    decode: bool
    finished: int
    begun: int
    in_progress: int
    done: dict | None
    waits: str | None
    left_s: float | None = None
    by_earlier: int = 0      # trials left that the parts run before it train (`part_state(ahead=)`)

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
        left = (f"; about {duration(self.left_s)} of training left at the paces measured so far"
                if self.left_s else "")
        if self.by_earlier:
            left += f"; {self.by_earlier} trained by the parts before it"
        if not self.finished and not self.in_progress:
            return f"part {self.name}: not begun ({n} trials{', decoded' if self.decode else ''}){left}"
        more = f", {self.in_progress} more begun" if self.in_progress else ""
        then = "; then decoded" if self.decode else ""
        return f"part {self.name}: {self.finished} of {n} trials finished{more}{left}{then}"


def part_state(cfg: Config, profile: str, study: str, part: str, rows: list[dict] | None = None,
               ahead: set[str] | None = None) -> PartState:
    """The state of one part (`expand_parts` gives the names) in the profile's workspace; reads only. With `rows`
    (`measured_rows`: what `--dry-run` shows) also the training it has left at their paces; `ahead`: the
    fingerprints of the trials that parts run before this one will train (they are adopted here, so its training
    left leaves them out), to which the part's own trials left are added."""
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
    left, by_earlier = None, 0
    if done is None and rows is not None:
        unfinished = [t for t in mine if t.name not in finished]
        # a workspace not made yet fingerprints nothing: no trial can be told to be another part's then
        todo = [t for t in unfinished if not t.fingerprint or t.fingerprint not in (ahead or set())]
        left, by_earlier = training_left_s(cfg, todo, rows, hardware()), len(unfinished) - len(todo)
        if ahead is not None:
            ahead.update(t.fingerprint for t in todo if t.fingerprint)
    return PartState(study, part, mine, decode, len(finished), len(started),
                     sum(name not in finished for name in started), done, waits, left, by_earlier)


def measured_rows(cfg: Config, profile: str) -> list[dict]:
    """The rows whose paces estimate the training parts have left: the profile's workspace's and its committed
    results folder's."""
    return rows_in(_paths(profile).root / "metrics" / "stepwise", results_folder(cfg) / "metrics" / "stepwise")


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
