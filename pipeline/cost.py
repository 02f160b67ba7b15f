"""What trials cost: each trial's estimated training work, the order a sweep starts them in, the time a sweep has
left at the pace it measures, and a sweep replayed from measured trial times.

`estimated_cost` is relative work, not seconds: seconds come from scaling it by the pace of finished trials
(`time_left`, `SweepProgress`, `plan_estimate`), or from the measured times themselves (`replay`).
"""
from __future__ import annotations

import heapq
import time

from pipeline.plan import ADHOC, waves as dependency_waves
from pipeline.trial import Trial
from stages.common import duration

# A trial's training time relative to another's, fitted to the study's own trials (results/study, 960 steps on 2
# cores: eagle3 25 min, kv_only 28 / 43 / 68 min at depth 1 / 2 / 4): per step 3.0 units, 1.6 more per drafter layer
# past the first, 0.31 more for reading the target's KV. Training is matmul-bound, so work grows with layers times
# steps. Only the order in which trials start and the sweep's estimate of the time left (scaled by the pace it
# measures) depend on these numbers.
_STEP_BASE, _STEP_PER_LAYER, _STEP_KV = 3.0, 1.6, 0.31


def estimated_cost(t: Trial) -> float:
    """A trial's training work in arbitrary units: estimated seconds per step x optimizer steps."""
    from stages.train import total_steps

    c = t.config
    d = c.drafter
    reads_kv = d.variant in ("kv_only", "hybrid", "cross_only") or (d.variant == "block" and d.context != "hidden")
    step = _STEP_BASE + _STEP_PER_LAYER * (max(1, d.depth) - 1) + (_STEP_KV if reads_kv else 0.0)
    conversations = c.data.scales.get(c.train.scale, max(c.data.scales.values()))
    return step * total_steps(c.train, conversations)


def schedule_order(trials: list[Trial]) -> dict[str, float]:
    """Each trial's priority: its estimated cost plus the costliest chain of trials that wait for it (longest
    path first: a parent with long children starts before an equally long trial that nothing waits for)."""
    cost = {t.name: estimated_cost(t) for t in trials}
    children: dict[str, list[str]] = {}
    for t in trials:
        if t.depends_on:
            children.setdefault(t.depends_on, []).append(t.name)
    prio: dict[str, float] = {}

    def chain(name: str) -> float:
        if name not in prio:
            prio[name] = cost[name] + max((chain(c) for c in children.get(name, [])), default=0.0)
        return prio[name]

    for t in trials:
        chain(t.name)
    return prio


def time_left(costs: dict[str, float], finished: dict[str, float], running: dict[str, float],
              slots: int) -> float | None:
    """Seconds a sweep has left, estimated from what it measured: the finished trials' seconds per unit of
    `estimated_cost` (`finished`: name -> seconds it took) times the work still ahead (the trials of `costs` not
    finished, less the seconds each running one has run: `running`), shared by `slots` trials at a time but never
    under the longest single trial left. None until a trial has finished."""
    spent = sum(costs[n] for n in finished)
    if spent <= 0:
        return None
    rate = sum(finished.values()) / spent
    ahead = [max(0.0, costs[n] * rate - running.get(n, 0.0)) for n in costs if n not in finished]
    if not ahead:
        return 0.0
    return max(sum(ahead) / max(1, min(slots, len(ahead))), max(ahead))


def plan_estimate(trials: list[Trial], took: dict[str, float], slots: int) -> str:
    """`sweep S: 4 of 8 trials to train, about 2:03:10 at 2 at a time (at the pace of the 4 finished)`: the
    training left, from the seconds the plan's finished trials took (`took`) and `estimated_cost`."""
    study = trials[0].study if trials else ADHOC
    todo = [t for t in trials if t.name not in took]
    text = f"sweep {study}: {len(todo)} of {len(trials)} trials to train"
    if not todo:
        return text
    costs = {t.name: estimated_cost(t) for t in trials}
    left = time_left(costs, took, {}, slots)
    if left is None:
        return text + " (no finished trial of the plan to estimate their time from)"
    return text + f", about {duration(left)} at {slots} at a time (at the pace of the {len(took)} finished)"


def replay(trials: list[Trial], took: dict[str, float], slots: int, waves: bool = True) -> float:
    """Seconds a sweep of `trials` takes from scratch if each trains for the seconds it took (`took`): `slots` at a
    time, in the sweep's own order (`schedule_order`), a child once every trial of the dependency waves before its
    own has finished, as the executor runs them (one Tune experiment per wave); with `waves=False`, as soon as its
    parent has. What a part of a study run in pieces would take in one go, its data stages and decoding aside."""
    prio = schedule_order(trials)
    names = {t.name for t in trials}
    wave = {t.name: i if waves else 0 for i, group in
            enumerate(dependency_waves(trials, finished={t.depends_on for t in trials} - names - {None}))
            for t in group}
    pending, running, ended, now = {t.name: t for t in trials}, [], set(), 0.0
    while pending or running:
        current = min((wave[n] for n in pending), default=0)
        open_wave = current if not any(wave[n] < current for _, n in running) else current - 1
        ready = sorted((t for t in pending.values() if (t.depends_on is None or t.depends_on in ended
                        or t.depends_on not in prio) and wave[t.name] <= open_wave),
                       key=lambda t: -prio[t.name])
        for t in ready[:slots - len(running)]:
            heapq.heappush(running, (now + took[t.name], t.name))
            del pending[t.name]
        now, name = heapq.heappop(running)
        ended.add(name)
    return now


class SweepProgress:
    """Where a running sweep stands: when each of the trials it trains started, how long each that finished took,
    and from that pace the time it has left (`line`)."""

    def __init__(self) -> None:
        self.study = ADHOC
        self.costs: dict[str, float] = {}
        self.slots = 1
        self.started_at: dict[str, float] = {}
        self.took: dict[str, float] = {}
        self.ended: set[str] = set()

    def track(self, todo: list[Trial], slots: int) -> None:
        """Follow the trials this sweep trains, `slots` at a time."""
        self.costs = {t.name: estimated_cost(t) for t in todo}
        self.study = todo[0].study if todo else ADHOC
        self.slots = slots

    def started(self, name: str) -> None:
        self.started_at.setdefault(name, time.time())

    def finished(self, name: str, ok: bool) -> None:
        self.ended.add(name)
        if ok and name in self.started_at:      # a failed trial's time says nothing of the others' pace
            self.took[name] = time.time() - self.started_at[name]

    def line(self) -> str | None:
        """`sweep S: 3/8 trials done, 2 running, about 1:04:00 left` (None when the sweep trains one trial)."""
        if len(self.costs) < 2:
            return None
        now = time.time()
        done = [n for n in self.costs if n in self.ended]
        running = {n: now - t for n, t in self.started_at.items() if n in self.costs and n not in self.ended}
        text = f"sweep {self.study}: {len(done)}/{len(self.costs)} trials done"
        if running:
            text += f", {len(running)} running"
        left = time_left({n: c for n, c in self.costs.items() if n not in self.ended or n in self.took},
                         self.took, running, self.slots)
        if left is not None and left >= 1 and len(done) < len(self.costs):   # 0: running past the estimate
            text += f", about {duration(left)} left"
        return text
