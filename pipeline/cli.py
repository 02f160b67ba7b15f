"""`kvshot`: every DAG stage alone, sweeps on Ray Tune, the whole DAG through DVC, the MLflow UI, and exports of
trained drafters to the serving engines' formats.

Every stage command takes `--profile NAME` (params.yaml of the working directory when omitted) and `key=value`
overrides (DESIGN §10); a bad key, value or input is one red line and exit code 2.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, Optional

import typer
from rich.console import Console

from pipeline.config import Config, ConfigError, check_hardware, load_config, parse_overrides
from pipeline.stopping import Stopped

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="kvshot: reproduce the KVShot drafter experiments (prepare -> ... -> report).")
console = Console(stderr=True)

ProfileOpt = typer.Option(None, "--profile", "-p", help="Profile name (profiles/NAME.yaml), 'default', or a YAML path.")
RootOpt = typer.Option(Path("."), "--root",
                       help="Workspace root holding data/, runs/, metrics/ (DVC runs stages here).")
PartOpt = typer.Option(None, "--part", help="Only this named part of the study (`studies.STUDY.parts`; `kvshot "
                       "sweep --study STUDY --dry-run` lists them).")
OverridesArg = typer.Argument(None, help="Overrides KEY=VALUE, e.g. depth=2 train.lr=1e-4 "
                                           "(`kvshot keys` lists the keys).")


def _fail(message: str) -> None:
    console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


_STATE: dict = {}


UNTIMED = object()   # returned by a command body whose run is not the stage's work (a dry run, nothing left to do)


def _user_errors() -> tuple[type[BaseException], ...]:
    """The errors that are bad input (one red line, exit 2). A TargetLoadError can only come from a command that
    imported models.target: looked up when an error is raised, so `kvshot --help` and `kvshot keys` never import
    torch to name it."""
    from stages.common import StageError

    target = sys.modules.get("models.target")
    return (ConfigError, StageError) + ((target.TargetLoadError,) if target is not None else ())


def _guarded(fn: Callable[[], object], command: str | Callable[[], str] | None = None) -> object:
    """Run a command body, turning known user-facing errors into one line and exit code 2; a stage command's
    wall time is recorded in its workspace for the report's provenance, under `command` (or the name it returns
    once the body has run)."""
    import time

    start = time.perf_counter()
    try:
        out = fn()
        if out is UNTIMED:
            return None
        if command and "root" in _STATE:
            from pipeline.provenance import record_time
            record_time(_STATE["root"], command() if callable(command) else command, time.perf_counter() - start)
        return out
    except _user_errors() as exc:
        _fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    except (KeyboardInterrupt, Stopped) as exc:
        console.print(f"[yellow]{'interrupted' if isinstance(exc, KeyboardInterrupt) else f'stopped by {exc}'}; "
                      "finished work is kept and the next run resumes from it[/]")
        raise typer.Exit(exc.exit_code if isinstance(exc, Stopped) else 130)


def stage_run(cfg: Config, stage: str, paths):
    """The MLflow run of a stage invoked alone (FINISHED or FAILED at the end); see pipeline.tracking."""
    from pipeline.tracking import stage_run as tracked
    return tracked(cfg, stage, paths)


def _setup(profile: Optional[str], overrides: Optional[list[str]], root: Path,
           check: bool = True) -> tuple[Config, "Paths"]:
    """The config and paths of a command; check=False leaves `check_hardware` (which may print a warning) to the
    caller, after it has checked its own arguments, so that bad input stays a one-line error."""
    from stages.common import Paths

    root = root.resolve()
    _STATE["root"] = root
    cfg = load_config(profile, overrides or [], root=root)
    if check:
        check_hardware(cfg)
    cache = os.environ.get("KVSHOT_MODEL_CACHE")
    return cfg, Paths(root=root, cache=Path(cache) if cache else None)


@app.command()
def prepare(overrides: Optional[list[str]] = OverridesArg, profile: Optional[str] = ProfileOpt, root: Path = RootOpt):
    """Load and clean the raw conversations -> data/prepared/<source>.jsonl."""
    def body():
        from stages import prepare as stage
        cfg, paths = _setup(profile, overrides, root)
        with stage_run(cfg, "prepare", paths) as report:
            stage.run(cfg.data, paths, report)
    _guarded(body, "prepare")


@app.command()
def regenerate(overrides: Optional[list[str]] = OverridesArg, profile: Optional[str] = ProfileOpt,
               root: Path = RootOpt):
    """Replace every assistant turn with the target's own answer -> data/regenerated/<source>.jsonl."""
    def body():
        from stages import regenerate as stage
        cfg, paths = _setup(profile, overrides, root)
        with stage_run(cfg, "regenerate", paths) as report:
            stage.run(cfg.regenerate, cfg.target, list(cfg.data.sources), paths, report)
    _guarded(body, "regenerate")


