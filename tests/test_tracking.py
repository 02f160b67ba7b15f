"""MLflow tracking (URI resolution, runs, curves, artifacts, standalone stage runs) and `kvshot ui`."""
from __future__ import annotations

import json
import socket
import urllib.request

import pytest

from pipeline.config import load_config, with_values
from pipeline.tracking import (Tracker, _retry, artifact_location, stage_run,
                               tracking_uri)
from stages.common import Paths


@pytest.fixture
def cfg(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return load_config("smoke")


def test_tracking_uri_precedence(cfg, tmp_path, monkeypatch):
    assert tracking_uri(cfg.tracking, tmp_path) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    custom = with_values(cfg, {"tracking.uri": "sqlite:///elsewhere.db"})
    assert tracking_uri(custom.tracking, tmp_path) == "sqlite:///elsewhere.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    assert tracking_uri(custom.tracking, tmp_path) == "http://127.0.0.1:9"
    # a local backend gets an explicit artifact folder in the project; a remote server keeps its own
    assert artifact_location(cfg.tracking, tmp_path, "sqlite:///x.db") == (tmp_path.resolve() / "mlruns").as_uri()
    assert artifact_location(cfg.tracking, tmp_path, "http://127.0.0.1:9") is None


def test_parent_child_runs_with_params_curves_and_artifacts(cfg, tmp_path):
    from pipeline.config import flatten

    tracker = Tracker(cfg.tracking, tmp_path, "unit")
    assert tracker.client.get_experiment(tracker.experiment_id).name == "kvshot-unit"
    parent = tracker.start_run("sweep", tags={"sweep": "parent"})
    child = tracker.start_run("kv_only-d1", parent, params=flatten(cfg), tags={"fingerprint": "abc"})
    for step in range(3):
        tracker.log_metrics(child, {"loss": 1.0 / (step + 1), "bad": float("nan"), "text": "x"}, step)
    alpha = [0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]
    tracker.log_row(child, {"trial": "kv_only-d1", "alpha": alpha, "acc": alpha, "mat": 3.1, "retention": 0.25})
    tracker.log_dict(child, {"hidden": 64}, "config.json")
    tracker.end_run(child)
    tracker.end_run(parent, ok=False, error="1 failed")

    c = tracker.client
    run = c.get_run(child)
    assert run.data.tags["mlflow.parentRunId"] == parent and run.data.tags["fingerprint"] == "abc"
    assert len(run.data.params) == len(flatten(cfg)) and run.data.params["drafter.variant"] == "kv_only"
    assert [m.step for m in c.get_metric_history(child, "loss")] == [0, 1, 2]
    assert "bad" not in run.data.metrics and "text" not in run.data.metrics
    hist = sorted(c.get_metric_history(child, "alpha"), key=lambda m: m.step)
    assert [m.step for m in hist] == list(range(7)) and [m.value for m in hist] == alpha
    assert run.data.metrics["mat"] == 3.1 and run.data.metrics["alpha_6"] == 0.2
    assert {"alpha.png", "config.json"} <= {a.path for a in c.list_artifacts(child)}
    assert (tmp_path / "mlruns").is_dir()   # artifacts under the project, not the working directory
    assert c.get_run(parent).info.status == "FAILED" and c.get_run(parent).data.tags["error"] == "1 failed"
    # a second tracker for the same study reuses the experiment
    assert Tracker(cfg.tracking, tmp_path, "unit").experiment_id == tracker.experiment_id


def test_experiments_are_model_training_experiments_old_ones_too(cfg, tmp_path):
    from mlflow.tracking import MlflowClient

    from pipeline.tracking import mark_project_experiments

    tracker = Tracker(cfg.tracking, tmp_path, "fresh")
    kind = "mlflow.experimentKind"
    assert tracker.client.get_experiment(tracker.experiment_id).tags[kind] == "custom_model_development"
    # experiments an older kvshot made carry no kind: reusing one marks it, and so does `kvshot ui`
    client = MlflowClient(tracking_uri=tracking_uri(cfg.tracking, tmp_path))
    old = client.create_experiment("kvshot-old", artifact_location=(tmp_path / "mlruns").as_uri())
    other = client.create_experiment("kvshot-older", artifact_location=(tmp_path / "mlruns").as_uri())
    mine = client.create_experiment("someone-else", artifact_location=(tmp_path / "mlruns").as_uri())
    Tracker(cfg.tracking, tmp_path, "old")
    assert client.get_experiment(old).tags[kind] == "custom_model_development"
    assert kind not in client.get_experiment(other).tags
    assert [e.name for e in mark_project_experiments(cfg.tracking, tmp_path)] == ["kvshot-fresh", "kvshot-old",
                                                                                  "kvshot-older"]
    assert client.get_experiment(other).tags[kind] == "custom_model_development"
    assert kind not in client.get_experiment(mine).tags       # not kvshot's: left alone


def test_retry_waits_out_a_locked_database():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("(sqlite3.OperationalError) database is locked")
        return "ok"

    assert _retry(flaky) == "ok" and len(calls) == 3
    with pytest.raises(ValueError):
        _retry(lambda: (_ for _ in ()).throw(ValueError("other")))


def test_standalone_stage_runs_log_to_mlflow(cfg, tmp_path):
    paths = Paths(tmp_path)
    with stage_run(cfg, "train", paths) as report:
        report({"loss": 2.0}, 0)
        report({"loss": 1.0}, 1)
    with pytest.raises(KeyError):
        with stage_run(cfg, "evaluate", paths) as report:
            raise KeyError("boom")
    with stage_run(cfg, "features", paths) as report:
        report({"tokens": 10.0}, None)
    tracker = Tracker(cfg.tracking, tmp_path, "stages")
    runs = {r.info.run_name: r for r in tracker.client.search_runs([tracker.experiment_id])}
    assert [m.value for m in tracker.client.get_metric_history(runs["train"].info.run_id, "loss")] == [2.0, 1.0]
    assert runs["train"].info.status == "FINISHED" and runs["evaluate"].info.status == "FAILED"
    assert runs["features"].data.metrics["tokens"] == 10.0
    assert runs["train"].data.params["train.scale"] == "small"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ui_serves_the_project_runs_on_localhost(cfg, tmp_path):
    from pipeline.ui import answers, start

    Tracker(cfg.tracking, tmp_path, "uitest")
    server = start(tmp_path, port=_free_port(), tracking=cfg.tracking)
    try:
        assert server.url.startswith("http://127.0.0.1:")
        req = urllib.request.Request(f"{server.url}/api/2.0/mlflow/experiments/search",
                                     data=json.dumps({"max_results": 50}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=10) as resp:
            names = [e["name"] for e in json.load(resp)["experiments"]]
        assert "kvshot-uitest" in names
        # the index page starts a browser that never chose a view on the training-runs view (pipeline.ui_app)
        with urllib.request.urlopen(server.url + "/", timeout=10) as resp:
            page = resp.read().decode()
        assert "mlflow.workflowType_v1" in page and "machine_learning" in page and "static-files/" in page
    finally:
        server.stop()
    assert not server.alive() and not answers(server.url)


def test_git_commit_is_dirty_for_code_changes_but_not_for_dvc_lock(tmp_path):
    import subprocess

    from pipeline.provenance import short_commit
    from pipeline.tracking import git_commit

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "dvc.lock").write_text("a\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    head = git_commit(tmp_path)
    assert len(head) == 40 and not head.endswith("+dirty")
    (tmp_path / "dvc.lock").write_text("b\n")
    (tmp_path / "sub").mkdir()
    assert git_commit(tmp_path / "sub") == head
    assert short_commit(tmp_path) == head[:7]
    (tmp_path / "code.py").write_text("x = 2\n")
    assert git_commit(tmp_path / "sub") == head + "+dirty"
    assert short_commit(tmp_path) == head[:7] + "+dirty"  # the report's commit carries the same mark
    assert short_commit(tmp_path / "missing") == "unknown"
