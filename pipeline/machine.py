"""The machine a run measures its time on, named as the report names it: a step's time differs several times over
between a CPU with native bf16 and one without, so every wall time kvshot records says where it ran. Kept apart
from the report's provenance so that a trial can name its machine without importing the report's planning."""
from __future__ import annotations

import platform
from pathlib import Path


def cpu_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name where Linux tells it, else what `platform` knows (often just the architecture)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware() -> str:
    """`2 CPU cores (AMD EPYC, native bf16), 23 GiB RAM, no GPU`: whether bf16 is native decides the study
    profile's speed several times over, so it is part of the machine's name. It names what the CPU can do ("no
    native bf16"), not the precision a run computed in (an fp32 run on such a CPU is not emulated bf16)."""
    import psutil
    import torch

    from stages.common import native_bf16

    cpu = f"{cpu_name()}, {'native bf16' if native_bf16('cpu') else 'no native bf16'}"
    mem = psutil.virtual_memory().total / 2**30
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{psutil.cpu_count(logical=True)} CPU cores ({cpu}), {mem:.0f} GiB RAM, {gpu}"
