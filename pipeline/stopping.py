"""Stopping a long command cleanly: a stop signal becomes an exception in the main thread, so `finally` clauses run.

Python's default for SIGTERM and SIGHUP is to die where it stands. For a command that started other processes
that leaves them behind: `kvshot repro --part` killed with SIGTERM left its `kvshot sweep` child training, and a
sweep killed so would leave the local Ray cluster it started. Here a stop signal raises `Stopped` instead
(a BaseException, like KeyboardInterrupt, so no `except Exception` on the way swallows it); `run_child` passes
the stop on to its child and waits for it to clean up, and `pipeline.executor.ray_session` shuts its local Ray down.
"""
from __future__ import annotations

import signal
import subprocess
import threading
from contextlib import contextmanager
from typing import Iterator, Sequence

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# A terminal's Ctrl-C reaches every process of the foreground group, so a child sees it anyway; a kill or a
# scheduler's stop reaches one process, which has to pass it on.
KILL_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
CHILD_GRACE_S = 60.0


class Stopped(BaseException):
    """Raised in the main thread by a stop signal."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum     # what a shell reports for a process the signal killed


@contextmanager
def stop_on_signals(signals: Sequence[int] = STOP_SIGNALS) -> Iterator[None]:
    """In the block, `signals` raise Stopped in the main thread; a second signal does not interrupt the stopping.
    The previous handlers come back after the block. Off the main thread (where Python cannot set handlers) the
    block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised: list[int] = []

    def handler(signum, _frame):
        if not raised:
            raised.append(signum)
            raise Stopped(signum)

    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def run_child(cmd: Sequence[str], **popen_kwargs) -> int:
    """`subprocess.run(cmd).returncode` for a long child: stopping this process (SIGTERM, SIGHUP, Ctrl-C) sends
    the child SIGTERM and gives it CHILD_GRACE_S to clean up (its local Ray, its partial files) before SIGKILL,
    then raises on (Stopped, KeyboardInterrupt)."""
    with stop_on_signals(KILL_SIGNALS), subprocess.Popen(list(cmd), **popen_kwargs) as proc:
        try:
            return proc.wait()
        except BaseException:
            proc.terminate()
            try:
                proc.wait(timeout=CHILD_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise


__all__ = ["KILL_SIGNALS", "STOP_SIGNALS", "Stopped", "run_child", "stop_on_signals"]
