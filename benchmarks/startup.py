"""Start time of the CLI: `kvshot --help` and `kvshot keys depth`, each a fresh process.

Neither command computes anything, so neither should load torch or pandas (pipeline.config composes the schema
from the stages' light section module, stages.sections). The ratio printed is the CLI's start time over the time a
bare interpreter takes to import torch and pandas alone: above 1 the CLI pays for the heavy imports, well below 1
it does not. The target is under ~2 s per command on 2 cores. Each command runs `RUNS` times; medians are printed.

    .venv/bin/python benchmarks/startup.py [RUNS]
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TARGET_S = 2.0


def wall(cmd: list[str], runs: int) -> float:
    """Median wall time of `runs` fresh runs of `cmd` (each must succeed)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", MLFLOW_DISABLE_TELEMETRY="true", DVC_NO_ANALYTICS="1")
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(runs: int = 5) -> None:
    kvshot = str(BIN / "kvshot")
    help_s = wall([kvshot, "--help"], runs)
    keys_s = wall([kvshot, "keys", "depth"], runs)
    heavy_s = wall([sys.executable, "-c", "import torch, pandas"], runs)
    worst = max(help_s, keys_s)
    verdict = "ok" if worst < TARGET_S else f"over the {TARGET_S:.0f} s target"
    print(f"startup: kvshot --help {help_s:.2f} s, kvshot keys depth {keys_s:.2f} s (median of {runs}); "
          f"import torch+pandas alone {heavy_s:.2f} s; ratio {worst / heavy_s:.2f}x; {verdict}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
