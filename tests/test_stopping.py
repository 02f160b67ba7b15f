"""A long command stopped by SIGTERM (a kill, a scheduler) leaves nothing running: its child stops and cleans up,
and a sweep's local Ray cluster shuts down with its trials (pipeline.stopping, pipeline.executor.ray_session)."""
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
def cleanup(signum, frame):
    out.write_text("cleaned up")
    sys.exit(0)
signal.signal(signal.SIGTERM, cleanup)
out.write_text("running")
while True:
    time.sleep(0.1)
"""

PARENT = """
import sys
from pipeline.stopping import Stopped, run_child
try:
    run_child([sys.executable, sys.argv[1], sys.argv[2]])
except Stopped as exc:
    sys.exit(exc.exit_code)
"""

DRIVER = """
import os, sys, time
from pathlib import Path
from pipeline.config import RayParams
from pipeline.executor import ray_session
from pipeline.stopping import Stopped
from stages.common import Paths

out = Path(sys.argv[2])
try:
    with ray_session(RayParams(num_cpus=1), Paths(Path(sys.argv[1]))):
        import ray

        @ray.remote
        def train_forever(path):
            Path(path).write_text(str(os.getpid()))
            while True:
                time.sleep(0.1)

        task = train_forever.remote(str(out))
        while True:
            time.sleep(0.1)
except Stopped as exc:
    sys.exit(exc.exit_code)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat")
    return not (state.is_file() and state.read_text().split(") ")[-1].startswith("Z"))   # a zombie has ended


def _wait_for(check, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.time() + timeout
    while not check():
        assert time.time() < deadline, what
        assert proc is None or proc.poll() is None, f"{what}: the script exited with {proc.returncode}"
        time.sleep(0.1)


def _spawn(script: str, tmp_path: Path, *args: str) -> subprocess.Popen:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(script))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    log = open(tmp_path / "script.log", "wb")       # a file, not a pipe: Ray's output would fill a pipe and block
    return subprocess.Popen([sys.executable, str(path), *args], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                            stdout=log, stderr=subprocess.STDOUT)


def _log(tmp_path: Path) -> str:
    return (tmp_path / "script.log").read_text(errors="replace")[-2000:]


def _child_pids(pid: int) -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and (p / "stat").is_file()
            and _parent(p) == pid]


def _parent(proc: Path) -> int | None:
    try:
        return int((proc / "stat").read_text().split(") ")[-1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def test_a_stopped_command_stops_its_child_and_lets_it_clean_up(tmp_path):
    """`kvshot repro --part` runs its sweep as a child: a SIGTERM to the parent reaches the child as a SIGTERM (so
    the child shuts its own work down) before the parent exits with 128 + 15."""
    (tmp_path / "child.py").write_text(CHILD)
    out = tmp_path / "child-state"
    proc = _spawn(PARENT, tmp_path, str(tmp_path / "child.py"), str(out))
    try:
        _wait_for(lambda: out.is_file(), 60, "the child never started", proc)
        children = _child_pids(proc.pid)
        assert len(children) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM, _log(tmp_path)
        assert out.read_text() == "cleaned up"
        _wait_for(lambda: not _alive(children[0]), 10, "the child outlived its parent")
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_sweep_driver_stopped_by_sigterm_shuts_its_local_ray_and_trials_down(tmp_path):
    """The sweep's local Ray (started by `ray_session`) and a task still running in it end with the driver."""
    out = tmp_path / "worker-pid"
    proc = _spawn(DRIVER, tmp_path, str(tmp_path / "ws"), str(out))
    try:
        _wait_for(lambda: out.is_file() and out.read_text(), 120, "the Ray task never started", proc)
        worker = int(out.read_text())
        ray_processes = _child_pids(proc.pid)
        assert _alive(worker) and ray_processes
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM, _log(tmp_path)
        _wait_for(lambda: not _alive(worker) and not any(_alive(p) for p in ray_processes), 30,
                  "a Ray process outlived the driver")
    finally:
        if proc.poll() is None:
            proc.kill()