@app.command()
def features(overrides: Optional[list[str]] = OverridesArg, profile: Optional[str] = ProfileOpt,
             root: Path = RootOpt):
    """Run the target once over the regenerated data -> data/features/<scale>/ (the offline feature cache)."""
    def body():
        from stages import features as stage
        cfg, paths = _setup(profile, overrides, root)
        with stage_run(cfg, "features", paths) as report:
            stage.run(cfg.features, cfg.target, cfg.data, paths, report)
    _guarded(body, "features")


@app.command()
def train(overrides: Optional[list[str]] = OverridesArg, profile: Optional[str] = ProfileOpt, root: Path = RootOpt,
          study: str = typer.Option("adhoc", help="Study folder under runs/.")):
    """Train one drafter for the resolved config -> runs/<study>/<trial>/."""
    def body():
        from pipeline.standalone import single_trial, train_one
        cfg, paths = _setup(profile, overrides, root)
        trial = single_trial(cfg, study)
        with stage_run(cfg, "train", paths) as report:
            train_one(trial, paths, report)
        console.print(f"trained {trial.name} -> {paths.run_dir(study, trial.name)}")
    _guarded(body, "train")


@app.command()
def evaluate(overrides: Optional[list[str]] = OverridesArg, profile: Optional[str] = ProfileOpt,
             root: Path = RootOpt,
             study: str = typer.Option("adhoc", help="Evaluate every trained drafter of this study.")):
    """Step-wise acceptance of a study's trained drafters -> metrics/stepwise/<study>.json."""
    def body():
        from pipeline.standalone import evaluate_study
        cfg, paths = _setup(profile, overrides, root)
        with stage_run(cfg, "evaluate", paths) as report:
            evaluate_study(cfg, study, paths, report)
        write_curves(paths, study)
    _guarded(body, "evaluate")


@app.command()
def e2e(overrides: Optional[list[str]] = OverridesArg, profile: Optional[str] = ProfileOpt, root: Path = RootOpt,
        study: Optional[str] = typer.Option(None, help="Decode this study's drafters only (those its `e2e` filter "
                                            "matches; all of them when it is not marked e2e)."),
        only: Optional[list[str]] = typer.Option(None, "--only", help="Decode only the drafters with these "
                                                 "settings, KEY=V1,V2 (repeatable; e.g. train.seed=1,2), as "
                                                 "`sweep --only` trains a part of a study."),
        part: Optional[str] = PartOpt):
    """Tree speculative decoding with the trained drafters -> metrics/e2e.json."""
    def body():
        import json

        from pipeline.plan_file import decoded_runs
        from stages import e2e as stage
        cfg, paths = _setup(profile, overrides, root, check=False)
        if study is not None and study not in cfg.studies:
            _fail(f"--study {study}: not a study of this profile (it has {', '.join(cfg.studies) or 'none'})")
        wanted.update(_part_or_only(cfg, study, part, only))
        check_hardware(cfg)
        run_dirs = decoded_runs(cfg, paths, study, wanted)
        if wanted and not run_dirs:
            what = f"--part {part}" if part else f"--only {' --only '.join(only or [])}"
            _fail(f"{what}: no trained drafter of "
                  f"{'study ' + study if study else 'the studies marked e2e'} has these settings")
        studies.update(Path(d).parent.name for d in run_dirs)
        # decoding some drafters (a study, a part) keeps the rows of the others decoded before in this workspace
        with stage_run(cfg, "e2e", paths) as report:
            rows = stage.run(cfg.e2e, run_dirs, paths, report, target=cfg.target,
                             keep_others=study is not None or bool(wanted))
        write_e2e_summary(paths, json.loads(paths.e2e_metrics.read_text()))
        _print_e2e(rows)
    studies: set[str] = set()
    wanted: dict = {}

    def timed_as() -> str:
        """Timed per study (e2e:scale), a part under its filter's key (e2e:scale --only KEY=V), so the decodings
        of a study run in parts add up like its sweeps."""
        from stages.report_provenance import study_key
        return study_key("e2e", "+".join(sorted(studies)), wanted) if studies else "e2e"
    _guarded(body, timed_as)


