"""`kvshot ui`: the MLflow UI over this project's runs, on 127.0.0.1, with as few processes as MLflow allows.

`mlflow server` by default spawns a job-execution service and several web workers (15 processes, ~3 GB);
with MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false and --workers 1 it is 2 processes (~500 MB). They run in a process
group of their own, which SIGTERM, SIGINT (Ctrl-C) and SIGHUP (a closed terminal) to `kvshot ui` take down; should
`kvshot ui` be killed outright, the server follows it (pipeline.ui_app). The index page opens experiments on their
runs table (see pipeline.ui_app for why that needs doing).
"""
from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from pipeline.stopping import Stopped, stop_on_signals
from pipeline.tracking import artifact_location, tracking_uri
from pipeline.ui_app import PARENT_ENV

HOST = "127.0.0.1"
# Opens an experiment on its runs table even in a browser whose UI was switched to the GenAI view.
RUNS_VIEW = "?workflowType=machine_learning"


class UIError(RuntimeError):
    """The UI cannot start (port in use, server exited): one line for the user."""


@dataclass
class UIServer:
    """A running `mlflow server` process group."""

    process: subprocess.Popen
    url: str

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 15.0) -> None:
        """Stop the server: SIGTERM to its whole process group (the web server included), SIGKILL to whatever is
        left after `timeout`; returns once no process of the group is left."""
        pgid = self.process.pid   # started with start_new_session: the server leads its own group
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not self._group_alive(pgid):
                return
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + timeout
            while self._group_alive(pgid) and time.monotonic() < deadline:
                time.sleep(0.1)

    def _group_alive(self, pgid: int) -> bool:
        self.process.poll()   # reap the leader: a zombie would still count as a member
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def server_command(root: Path, port: int, tracking: object | None = None) -> list[str]:
    """The `mlflow server` command line for the project's backend store and artifact root."""
    root = Path(root).resolve()
    uri = tracking_uri(tracking, root)
    cmd = [sys.executable, "-m", "pipeline.ui_app", "server", "--host", HOST, "--port", str(port),
           "--backend-store-uri", uri, "--workers", "1"]
    art = artifact_location(tracking, root, uri)
    if art:
        cmd += ["--default-artifact-root", art]
    return cmd


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
                PARENT_ENV: str(os.getpid())})
    return env


def port_in_use(port: int, host: str = HOST) -> bool:
    """Is something listening on host:port, or holding it so that a server could not bind it?"""
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as the web server binds: TIME_WAIT is no use
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


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
    """Start the server in the background (its own process group) and wait until it answers; stop() ends it.

    A port already in use is a UIError before anything starts (else the server would fail to bind it, and the
    one already there would seem to answer for it)."""
    root = Path(root).resolve()
    if port_in_use(port):
        raise UIError(f"port {port} on {HOST} is already in use (another `kvshot ui` or MLflow server?); "
                      f"stop it or pick another with --port")
    log = log or root / "scratch" / "mlflow-ui.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    url = f"http://{HOST}:{port}"
    with log.open("ab") as out:
        proc = subprocess.Popen(server_command(root, port, tracking), cwd=root, env=_env(), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    server = UIServer(proc, url)
    try:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not server.alive():
                tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
                raise UIError(f"mlflow server exited with code {proc.returncode}: {' '.join(tail)} (log {log})")
            if answers(url):
                return server
            time.sleep(0.5)
        raise UIError(f"mlflow server did not answer on {url} within {wait_s:.0f} s (log {log})")
    except BaseException:   # a failed start, or a stop signal while waiting: leave nothing running
        server.stop()
        raise


def experiment_links(url: str, tracking: object, root: Path) -> list[tuple[str, str]]:
    """(name, address of its runs table) for each of the project's experiments, which are marked as
    model-training experiments on the way (workspaces of older kvshot versions included)."""
    from pipeline.tracking import mark_project_experiments

    try:
        exps = mark_project_experiments(tracking, root)
    except Exception:  # noqa: BLE001 - the links are a convenience; the UI runs without them
        return []
    return [(e.name, f"{url}/#/experiments/{e.experiment_id}/runs{RUNS_VIEW}") for e in exps]


def serve(root: Path, port: int = 5000, tracking: object | None = None) -> None:
    """`kvshot ui`: start the server, print its URL and each experiment's, keep it up until Ctrl-C (or SIGTERM,
    SIGHUP), then stop it and every process it started.

    `tracking` (a TrackingParams) defaults to the tracking section of the workspace's params.yaml.
    """
    console = Console()
    if tracking is None:
        from pipeline.config import load_config

        tracking = load_config(None, [], root=Path(root)).tracking
    with stop_on_signals():
        server = None
        try:
            server = start(root, port, tracking)
            console.print(f"MLflow UI: [bold]{server.url}[/] (Ctrl-C stops it)")
            for name, link in experiment_links(server.url, tracking, root):
                console.print(f"  {name}: {link}", highlight=False, soft_wrap=True)
            while server.alive():
                time.sleep(0.5)
            console.print(f"[red]the MLflow server stopped by itself[/] (exit code {server.process.returncode}; "
                          f"log {Path(root).resolve() / 'scratch' / 'mlflow-ui.log'})", highlight=False)
        except (Stopped, KeyboardInterrupt):
            pass
        finally:
            if server is not None:
                server.stop()
