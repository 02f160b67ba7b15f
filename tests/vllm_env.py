"""The serving engine's environment for the slow vLLM tests (stages/engine_env.py): found or built once in
scratch/vllm-env, else the calling test is skipped with the reason (no package registry, too little disk)."""
from __future__ import annotations

from pathlib import Path

import pytest

from stages.common import StageError
from stages.engine_env import ROOT, engine_env  # noqa: F401  (the tests' imports)
from stages.engine_env import vllm_python as _vllm_python


def vllm_python() -> Path:
    try:
        return _vllm_python()
    except StageError as exc:
        pytest.skip(str(exc))