def _print_e2e(rows: list[dict]) -> None:
    """What the e2e stage measured, one line per drafter and tree, then the baselines of the same run."""
    from rich.table import Table

    from stages.report import e2e_baselines

    table = Table(title="e2e: lossless tree speculative decoding",
                  caption="speedup: over plain greedy generate in the same run")
    for col in ("drafter", "tree", "kind", "τ", "tokens/s", "speedup", "drafting", "exact", "lossless"):
        table.add_column(col, justify="left" if col in ("drafter", "kind") else "right")
    for r in rows:
        table.add_row(r["trial"], str(tuple(r["tree"])), r["tree_kind"], f"{r['tau']:.2f}", f"{r['tokens_per_s']:.1f}",
                      f"{r['speedup']:.2f}x", f"{r['draft_time_share']:.0%}", f"{r['exact_match']:.0%}",
                      "yes" if r["lossless"] else "NO")
    out = console if console.is_terminal else Console(stderr=True, width=120)   # logs: no 80-column squeeze
    out.print(table)
    out.print(e2e_baselines(rows), highlight=False, soft_wrap=True)


@app.command("export")
def export_cmd(run_dir: Path = typer.Argument(..., help="A finished run directory, e.g. runs/scale/eagle3-small."),
               fmt: str = typer.Option(..., "--format", "-f", help="eagle3 (SGLang/vLLM EAGLE-3 directory) or "
                                       "speculators (vllm serve DIR)."),
               out: Path = typer.Option(..., "--out", "-o", help="Directory to write (must not exist or be empty)."),
               verifier: Optional[str] = typer.Option(None, "--verifier", help="The target's name, or a local model "
                                                      "directory (read, and named by its path), as the engine should "
                                                      "load it (default: the run's target)."),
               save_verifier: Optional[Path] = typer.Option(None, "--save-verifier", help="Write the run's target "
                                                            "there as a Hugging Face model directory (the embedded "
                                                            "GGUF dequantized; reused if present) and name it as the "
                                                            "verifier, so engines serve the export offline."),
               dtype: Optional[str] = typer.Option(None, "--dtype", help="Weights and torch_dtype: float32, bfloat16 "
                                                   "or float16 (default: the target's dtype)."),
               speculative_tokens: Optional[int] = typer.Option(None, "--speculative-tokens", help="Draft tokens per "
                                                                "step the export proposes (default: what the run's "
                                                                "measured acceptance supports, else 3)."),
               force: bool = typer.Option(False, "--force", help="Replace an existing export in --out."),
               root: Path = RootOpt):
    """Export a trained EAGLE-3 drafter to a serving engine's format (with a README card)."""
    def body():
        from stages import export as stage
        from stages import export_verifier
        from stages.common import Paths, StageError

        if verifier and save_verifier:
            raise StageError("--verifier and --save-verifier: give one (the verifier to name, or where to write it)")
        if speculative_tokens is not None and speculative_tokens < 1:
            raise StageError(f"--speculative-tokens {speculative_tokens}: expected a positive number of draft tokens")
        cache = os.environ.get("KVSHOT_MODEL_CACHE")
        paths = Paths(root=root.resolve(), cache=Path(cache) if cache else None)
        config = stage.check_run(run_dir, fmt, dtype, out, force)   # bad input fails before the target is read
        params = stage.run_target(config, run_dir)
        target = export_verifier.save_verifier(params, paths, save_verifier) if save_verifier else \
            export_verifier.load_verifier(params, paths, verifier)
        done = stage.export(run_dir, fmt, out, target, dtype=dtype, overwrite=force,
                            num_speculative_tokens=speculative_tokens)
        for line in done.warnings:
            console.print(f"[yellow]warning:[/] {line}", highlight=False, soft_wrap=True)
        console.print(f"exported {run_dir} -> {done.out} ({fmt} format, {done.dtype}, {done.speculative_tokens} "
                      f"speculative tokens; verifier {target.name_or_path}: {', '.join(done.files)})",
                      highlight=False, soft_wrap=True)
    _guarded(body)


