"""A drafter run directory on disk: the final model plus resumable training checkpoints.

Layout of `runs/<study>/<trial>/` (DESIGN §10):

    config.json              fully resolved: drafter config, train params, draft vocabulary size, summary
    model.safetensors        trained weights plus the draft-vocabulary maps `d2t` / `t2d`
    checkpoint/latest        name of the newest complete checkpoint (written atomically, last)
    checkpoint/step-NNNNNNN/ model.safetensors, optimizer.pt, scheduler.pt, rng.pt, state.json

A checkpoint directory is filled under a temporary name and renamed into place, and `latest` moves only
after that; a kill at any moment leaves the previous checkpoint readable.

A directory written by `kvshot export` (either engine format, see `stages.export`) is accepted wherever a trained
run directory is (`is_trained`, `trained_run_dirs`, `load_drafter`): the drafter is rebuilt from the engine fields.
The final model's files are `stages.run_files`'s. Optimizer and scheduler states hold Python scalars next to
tensors, so they go through `torch.save` and come back with `weights_only=True`.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from stages.common import StageError, write_text_atomic
# the run directory's final files (their own module: the export writes and reads them too)
from stages.run_files import (CONFIG_FILE, FROZEN, MODEL_FILE, contiguous, load_run, load_tensors,  # noqa: F401
                              save_run, save_tensors)

CHECKPOINT_DIR = "checkpoint"
LATEST_FILE = "latest"
KEEP_CHECKPOINTS = 1   # older complete checkpoints are removed once a newer one is in place
# The drafter's token embedding is the target's, frozen: it is not saved, `load_drafter` copies it back in.
def is_trained(run_dir: Path) -> bool:
    """A trained drafter is there: a finished run's config.json + model.safetensors, or an export (same files)."""
    run_dir = Path(run_dir)
    return (run_dir / CONFIG_FILE).is_file() and (run_dir / MODEL_FILE).is_file()


def trained_run_dirs(run_dirs, none_given: str) -> list[Path]:
    """The run (or exported) directories as paths, each holding a trained drafter; `none_given` is the error for
    an empty list."""
    dirs = [Path(r) for r in run_dirs]
    if not dirs:
        raise StageError(none_given)
    for r in dirs:
        if not is_trained(r):
            raise StageError(f"run directory {r}: no trained drafter in it (config.json / model.safetensors missing)")
    return dirs


def variant_of(run_dir: Path) -> str | None:
    """The drafter variant a run (or export) directory holds, from its config alone (None when unreadable)."""
    try:
        config = json.loads((Path(run_dir) / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return (config.get("drafter") or {}).get("variant") or ("eagle3" if "export" in config else None)


def trainable_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The drafter's state dict without the frozen target embedding (d2t / t2d buffers included)."""
    return {k: v for k, v in model.state_dict().items() if k not in FROZEN}


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Load saved weights into a drafter built from the same config; anything but FROZEN missing is an error."""
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if k not in FROZEN]
    if missing or unexpected:
        raise StageError(f"saved drafter weights do not fit the drafter config: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")


def load_drafter(run_dir: Path, target) -> tuple[Any, dict[str, Any]]:
    """Rebuild a trained drafter from its run directory (or an exported directory), with `target`'s embedding
    copied back in.

    Returns (drafter in eval mode on the target's device, the run's config.json; for an export a config of the
    same shape, see `stages.export.read_export`).
    """
    from models.build import build_drafter
    from models.drafter_config import DrafterConfig
    from stages.export import export_format, read_export

    if export_format(run_dir) is not None:
        cfg, weights, config = read_export(run_dir)
        layers = config["export"]["feature_layers"]
        if list(layers) != list(target.feature_layers):
            # an engine would tap these layers of the target; a drafter fed other ones drafts nonsense
            raise StageError(f"exported drafter {run_dir}: taps target hidden_states {layers}, the target gives "
                             f"{target.feature_layers} (target.feature_layers)")
    else:
        config, weights = load_run(run_dir)
        try:
            cfg = DrafterConfig.from_dict(config["drafter"])
        except (KeyError, TypeError, ValueError) as exc:
            raise StageError(f"{Path(run_dir) / CONFIG_FILE}: no valid drafter config ({exc})") from None
    if (cfg.vocab_size, cfg.hidden_size) != (target.vocab_size, target.hidden_size):
        raise StageError(f"run directory {run_dir}: drafter built for vocab {cfg.vocab_size} / hidden "
                         f"{cfg.hidden_size}, the target has {target.vocab_size} / {target.hidden_size}")
    model = build_drafter(cfg)
    load_weights(model, weights)
    model.load_target_weights(target.embed_tokens.weight.detach().float().cpu())
    return model.to(target.device).eval(), config


# -- resumable training checkpoints --------------------------------------------------------------------------------

@dataclass
class TrainState:
    """Everything a resumed run needs to continue bit-for-bit."""

    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    rng: dict[str, Any]
    extra: dict[str, Any]


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: Path, state: TrainState) -> Path:
    """Write checkpoint/step-NNNNNNN/ atomically, point `latest` at it, drop older ones."""
    root = Path(run_dir) / CHECKPOINT_DIR
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{state.step:07d}"
    final = root / name
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{name}.tmp-"))
    try:
        save_file(contiguous(state.model), str(tmp / MODEL_FILE))
        torch.save(state.optimizer, tmp / "optimizer.pt")
        torch.save(state.scheduler, tmp / "scheduler.pt")
        torch.save(state.rng, tmp / "rng.pt")
        (tmp / "state.json").write_text(json.dumps({"step": state.step, **state.extra}, indent=2) + "\n")
        for f in tmp.iterdir():   # the rename below must not overtake the data on a crash
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    write_text_atomic(root / LATEST_FILE, name + "\n")
    _prune(root, keep=name)
    return final


def _prune(root: Path, keep: str) -> None:
    done = sorted(p for p in root.glob("step-*") if p.is_dir() and p.name != keep)
    for p in done[: max(0, len(done) - (KEEP_CHECKPOINTS - 1))]:
        shutil.rmtree(p, ignore_errors=True)
    for p in root.glob(".step-*.tmp-*"):   # leftovers of a run killed mid-write
        shutil.rmtree(p, ignore_errors=True)


def latest_checkpoint(run_dir: Path) -> Path | None:
    root = Path(run_dir) / CHECKPOINT_DIR
    pointer = root / LATEST_FILE
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    return path if (path / "state.json").is_file() else None


def load_checkpoint(path: Path) -> TrainState:
    path = Path(path)
    try:
        meta = json.loads((path / "state.json").read_text())
        return TrainState(
            step=int(meta.pop("step")),
            model=load_file(str(path / MODEL_FILE)),
            optimizer=torch.load(path / "optimizer.pt", weights_only=True),
            scheduler=torch.load(path / "scheduler.pt", weights_only=True),
            rng=torch.load(path / "rng.pt", weights_only=True),
            extra=meta,
        )
    except (OSError, json.JSONDecodeError, RuntimeError, KeyError) as exc:
        raise StageError(f"checkpoint {path}: cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0]})") \
            from None


def remove_checkpoints(run_dir: Path) -> None:
    shutil.rmtree(Path(run_dir) / CHECKPOINT_DIR, ignore_errors=True)
