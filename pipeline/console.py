"""The sweep's rich tables on the console: the plan (`--dry-run`), the parts of a study, and the end-of-sweep
summary. Tables print at their natural width when the output is not a terminal, so logs never fold them.
"""
from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from pipeline.config import lookup
from pipeline.cost import estimated_cost, plan_estimate, replay, schedule_order
from pipeline.plan import ADHOC, VARIANT, varying_keys
from pipeline.result import SweepResult
from pipeline.standalone import fingerprint_trials
from pipeline.trial import Trial, cached_result, finished_elsewhere
from stages.common import Paths, duration, filter_text


def _short(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def _print_table(console: Console, table: Table) -> None:
    """Print at the table's natural width when the output is not a terminal (logs, pipes), so nothing folds."""
    from rich.measure import Measurement

    natural = Measurement.get(console, console.options.update_width(1000), table).maximum
    if console.is_terminal or natural <= console.width:
        console.print(table)
        return
    saved = console._width   # rich caps print(width=) at the console width, so widen the console briefly
    console.width = natural
    try:
        console.print(table)
    finally:
        console._width = saved


def _name_columns(table: Table, trials: list[Trial]) -> None:
    """Trial and variant columns wide enough that names never wrap (other columns give way)."""
    table.add_column("trial", style="bold", no_wrap=True, min_width=max((len(t.name) for t in trials), default=5))
    table.add_column("variant", no_wrap=True, min_width=max((len(t.variant) for t in trials), default=7))


def show_plan(trials: list[Trial], console: Console | None = None, paths: Paths | None = None) -> Table:
    """Render the planned trials as a rich table (the varying keys plus key settings); runs nothing.

    With `paths`, a status column says which trials are already done (same fingerprint: in this study, or in
    another that the sweep adopts it from) and would be skipped, and a line estimates the training left from the
    pace of the plan's finished trials (`time_left`).
    """
    console = console or Console()
    keys = varying_keys(trials)
    study = trials[0].study if trials else ADHOC
    table = Table(title=f"sweep {study}: {len(trials)} trials", title_justify="left")
    table.add_column("#", justify="right")
    _name_columns(table, trials)
    shown = [k for k in keys if k != VARIANT]
    for k in shown:
        table.add_column(_short(k), overflow="fold")
    settings = {"train.scale": "scale", "train.seed": "seed", "train.epochs": "epochs",
                "drafter.draft_vocab_size": "vocab"}
    settings = {k: v for k, v in settings.items() if k not in shown}
    for col in settings.values():
        table.add_column(col)
    table.add_column("after", overflow="fold")
    took: dict[str, float] = {}
    if paths is not None:
        fingerprint_trials(trials, paths)
        table.add_column("status")
    for i, t in enumerate(trials, 1):
        flat = {k: lookup(t.config, k) for k in settings}
        cells = [str(i), t.name, t.config.drafter.variant]
        cells += [str(t.values.get(k, "·")) for k in shown]
        cells += [f"{v:g}" if isinstance(v, float) else str(v) for v in flat.values()]
        cells.append(t.depends_on or "")
        if paths is not None:
            cells.append(_status(t, paths, took))
        table.add_row(*cells)
    _print_table(console, table)
    if paths is not None:
        console.print(plan_estimate(trials, took, trials[0].config.ray.max_concurrent if trials else 1), soft_wrap=True)
    return table


def _status(t: Trial, paths: Paths, took: dict[str, float]) -> str:
    """A trial's status cell: done (in this study, or in another that the sweep adopts it from) or to run; the
    seconds a finished one took go into `took`."""
    row = cached_result(t, paths)
    elsewhere = None if row else finished_elsewhere(t, paths)
    if elsewhere:
        row = elsewhere[1]
    if row is not None and isinstance(row.get("wall_s"), (int, float)):
        took[t.name] = float(row["wall_s"])
    if elsewhere:
        return f"done in {elsewhere[0].parent.name}/{elsewhere[0].name}"
    return "done" if row else "to run"


def show_parts(parts: dict[str, list[Trial]], console: Console, paths: Paths) -> Table:
    """The parts of a study (`--dry-run` without --part): each one's filter, trials, how many are left to train
    and the training time they would take at the pace of the plan's finished trials."""
    every = {t.name: t for ts in parts.values() for t in ts}
    fingerprint_trials(list(every.values()), paths)
    took = {}
    for name, t in every.items():
        row = cached_result(t, paths) or (finished_elsewhere(t, paths) or (None, None))[1]
        if row is not None and isinstance(row.get("wall_s"), (int, float)):
            took[name] = float(row["wall_s"])
    first = next(iter(every.values()), None)
    slots = first.config.ray.max_concurrent if first else 1
    table = Table(title=f"parts of {first.study if first else ADHOC} (`kvshot repro --part STUDY/PART` runs one "
                  "from a fresh workspace)", title_justify="left")
    for col in ("part", "filter", "trials", "to train", "training left", "its trials' times replayed"):
        table.add_column(col, overflow="fold")
    spent = sum(estimated_cost(every[n]) for n in took)
    rate = sum(took.values()) / spent if spent > 0 else None   # seconds per unit of work, as measured
    for name, trials in parts.items():
        spec = first.config.studies[first.study].parts[name] if first else {}
        todo = [t for t in trials if t.name not in took]
        left = "–" if not todo else "unknown" if rate is None else duration(rate * max(
            sum(estimated_cost(t) for t in todo) / min(slots, len(todo)),
            max(schedule_order(todo).values())))   # never under its longest chain of parent and child
        replayed = "–" if todo else duration(replay(trials, took, slots))
        table.add_row(name, filter_text(spec), str(len(trials)), str(len(todo)), left, replayed)
    _print_table(console, table)
    return table


def _fmt(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, (int, float)) and not isinstance(v, bool) else "–"


def show_summary(result: SweepResult, trials: list[Trial], console: Console | None = None) -> Table:
    """The end-of-sweep table: the values that vary, acc_0, acc_6, step MAT, chain α_6 and MAT, status, time."""
    console = console or Console()
    keys = [k for k in varying_keys(trials) if k != VARIANT]
    table = Table(title=f"sweep {result.study}: {len(result.ran)} ran, {len(result.skipped)} reused, "
                        f"{result.failed} failed", title_justify="left")
    _name_columns(table, trials)
    for k in keys:
        table.add_column(_short(k), overflow="fold")
    for col in ("acc_0", "acc_6", "step MAT", "α_6 (chain)", "chain MAT", "status", "wall s"):
        table.add_column(col, justify="left" if col == "status" else "right")
    by_name = {t.name: t for t in trials}
    errors = []
    for row in result.rows:
        t = by_name[row["trial"]]
        alpha, acc = row.get("alpha") or [], row.get("acc") or []
        status = row.get("status", "?")
        if status == "ok" and row.get("cached"):
            status = "reused"
        elif status != "ok":
            errors.append(f"[red]{t.name}[/]: {row.get('error', '')}")
            status = f"[red]{status}[/]"
        table.add_row(t.name, t.variant, *[str(t.values.get(k, "·")) for k in keys],
                      _fmt(acc[0] if acc else None), _fmt(acc[6] if len(acc) > 6 else None), _fmt(row.get("step_mat")),
                      _fmt(alpha[6] if len(alpha) > 6 else None), _fmt(row.get("chain_mat", row.get("mat"))), status,
                      f"{row['wall_s']:.1f}" if isinstance(row.get("wall_s"), (int, float)) else "–")
    _print_table(console, table)
    for line in errors:
        console.print(line, highlight=False)
    return table