@app.command()
def report(overrides: Optional[list[str]] = OverridesArg, profile: Optional[str] = ProfileOpt, root: Path = RootOpt):
    """Paper-style tables, figures and findings -> reports/README.md, reports/figures/."""
    def body():
        from pipeline.provenance import provenance
        from stages import report as stage
        cfg, paths = _setup(profile, overrides, root)
        with stage_run(cfg, "report", paths) as report:
            stage.run(cfg.report, provenance(cfg, paths), paths, report)
        console.print(f"wrote {paths.reports / 'README.md'}")
    _guarded(body, "report")


@app.command("study-results")
def study_results(workspace: Path = typer.Argument(..., help="A study workspace, e.g. scratch/workspaces/study."),
                  into: Path = typer.Option(Path("results/study"), "--into", help="The committed results folder."),
                  profile: str = typer.Option("study", "--profile", "-p", help="The profile the studies ran.")):
    """Fold a workspace's finished studies into the committed results folder (its other studies kept) and
    regenerate the report there from the merged metrics alone."""
    def body():
        import tempfile

        from pipeline import study_results as merge
        from pipeline.provenance import provenance
        from stages import report as stage
        from stages.common import Paths

        with tempfile.TemporaryDirectory(prefix="kvshot-study-results-") as tmp:
            merged = merge.merge(workspace, into, Path(tmp) / "root")
            cfg = load_config(profile, [], root=merged.root)
            paths = Paths(root=merged.root)
            stage.run(cfg.report, {**provenance(cfg, paths), "regenerated": True}, paths, lambda metrics: None)
            answers = merge.install(merged.root, workspace, into)
        kept = f"; kept as committed: {', '.join(merged.kept)}" if merged.kept else ""
        kept += (f"; combined with their committed rows on the same conversations: {', '.join(merged.combined)}"
                 if merged.combined else "")
        kept += (f"; begun there without a finished trial, so left as committed: {', '.join(merged.unfinished)}"
                 if merged.unfinished else "")
        kept += "".join(f"; {n} committed row{'s' if n > 1 else ''} of {study} left out (on other conversations "
                        "than the workspace's)" for study, n in merged.other_data.items())
        console.print(f"{into}: studies from {workspace}: {', '.join(merged.from_workspace)}{kept}; "
                      f"e2e: {merged.e2e}; "
                      + (f"the target's answers of {', '.join(answers)} committed (later parts start from them); "
                         if answers else "") + "report regenerated", highlight=False, soft_wrap=True)
    _guarded(body)


