"""A trained drafter's files in a run (or exported) directory: `config.json` and `model.safetensors`, written
atomically (DESIGN §10). Shared by the training checkpoints (`stages.checkpoint`) and the engine exports
(`stages.export`), which import it and not each other."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from stages.common import StageError, atomic_path, write_json_atomic

CONFIG_FILE = "config.json"
MODEL_FILE = "model.safetensors"
FROZEN = ("embed_tokens.weight",)   # the target's embedding: never saved, restored from the target


def contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # safetensors refuses shared or strided storage (tied weights, views); drafter weights are small to copy
    return {k: v.detach().contiguous().clone() for k, v in tensors.items()}


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file atomically."""
    with atomic_path(Path(path)) as tmp:
        save_file(contiguous(tensors), str(tmp), metadata=metadata)


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    if not path.is_file():
        raise StageError(f"{path}: no such file")
    try:
        return load_file(str(path))
    except Exception as exc:  # noqa: BLE001 - a damaged file is one line for the user, whatever the parser says
        raise StageError(f"{path}: not a readable safetensors file ({type(exc).__name__})") from None


# -- the final model ---------------------------------------------------------------------------------------------

def save_run(run_dir: Path, config: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
    """Write model.safetensors, then config.json: config.json present means the model beside it is complete."""
    run_dir = Path(run_dir)
    save_tensors(run_dir / MODEL_FILE, weights, metadata={"format": "pt"})
    write_json_atomic(run_dir / CONFIG_FILE, config)


def load_run(run_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config, weights) of a trained run directory; a missing or unfinished run is a one-line StageError."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise StageError(f"run directory {run_dir}: does not exist")
    cfg_file, model_file = run_dir / CONFIG_FILE, run_dir / MODEL_FILE
    if not cfg_file.is_file() or not model_file.is_file():
        raise StageError(f"run directory {run_dir}: no trained drafter in it ({CONFIG_FILE} or {MODEL_FILE} missing)")
    try:
        config = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise StageError(f"{cfg_file}: not valid JSON ({exc.msg})") from None
    return config, load_tensors(model_file)
