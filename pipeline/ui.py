"""`kvshot ui`: the MLflow UI over this project's runs, on 127.0.0.1, with as few processes as MLflow allows.

`mlflow server` by default spawns a job-execution service and several web workers (15 processes, ~3 GB);
with MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false and --workers 1 it is 2 processes (~500 MB).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from pipeline.tracking import artifact_location, tracking_uri

HOST = "127.0.0.1"


@dataclass
class UIServer:
    """A running `mlflow server` process group."""

    process: subprocess.Popen
    url: str

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 15.0) -> None:
        """Stop the server and its web workers (its own process group only)."""
        if self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout)
        except ProcessLookupError:
            pass


def server_command(root: Path, port: int, tracking: object | None = None) -> list[str]:
    """The `mlflow server` command line for the project's backend store and artifact root."""
    root = Path(root).resolve()
    uri = tracking_uri(tracking, root)
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", HOST, "--port", str(port),
           "--backend-store-uri", uri, "--workers", "1"]
    art = artifact_location(tracking, root, uri)
    if art:
        cmd += ["--default-artifact-root", art]
    return cmd


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"})
    return env


def answers(url: str, timeout: float = 2.0) -> bool:
    """Does the server answer its REST API (experiments search)?"""
    req = urllib.request.Request(f"{url}/api/2.0/mlflow/experiments/search",
                                 data=json.dumps({"max_results": 1}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def start(root: Path, port: int = 5000, tracking: object | None = None, wait_s: float = 90.0,
          log: Path | None = None) -> UIServer:
    """Start the server in the background (its own process group) and wait until it answers; stop() ends it."""
    root = Path(root).resolve()
    log = log or root / "scratch" / "mlflow-ui.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    url = f"http://{HOST}:{port}"
    with log.open("ab") as out:
        proc = subprocess.Popen(server_command(root, port, tracking), cwd=root, env=_env(), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    server = UIServer(proc, url)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if not server.alive():
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
            raise RuntimeError(f"mlflow server exited with code {proc.returncode}: {' '.join(tail)} (log {log})")
        if answers(url):
            return server
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"mlflow server did not answer on {url} within {wait_s:.0f} s (log {log})")


def serve(root: Path, port: int = 5000, tracking: object | None = None) -> None:
    """`kvshot ui`: start the server, print its URL, keep it up until Ctrl-C, then stop it.

    `tracking` (a TrackingParams) defaults to the tracking section of the workspace's params.yaml.
    """
    console = Console()
    if tracking is None:
        from pipeline.config import load_config

        tracking = load_config(None, [], root=Path(root)).tracking
    server = start(root, port, tracking)
    console.print(f"MLflow UI: [bold]{server.url}[/] (Ctrl-C stops it)")
    try:
        while server.alive():
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
