"""The MLflow UI as a user meets it: `kvshot ui` on a workspace holding two studies, one of which adopted trials
from the other, opened in headless Chromium (driven through chromedriver's WebDriver HTTP API, stdlib only).

Opening the depth study's experiment must land on the runs table, which lists the parent sweep run and every
trial of the study, the adopted ones included. `make test` installs chromium and chromium-driver with apt-get
where it can; without them this test is skipped and says so.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

import pytest

from pipeline.config import load_config
from pipeline.plan import plan
from pipeline.sweep import run_sweep
from pipeline.ui import answers
from stages.common import Paths

KVSHOT = str(Path(sys.executable).parent / "kvshot")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER),
                       reason="headless Chromium is not installed (chromium and chromedriver: `make test` installs "
                              "them with apt-get where it runs as root)"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(what: str, fn: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.25)


class Browser:
    """Headless Chromium through chromedriver: just what this test needs of the WebDriver protocol."""

    def __init__(self, profile_dir: Path):
        port = _free_port()
        self.base = f"http://127.0.0.1:{port}"
        self.driver = subprocess.Popen([CHROMEDRIVER, f"--port={port}"], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
        _wait_for("chromedriver", lambda: self._ready(), 30)
        args = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-extensions", "--window-size=1600,1000", f"--user-data-dir={profile_dir}"]
        caps = {"capabilities": {"alwaysMatch": {"browserName": "chrome",
                                                 "goog:chromeOptions": {"binary": CHROMIUM, "args": args}}}}
        self.session = self._call("POST", "/session", caps)["sessionId"]

    def _ready(self) -> bool:
        try:
            return bool(self._call("GET", "/status").get("ready"))
        except (urllib.error.URLError, OSError):
            return False

    def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return json.load(resp)["value"]
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"WebDriver {method} {path}: {exc.read().decode(errors='replace')[:500]}") from None

    def open(self, url: str) -> None:
        self._call("POST", f"/session/{self.session}/url", {"url": url})

    def js(self, script: str) -> Any:
        return self._call("POST", f"/session/{self.session}/execute/sync", {"script": script, "args": []})

    def close(self) -> None:
        try:
            self._call("DELETE", f"/session/{self.session}")
        finally:
            self.driver.kill()
            self.driver.wait(10)


def instant_trial(trial, paths, report):
    """A trial that trains nothing: the UI only needs its rows in MLflow."""
    alpha = [round(0.7 * 0.9 ** k, 4) for k in range(7)]
    return {"alpha": alpha, "acc": alpha, "mat": 1 + sum(alpha), "retention": alpha[6] / alpha[0]}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The smoke profile's injection study, then its depth study, which adopts depth 1 and EAGLE-3 from it."""
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])   # trial functions of a test module
    root = tmp_path_factory.mktemp("ws")
    saved = os.environ.pop("MLFLOW_TRACKING_URI", None), os.environ.pop("RAY_ADDRESS", None)
    try:
        cfg = load_config("smoke")
        first = run_sweep(plan(cfg, study="injection"), Paths(root), trial_fn=instant_trial)
        depth = run_sweep(plan(cfg, study="depth"), Paths(root), trial_fn=instant_trial)
    finally:
        for key, value in zip(("MLFLOW_TRACKING_URI", "RAY_ADDRESS"), saved):
            if value is not None:
                os.environ[key] = value
    assert first.exit_code == depth.exit_code == 0
    assert sorted(depth.skipped) == ["eagle3", "kv_only-d1"] and depth.ran == ["kv_only-d2"]
    return root, [r["trial"] for r in depth.rows]


@pytest.fixture(scope="module")
def ui(workspace):
    root, _ = workspace
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    proc = subprocess.Popen([KVSHOT, "ui", "--port", str(port), "--root", str(root)], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for("kvshot ui", lambda: answers(url) or proc.poll() is not None, 120)
        assert proc.poll() is None, proc.communicate()[0][-2000:]
        yield url
    finally:
        proc.terminate()
        proc.wait(60)
        proc.stdout.close()


RUN_NAMES = "return Array.from(document.querySelectorAll('[col-id=\"attributes.`Run Name`\"] a')).map(a => a.innerText)"
# The expand buttons of parent runs sit in the run-name cells; a parent's child runs show once it is expanded.
EXPAND = ("const b = Array.from(document.querySelectorAll('[col-id=\"attributes.`Run Name`\"] button'));"
          "b.forEach(x => x.click()); return b.length")


def test_a_study_opens_on_its_runs_table_with_every_trial(ui, workspace, tmp_path):
    _, trials = workspace
    browser = Browser(tmp_path / "chromium-profile")
    try:
        browser.open(ui + "/#/experiments")            # as a user would: the experiment list, then a click
        _wait_for("the experiment list",
                  lambda: browser.js("return Array.from(document.querySelectorAll('a'))"
                                     ".some(a => a.innerText.trim() === 'kvshot-depth')"))
        browser.js("Array.from(document.querySelectorAll('a')).find(a => a.innerText.trim() === 'kvshot-depth')"
                   ".click()")
        _wait_for("the runs table", lambda: "/runs" in browser.js("return location.hash")
                  and browser.js(RUN_NAMES))
        assert "/overview" not in browser.js("return location.hash")
        assert _wait_for("an expandable parent run", lambda: browser.js(EXPAND)) == 1
        names = _wait_for("the trials under the sweep run",
                          lambda: (n := browser.js(RUN_NAMES)) and len(n) == 1 + len(trials) and n)
    finally:
        browser.close()
    parents = [n for n in names if n.startswith("sweep-depth-")]
    assert len(parents) == 1 and sorted(set(names) - set(parents)) == sorted(trials)
    assert {"eagle3", "kv_only-d1", "kv_only-d2"} == set(trials)   # two of them adopted from the injection study
