"""Trials outside Ray: the fingerprints of a plan's trials (read by the sweep and by `kvshot sweep --dry-run`), and
one stage alone in this process: the one trial of `kvshot train`, trained here, and `kvshot evaluate`.
"""
from __future__ import annotations

from pathlib import Path

from pipeline.config import Config, ConfigError, with_values
from pipeline.fingerprint import HashCache, data_hashes, fingerprint
from pipeline.plan import ADHOC, PARENT, VARIANT, trial_name, waves
from pipeline.trial import CKPT_CHILDREN, Trial, evaluate_runs, json_safe, needs_parent, prepare_run_dir, train_trial
from stages.common import Paths, Report, write_json_atomic


def fingerprint_trials(trials: list[Trial], paths: Paths) -> None:
    """Set every trial's data hashes and fingerprint (parents first: a child's includes its parent's)."""
    cache = HashCache(paths.scratch / "hash-cache.json")
    by_name = {t.name: t for t in trials}
    for wave in waves(trials):
        for t in wave:
            t.data_hashes = data_hashes(t.config, paths, cache)
            parent = by_name[t.depends_on].fingerprint if t.depends_on else None
            t.fingerprint = fingerprint(t.config, t.data_hashes, parent)
    cache.save()


def single_trial(cfg: Config, study: str = ADHOC) -> Trial:
    """The one trial of a resolved config (`kvshot train`), named like a sweep trial of its variant."""
    d = cfg.drafter
    values = {"drafter.depth": d.depth}
    if d.variant == "kv_only":
        values.update({"drafter.injection": d.injection, "drafter.rope_fix": d.rope_fix})
    if d.variant in CKPT_CHILDREN:
        values["drafter.init"] = d.init
    if d.variant == "block":
        values.update({"drafter.context": d.context, "drafter.block_size": d.block_size})
    # a control or an EAGLE-3.1 is another drafter than the plain variant: its name says so (one run dir each)
    values.update({f"drafter.{k}": True for k in ("no_target", "token_context", "fc_norm", "norm_output")
                   if getattr(d, k)})
    name = trial_name(d.variant, values, list(values))
    trial = Trial(name=name, study=study, values=values, config=cfg)
    if needs_parent(cfg):
        if cfg.train.parent:
            raise ConfigError(f"{PARENT}={cfg.train.parent}: a parent trained on other settings is planned by a "
                              f"sweep (`kvshot sweep ...`), not by `kvshot train`")
        parent = with_values(cfg, {VARIANT: "eagle3"})
        trial.depends_on = trial_name("eagle3", {"drafter.depth": parent.drafter.depth}, ["drafter.depth"])
    return trial


def train_one(trial: Trial, paths: Paths, report: Report) -> Path:
    """Train one trial in this process (no Ray): its run directory gets the fingerprint, then the checkpoint."""
    parent = None
    if trial.depends_on:
        parent_fp = paths.run_dir(trial.study, trial.depends_on) / "fingerprint"
        if not parent_fp.is_file():
            raise ConfigError(f"{trial.name} (init=ckpt) needs the trained eagle3 drafter runs/{trial.study}/"
                              f"{trial.depends_on}; train it first or use drafter.init=random")
        parent = parent_fp.read_text().strip()
    trial.data_hashes = data_hashes(trial.config, paths)
    trial.fingerprint = fingerprint(trial.config, trial.data_hashes, parent)
    prepare_run_dir(trial, paths)
    return train_trial(trial, paths, report)


def evaluate_study(cfg: Config, study: str, paths: Paths, report: Report) -> list[dict]:
    """Evaluate every trained drafter of runs/<study>/ in this process -> metrics/stepwise/<study>.json."""
    base = paths.root / "runs" / study
    run_dirs = sorted(p for p in base.glob("*") if (p / "model.safetensors").is_file()) if base.is_dir() else []
    if not run_dirs:
        raise ConfigError(f"study {study!r}: no trained drafters under runs/{study}/ (run `kvshot train` or "
                          f"`kvshot sweep --study {study}` first)")
    rows = evaluate_runs(cfg, run_dirs, paths, report)
    out = [json_safe({**r, "study": study, "status": r.get("status", "ok")}) for r in rows]
    write_json_atomic(paths.stepwise_metrics(study), out)
    return out