@app.command()
def sweep(overrides: Optional[list[str]] = OverridesArg, profile: Optional[str] = ProfileOpt, root: Path = RootOpt,
          study: Optional[str] = typer.Option(None, help="Run this study of the profile (or name an ad-hoc sweep)."),
          dry_run: bool = typer.Option(False, "--dry-run", help="Show the grid of resolved trials, which are done "
                                       "already, and the training time left; run nothing."),
          only: Optional[list[str]] = typer.Option(None, "--only", help="Run the part of the plan with these "
                                                   "settings, KEY=V1,V2 (repeatable; e.g. train.scale=small), with "
                                                   "the parents and controls it needs; names stay the whole plan's."),
          part: Optional[str] = PartOpt):
    """Run a grid (KEY=V1,V2 ...) or a study on Ray Tune: train then evaluate every trial."""
    def body():
        from pipeline.console import show_parts, show_plan
        from pipeline.parts import check_parts, plan_part
        from pipeline.plan import plan
        from pipeline.conversations import results_folder
        from pipeline.sweep import check_chosen, finished_rows_in, run_sweep
        from stages.common import Paths

        rootp = root.resolve()
        _STATE["root"] = rootp
        cfg = load_config(profile, [], root=rootp)
        axes = parse_overrides(overrides or [])
        cache = os.environ.get("KVSHOT_MODEL_CACHE")
        paths = Paths(root=rootp, cache=Path(cache) if cache else None)
        trials = plan(cfg, axes, study, rows_of=finished_rows_in(paths, results_folder(cfg)))
        parts = {} if axes else check_parts(trials, cfg, study)
        wanted.update(_part_or_only(cfg, study, part, only))
        whole = trials
        if wanted:
            trials = plan_part(trials, wanted)
        for t in trials:
            for c in t.choices:
                console.print(f"{t.name}: {c.text()}", highlight=False, soft_wrap=True)
        if dry_run:
            show_plan(trials, console=Console(), paths=paths)
            if parts and not wanted:
                show_parts(parts, Console(), paths)
            return UNTIMED
        check_chosen(trials, cfg)
        check_hardware(cfg)
        result = run_sweep(trials, paths, parts=parts, study_trials=whole if wanted else None)
        write_curves(paths, trials[0].study if trials else (study or "adhoc"))
        if result.failed:
            _fail(f"{result.failed} of {len(trials)} trials failed: {', '.join(result.failed_names)}")
        # a sweep that only adopted finished trials keeps the wall time of the one that trained them
        return None if result.ran else UNTIMED
    wanted: dict = {}

    def timed_as() -> str:
        """A part (--part, --only) is timed under its filter's key, so parts run in one workspace add up
        (stages.report_provenance)."""
        from stages.report_provenance import study_key
        return study_key("sweep", study or "adhoc", wanted)
    _guarded(body, timed_as)


def _part_or_only(cfg: Config, study: Optional[str], part: Optional[str], only: Optional[list[str]]) -> dict:
    """The filter of `--part` (a named part of the study) or of the `--only` settings: resolved KEY -> values."""
    if part and only:
        raise ConfigError(f"--part {part} and --only {' --only '.join(only)}: give one (a part is a named --only)")
    if part:
        from pipeline.parts import part_filter
        return part_filter(cfg, study, part)
    return parse_overrides(only or [])


def write_curves(paths, study: str) -> None:
    """What DVC shows of a study: α_k/acc_k vs k as flat records (`dvc plots show`) and a per-trial summary of
    numbers (`dvc metrics show`); the stepwise file itself is a list of rows, which DVC cannot tabulate."""
    import json

    from stages.common import write_json_atomic

    src = paths.stepwise_metrics(study)
    if not src.is_file():
        return
    records, summary = [], {}
    for row in json.loads(src.read_text()):
        alpha, acc = row.get("alpha") or [], row.get("acc") or []
        for k, a in enumerate(alpha):
            records.append({"trial": row["trial"], "k": k, "alpha": a, "acc": acc[k] if k < len(acc) else None})
        numbers = {f"alpha_{k}": alpha[k] for k in (0, 3, 6) if k < len(alpha)}
        numbers.update({f"acc_{k}": acc[k] for k in (0, 3, 6) if k < len(acc)})
        numbers.update({k: row.get(k) for k in ("step_mat", "step_retention", "chain_mat", "chain_retention")})
        numbers.update(mat=row.get("mat"), retention=row.get("retention"))
        summary[row["trial"]] = {k: v for k, v in numbers.items() if v is not None}
    write_json_atomic(paths.root / "metrics" / "curves" / f"{study}.json", records)
    write_json_atomic(paths.root / "metrics" / "summary" / f"{study}.json", summary)


