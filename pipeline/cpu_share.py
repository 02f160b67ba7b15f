"""Idle CPUs lent to the one trial that runs: on a single-node Ray without GPUs, a trial holding its
`ray.cpus_per_trial` CPUs computes on every CPU of the node while no other trial holds any (a parent whose children
wait for its checkpoint, the last trial of a study), and goes back to its own share once another trial starts.

Ray knows nothing of the loan: a trial that starts meanwhile gets its CPUs at once, and the lender sees it at its
next check (`CpuShare.update`, called with each metrics report, at most every `every_s` seconds) and gives them
back. Thread counts change float summation order only; they are no part of a trial's fingerprint.
"""
from __future__ import annotations

import time


def threads_for(own: float, total: float, available: float, nodes: int, gpus: float = 0.0) -> int:
    """Torch threads of a trial holding `own` CPUs of a Ray with `total` CPUs, `available` of them free, on `nodes`
    nodes: every CPU when no other trial holds any on a single CPU-only node, else its own share."""
    mine = max(1, int(own))
    if nodes != 1 or gpus > 0:
        return mine
    held_by_others = total - available - own
    return max(mine, int(total)) if held_by_others < 1e-6 else mine


class CpuShare:
    """A running trial's torch threads (see the module docstring). `update()` returns the new thread count when it
    changed it, else None."""

    def __init__(self, own: float, gpus: float = 0.0, every_s: float = 30.0):
        import torch

        self.own, self.gpus, self.every_s = own, gpus, every_s
        self.last = time.monotonic()            # the first check waits: trials starting together are all placed
        self.nodes: int | None = None
        torch.set_num_threads(max(1, int(own)))     # a reused worker may still hold the previous trial's loan
        self.begun, self.changed, self.thread_s = self.last, self.last, 0.0

    def update(self) -> int | None:
        import ray
        import torch

        now = time.monotonic()
        if now - self.last < self.every_s or not ray.is_initialized():
            return None
        self.last = now
        try:
            if self.nodes is None:
                self.nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
            n = threads_for(self.own, ray.cluster_resources().get("CPU", 0.0),
                            ray.available_resources().get("CPU", 0.0), self.nodes, self.gpus)
        except Exception:       # a loan is an optimisation: Ray's state unreadable, the trial keeps its share
            n = max(1, int(self.own))
        if n == torch.get_num_threads():
            return None
        self.thread_s += torch.get_num_threads() * (now - self.changed)
        self.changed = now
        torch.set_num_threads(n)
        return n

    def mean_threads(self) -> float:
        """The torch threads the trial computed on so far, averaged over its time: its row records it, so a pace
        measured alone on every CPU is not taken for one measured beside other trials (`pipeline.budget`)."""
        import torch

        now = time.monotonic()
        total = self.thread_s + torch.get_num_threads() * (now - self.changed)
        return total / (now - self.begun) if now > self.begun else float(torch.get_num_threads())
