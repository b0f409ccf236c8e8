"""Capacity sweeps and policy comparisons: many replays of one trace held in memory.

A sweep first replays the trace with an unbounded cache (Tair's warm-up run): its peak usage is
the *working set*, the capacity above which nothing is ever evicted, and its hit rate the
ceiling. It then replays every (policy, capacity) pair, capacities log-spaced up to the working
set; each point changes the first tier of every group, as Tair's sweep script does. Points run
in worker processes with ``jobs > 1`` (forked, so the trace is shared, not copied per task).
"""

from __future__ import annotations

import math
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from kvcm.optimizer.replay import Replayer
from kvcm.optimizer.spec import Capacity, ReplaySpec
from kvcm.optimizer.stats import HitStats, ReplayResult
from kvcm.optimizer.trace import Record

UNBOUNDED = 1 << 62  # "no limit" that keeps the capacity's unit (blocks or bytes)


@dataclass
class SweepPoint:
    """One replay of a sweep: totals over all instances, and each instance's counts."""

    policy: str
    capacity: int
    unit: str
    total: HitStats
    instances: dict[str, HitStats] = field(default_factory=dict)
    wall_seconds: float = 0.0

    def to_json(self) -> dict[str, object]:
        return {
            "policy": self.policy,
            "capacity": self.capacity,
            "unit": self.unit,
            "wall_seconds": self.wall_seconds,
            **self.total.to_json(),
            "instances": {k: v.to_json() for k, v in self.instances.items()},
        }


def capacity_points(working_set: int, n: int = 40, low: int | None = None) -> list[int]:
    """Up to ``n`` log-spaced capacities from ``low`` to ``working_set``, both included.

    ``low`` defaults to a thousandth of the working set (at least 1). Rounding can merge
    neighbours at the small end, so fewer than ``n`` distinct points may come back.
    """
    if working_set <= 0 or n <= 0:
        return []
    low = max(1, min(low if low is not None else working_set // 1000, working_set))
    if n == 1 or low == working_set:
        return [working_set]
    step = math.log(working_set / low) / (n - 1)
    points = {round(low * math.exp(step * i)) for i in range(n)}
    return sorted(points | {working_set})


def sweep_unit(spec: ReplaySpec) -> str:
    """The unit of the sweep: the one of the first configured capacity (blocks if none)."""
    for group in spec.groups:
        for tier in group.tiers:
            if tier.capacity is not None:
                return tier.capacity.unit
    return "blocks"


def unbounded_run(
    records: Sequence[Record], spec: ReplaySpec, block_size_of: Callable[[str], int]
) -> ReplayResult:
    """Replay with no limit on the first tier of any group (same unit, same policies)."""
    bounded = spec.map_groups(capacity=Capacity(UNBOUNDED, sweep_unit(spec)))
    return Replayer(bounded, block_size_of, label="unbounded").run(records)


def working_set(result: ReplayResult) -> int:
    """The largest first-tier peak usage over the groups of an unbounded run."""
    return max((g.peak_usage for g in result.groups), default=0)


def replay_point(
    records: Sequence[Record],
    spec: ReplaySpec,
    block_size_of: Callable[[str], int],
    policy: str,
    capacity: int,
    unit: str = "blocks",
    options: dict[str, object] | None = None,
) -> SweepPoint:
    """Replay once with every group's first tier set to (``policy``, ``capacity``).

    ``options`` are the policy's options; None keeps a group's configured options when its
    policy is ``policy`` already, and uses the defaults otherwise.
    """
    point_spec = with_first_tiers(spec, policy, options, capacity=Capacity(capacity, unit))
    start = time.perf_counter()
    result = Replayer(point_spec, block_size_of, label=policy).run(records)
    return SweepPoint(policy, capacity, unit, result.total, dict(result.instances),
                      time.perf_counter() - start)  # fmt: skip


def with_first_tiers(
    spec: ReplaySpec, policy: str, options: dict[str, object] | None = None, **changes: Any
) -> ReplaySpec:
    """``spec`` with every group's first tier using ``policy`` (and ``changes``, e.g. capacity).

    ``options`` None keeps a group's configured options where its policy is ``policy`` already.
    """
    groups = []
    for group in spec.groups:
        first = group.tiers[0]
        opts = options if options is not None else (
            first.policy_options if first.policy == policy else {}
        )
        groups.append(group.with_first_tier(policy=policy, policy_options=opts, **changes))
    return replace(spec, groups=tuple(groups))


# Worker state, set before forking so that tasks only carry (policy, capacity).
_SHARED: dict[str, Any] = {}


def _work(task: tuple[str, int]) -> SweepPoint:
    s = _SHARED
    options = s["options"].get(task[0])
    return replay_point(
        s["records"], s["spec"], s["block_size_of"], task[0], task[1], s["unit"], options
    )


def run_sweep(
    records: Sequence[Record],
    spec: ReplaySpec,
    block_size_of: Callable[[str], int],
    capacities: Sequence[int],
    policies: Sequence[str],
    jobs: int = 1,
    progress: Callable[[SweepPoint], object] | None = None,
    policy_options: dict[str, dict[str, object]] | None = None,
) -> list[SweepPoint]:
    """Replay every (policy, capacity) pair; points come back ordered by policy then capacity.

    ``policy_options`` maps a policy name to its options; for a policy not in it, see
    :func:`replay_point`.
    ``jobs > 1`` uses that many forked processes where ``fork`` exists (else runs serially).
    ``progress`` is called once per finished point.
    """
    unit = sweep_unit(spec)
    tasks = [(p, c) for p in policies for c in capacities]
    _SHARED.update(
        records=records, spec=spec, block_size_of=block_size_of, unit=unit,
        options=policy_options or {},
    )  # fmt: skip
    try:
        if jobs > 1 and len(tasks) > 1 and "fork" in multiprocessing.get_all_start_methods():
            points = _parallel(tasks, jobs, progress)
        else:
            points = []
            for task in tasks:
                points.append(_work(task))
                if progress is not None:
                    progress(points[-1])
    finally:
        _SHARED.clear()
    order = {p: i for i, p in enumerate(dict.fromkeys(policies))}
    return sorted(points, key=lambda pt: (order[pt.policy], pt.capacity))


def _parallel(
    tasks: list[tuple[str, int]], jobs: int, progress: Callable[[SweepPoint], object] | None
) -> list[SweepPoint]:
    ctx = multiprocessing.get_context("fork")
    workers = min(jobs, len(tasks), os.cpu_count() or 1)
    points = []
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        for point in pool.map(_work, tasks, chunksize=1):
            points.append(point)
            if progress is not None:
                progress(point)
    return points