def write_e2e_summary(paths, rows: list[dict]) -> None:
    """`dvc metrics show` numbers of the e2e stage, one entry per drafter and tree."""
    from stages.common import write_json_atomic

    keys = ("tau", "tokens_per_s", "speedup", "draft_time_share", "exact_match")
    summary = {f"{r['trial']}@{r.get('tree_kind', 'tree')}": {**{k: r[k] for k in keys if r.get(k) is not None},
                                                              "lossless": int(bool(r.get("lossless")))}
               for r in rows if r.get("trial")}
    write_json_atomic(paths.root / "metrics" / "summary" / "e2e.json", summary)


@app.command()
def repro(profile: Optional[str] = ProfileOpt,
          force: bool = typer.Option(False, "--force", help="Re-run every stage even if up to date."),
          stage: Optional[list[str]] = typer.Option(None, "--stage", help="Only this DVC stage (e.g. study@depth) "
                                                    "and what it depends on; repeatable."),
          part: Optional[list[str]] = typer.Option(None, "--part", help="Only this part of a study, STUDY/PART "
                                                   "(`studies.STUDY.parts`): the data stages, the part's sweep and "
                                                   "its end-to-end decoding, timed as one. Repeatable, run in "
                                                   "order; STUDY: each part of it; all: each part of every study. "
                                                   "A part done in this workspace is skipped."),
          dry_run: bool = typer.Option(False, "--dry-run", help="With --part: where each part stands in the "
                                       "workspace (done, begun, waiting); run nothing."),
          fast_dev_run: bool = typer.Option(False, "--fast-dev-run", help="The same studies, parts and stages at "
                                            "the smoke profile's sizes, in fp32, in the workspace "
                                            "<profile>-fast-dev-run: the whole path in minutes before a long "
                                            "run (the numbers mean nothing)."),
          fresh_answers: bool = typer.Option(False, "--fresh-answers", help="Let the target answer every "
                                             "conversation on this machine, instead of starting a new "
                                             "workspace from the answers committed in results/<profile>/"
                                             "conversations/ (which keep a study's parts on the same "
                                             "conversations).")):
    """The whole DAG through DVC. The default profile runs in the project root; any other profile in its own
    workspace scratch/workspaces/<profile>/ (a YAML path: its file name without .yaml), whose params.yaml is the
    resolved profile (so DVC tracks it)."""
    def body():
        from pipeline.dvc_workspace import repro as run_repro
        nonlocal profile
        cfg = load_config(profile if profile not in (None, "") else "default")
        if fast_dev_run:
            from pipeline.fast_dev_run import shrink, workspace_name
            profile = workspace_name(profile)
            cfg = shrink(cfg, profile)
        # the arguments first, so bad input is one line; then the hardware check (which may warn)
        if part:
            if stage or force:
                raise ConfigError(f"--part {part[0]}: runs on its own, without --stage or --force")
            _repro_parts(cfg, profile or "default", part, dry_run, committed_answers=not fresh_answers)
            return
        if dry_run:
            raise ConfigError("--dry-run: shows where parts stand; give --part (say --part all)")
        known = {"prepare", "regenerate", "features", "e2e", "report", *(f"study@{s}" for s in cfg.studies)}
        bad = [s for s in stage or [] if s not in known]
        if bad:
            raise ConfigError(f"--stage {bad[0]!r}: not a stage of profile {profile or 'default'}; choices: "
                              f"{', '.join(sorted(known))}")
        check_hardware(cfg)
        code = run_repro(cfg, profile or "default", force=force, stages=stage,
                         echo=lambda line: console.print(line, highlight=False, soft_wrap=True),
                         committed_answers=not fresh_answers)
        if code:
            _fail(f"dvc repro failed (exit {code}); finished stages are kept, run again to resume")
    _guarded(body)


