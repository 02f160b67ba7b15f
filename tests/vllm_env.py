"""The serving engine's environment for the slow engine tests (stages/engine_env.py): found or built once in
scratch/vllm-env, else the calling test is skipped with the reason (no package registry, too little disk).

The export test's `speculators` package goes into the same environment (`speculators_python`): it runs on the
engine's torch and transformers, so one environment serves both tests and a fresh clone downloads torch once."""
from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

import pytest

from stages.common import StageError
from stages.engine_env import GPU_COMPANIONS, works
from stages.engine_env import ROOT, engine_env  # noqa: F401  (the tests' imports)
from stages.engine_env import vllm_python as _vllm_python

SPECULATORS_PIN = "speculators==0.9.0"
SPECULATORS_ENV_VAR = "KVSHOT_SPECULATORS_PYTHON"    # a python that has it already


@functools.cache          # found once per test session (each check imports vLLM: seconds)
def vllm_python() -> Path:
    try:
        return _vllm_python()
    except StageError as exc:
        pytest.skip(str(exc))


def _imports_speculators(python: Path) -> bool:
    return subprocess.run([str(python), "-c", "import speculators.models.eagle3"], capture_output=True,
                          timeout=300).returncode == 0


@functools.cache
def speculators_python() -> Path:
    """A python with vllm-project's `speculators`: $KVSHOT_SPECULATORS_PYTHON, else the engine's python with it
    added once (its torch pinned, so pip pulls no other build; the GPU companion packages it brings are removed
    again, as when the environment was built); the calling test is skipped with the reason where neither can be
    had."""
    given = os.environ.get(SPECULATORS_ENV_VAR)
    if given:
        if not Path(given).is_file():
            pytest.skip(f"{SPECULATORS_ENV_VAR}={given}: no such interpreter")
        return Path(given)
    python = vllm_python()
    if _imports_speculators(python):
        return python
    torch_version = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"],
                                   capture_output=True, text=True, timeout=300).stdout.strip()
    try:
        subprocess.run([str(python), "-m", "pip", "install", "-q", SPECULATORS_PIN, f"torch=={torch_version}"],
                       check=True, capture_output=True, timeout=900)
    except (subprocess.SubprocessError, OSError) as exc:
        pytest.skip(f"{SPECULATORS_PIN} cannot be installed beside vLLM in {python.parent.parent} "
                    f"({type(exc).__name__}; no package registry?)")
    finally:   # a half-finished install may have brought them too: vLLM does not import while they are there
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", *GPU_COMPANIONS], capture_output=True,
                       timeout=300)
    if not (_imports_speculators(python) and works(python)):
        pytest.skip(f"{python.parent.parent}: {SPECULATORS_PIN} installed but it or vLLM does not import")
    return python


def main() -> int:
    """`make test`'s set-up step: the engine's environment with `speculators`, found or built before pytest starts
    (a fresh clone pays its install here, as it pays `.venv`'s, not inside a test's time). Never fails: where it
    cannot be had, the tests that need it are skipped and say why."""
    try:
        python = speculators_python()
    except pytest.skip.Exception as exc:
        print(f"engine environment: not available ({exc.msg}); the vLLM and speculators tests will be skipped")
        return 0
    print(f"engine environment: {python.parent.parent} (vLLM and speculators)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
