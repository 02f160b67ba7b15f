"""A real two-node Ray cluster on this machine: a sweep joins it through RAY_ADDRESS and uses both nodes."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from pipeline.config import load_config, parse_overrides
from pipeline.plan import plan
from pipeline.sweep import run_sweep
from stages.common import Paths

ROOT = Path(__file__).resolve().parent.parent


def node_trial(trial, paths, report):
    """Records which node ran it; holds its CPU long enough that the trials must spread over both nodes."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    report({"loss": 1.0}, 0)
    time.sleep(2.0)
    alpha = [0.6] * 7
    return {"alpha": alpha, "acc": alpha, "mat": 3.0, "retention": 1.0, "node": node}


@pytest.fixture
def cluster(monkeypatch):
    """Head + one worker node, 1 CPU each, started here and always shut down."""
    import ray
    import ray.cloudpickle as cp
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    temp = ROOT / "scratch" / "rayc" / "ray"
    temp.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("RAY_TMPDIR", str(temp.parent))  # Ray's address file and sessions stay in scratch/
    cp.register_pickle_by_value(sys.modules[__name__])
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "temp_dir": str(temp),
                                                      "include_dashboard": False})
    try:
        c.add_node(num_cpus=1)
        c.wait_for_nodes()
        yield c
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()


def test_sweep_on_a_two_node_cluster_through_ray_address(cluster, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    paths = Paths(tmp_path)
    trials = plan(load_config("smoke"), parse_overrides(["depth=1,2"]), study="cluster")
    result = run_sweep(trials, paths, trial_fn=node_trial)

    assert result.exit_code == 0 and sorted(result.ran) == ["kv_only-d1", "kv_only-d2"]
    # one trial on each node: the sweep joined the cluster (a Ray of its own would have one node)
    assert len({r["node"] for r in result.rows}) == 2
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("kvshot-cluster")
    children = [r for r in client.search_runs([exp.experiment_id]) if "mlflow.parentRunId" in r.data.tags]
    assert sorted(r.info.run_name for r in children) == ["kv_only-d1", "kv_only-d2"]
    assert all(r.info.status == "FINISHED" and r.data.metrics["mat"] == 3.0 for r in children)
    assert paths.stepwise_metrics("cluster").is_file()