def _repro_parts(cfg: Config, profile: str, specs: list[str], dry_run: bool, committed_answers: bool = True) -> None:
    """`kvshot repro --part ...`: each part in order (`pipeline.repro_parts`), stopping at the first failure."""
    from pipeline.parts import expand_parts
    from pipeline.repro_parts import measured_rows, part_state, run_part
    from stages.common import duration

    todo = expand_parts(cfg, specs)
    rows = measured_rows(cfg, profile) if dry_run else None    # read once: the paces of every part's estimate
    ahead: set[str] = set()                 # trials the parts before will train: adopted by the later ones
    total, unknown = 0.0, 0
    for n, (study, name) in enumerate(todo, 1):
        state = part_state(cfg, profile, study, name, rows, ahead)
        if dry_run:
            print(state.line())
            total += state.left_s or 0.0
            unknown += state.done is None and state.left_s is None
            continue
        console.print(f"[bold]part {n} of {len(todo)}: {state.name}[/]", highlight=False)
        code = run_part(cfg, profile, state, echo=lambda line: console.print(line, highlight=False, soft_wrap=True),
                        committed_answers=committed_answers)
        if code:
            _fail(f"--part {state.name} failed (exit {code}); finished work is kept, run again to resume")
    if dry_run and total:
        print(f"in all: about {duration(total)} of training left, the parts run in this order at the paces measured "
              f"so far (decoding and the data stages aside)"
              + (f"; {unknown} part{'s' if unknown > 1 else ''} without a pace to go by" if unknown else ""))


@app.command("plan")
def plan_cmd(profile: Optional[str] = ProfileOpt, root: Path = RootOpt,
             out: Optional[Path] = typer.Option(None, "--out", help="Write the plan as JSON to this file.")):
    """Every trial of the profile's studies with its role, parent, parts and end-to-end decoding (--out: JSON)."""
    def body():
        from collections import Counter

        from pipeline.plan_file import plan_file
        from stages.common import write_text_atomic

        planned = plan_file(load_config(profile, [], root=root.resolve()))
        for study in dict.fromkeys(t.study for t in planned.trials):
            trials = planned.of_study(study)
            roles = ", ".join(f"{n} {role}" for role, n in Counter(t.role for t in trials).items())
            parts = sorted({p for t in trials for p in t.parts})
            chosen = Counter(k for t in trials for k in t.chosen)
            print(f"{study}: {len(trials)} trials ({roles})" + (f"; parts {', '.join(parts)}" if parts else "")
                  + "".join(f"; {k} of {n} chosen by a validation study (`kvshot sweep --dry-run` says which value)"
                            for k, n in chosen.items()))
        if out is not None:
            write_text_atomic(out, planned.model_dump_json(indent=1) + "\n")
            print(f"wrote {out}")
    _guarded(body)


@app.command()
def keys(pattern: Optional[str] = typer.Argument(None, help="Show only the keys that contain this text."),
         profile: Optional[str] = ProfileOpt, root: Path = RootOpt):
    """Every key an override can set (KEY=VALUE), with its value in the profile."""
    def body():
        import json

        from pipeline.config import key_values
        cfg = load_config(profile, [], root=root.resolve())
        rows = [(k, v) for k, v in key_values(cfg) if not pattern or pattern in k]
        if not rows:
            _fail(f"no key contains {pattern!r} (`kvshot keys` lists all)")
        width = max(len(k) for k, _ in rows)
        for key, value in rows:
            text = json.dumps(value, default=str, separators=(", ", ": "))
            print(f"{key:<{width}}  {text if len(text) <= 80 else text[:77] + '...'}")
    _guarded(body)


@app.command()
def ui(port: int = typer.Option(5000, help="Port on 127.0.0.1."), root: Path = RootOpt):
    """Serve the MLflow UI for this project's runs on 127.0.0.1 (Ctrl-C stops it)."""
    def body():
        from pipeline.ui import UIError, serve
        try:
            serve(root.resolve(), port=port)
        except UIError as exc:
            _fail(str(exc))
    _guarded(body)


def main() -> None:  # pragma: no cover - console script entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
