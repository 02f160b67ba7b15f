"""The server behind `kvshot ui`: MLflow's tracking server as `mlflow server` runs it, with two changes.

1. Its index page opens experiments on their runs table. MLflow 3.17's UI has a global "GenAI | Model training"
   switch, kept in the browser's localStorage and "GenAI" until a user flips it, and that switch alone decides
   what an experiment opens on: the GenAI overview of traces ("No data available") or the runs table; the
   experiment's `mlflow.experimentKind` tag is not read for it. kvshot's experiments hold training runs only, so
   the index page sets the switch to "Model training" in a browser that has never chosen; a choice the user makes
   stays theirs.
2. It dies with the `kvshot ui` that started it, even when that one is killed with SIGKILL (Linux), so no server
   is left behind holding the port.

Run as `python -m pipeline.ui_app server ARGS` (the arguments of `mlflow server`): the web server it starts
serves `pipeline.ui_app:app`, MLflow's own app with the index page above. Should a later MLflow build its command
differently, the plain MLflow app is served instead: the UI works, only its first view is GenAI's.
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

PARENT_ENV = "KVSHOT_UI_PARENT"       # pid of the process this server must not outlive
MLFLOW_APP = "mlflow.server.fastapi_app:app"
APP = "pipeline.ui_app:app"
# The UI's localStorage key of its GenAI / Model training switch (MLflow 3.17: key "mlflow.workflowType", version 1).
_DEFAULT_VIEW = ('<script>try{var k="mlflow.workflowType_v1";if(localStorage.getItem(k)===null)'
                 'localStorage.setItem(k,JSON.stringify("machine_learning"))}catch(e){}</script>')


def die_with_parent() -> None:
    """Linux: have the kernel send this process SIGTERM when its parent dies, however it dies.

    Only under `kvshot ui` (PARENT_ENV names the parent); each process of the server sets it for itself, since a
    child does not inherit it."""
    parent = os.environ.get(PARENT_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):   # the parent was gone before the line above took effect
        os.kill(os.getpid(), signal.SIGTERM)


def with_default_view(flask_app: Any) -> None:
    """Serve MLflow's index page with the default-view script first in its <head>."""
    from flask import Response

    mlflow_index = flask_app.view_functions.get("serve")
    if mlflow_index is None:   # another MLflow: its own index page, unchanged
        return

    def index():
        page = Path(flask_app.static_folder) / "index.html"
        if not page.is_file():
            return mlflow_index()
        html = page.read_text(encoding="utf-8").replace("<head>", "<head>" + _DEFAULT_VIEW, 1)
        return Response(html, mimetype="text/html")

    flask_app.view_functions["serve"] = index


def __getattr__(name: str) -> Any:
    """`app`, built when the web server first asks for it (importing this module alone starts nothing)."""
    if name != "app":
        raise AttributeError(name)
    from mlflow.server import app as flask_app
    from mlflow.server.fastapi_app import app as asgi_app

    die_with_parent()
    with_default_view(flask_app)
    globals()["app"] = asgi_app
    return asgi_app


def main(argv: list[str]) -> None:
    """`mlflow server ARGS` whose web server serves APP in place of MLflow's app."""
    import mlflow.server
    from mlflow.cli import cli

    die_with_parent()
    os.environ[PARENT_ENV] = str(os.getpid())   # the web server started below dies with this process in turn
    build = getattr(mlflow.server, "_build_uvicorn_command", None)
    if build is not None:
        def build_ours(*args: Any, **kwargs: Any) -> list[str]:
            return [APP if part == MLFLOW_APP else part for part in build(*args, **kwargs)]

        mlflow.server._build_uvicorn_command = build_ours
    cli.main(args=argv, prog_name="mlflow")


if __name__ == "__main__":
    main(sys.argv[1:])
