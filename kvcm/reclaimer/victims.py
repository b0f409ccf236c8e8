"""Choosing victims: one eviction job (free bytes of a group's storage type, or reclaim a list of
keys) and the :class:`Picker` that takes its victims from the group's policy, passing over
pinned blocks."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

from kvcm.policies import BasePolicy
from kvcm.reclaimer.hooks import PinView
from kvcm.reclaimer.state import GroupState


@dataclass
class Job:
    """Free ``need`` bytes of one (group, storage type), or reclaim an explicit key list (TTL)."""

    state: GroupState
    stype: str
    reason: str
    need: int = 0
    keys: deque[Hashable] | None = None
    done: bool = False
    inline_seen: int = -1  # the group's in-line bytes of this type when last looked at (-1: not yet)

    @property
    def policy(self) -> BasePolicy:
        return self.state.policies[self.stype]


class Picker:
    """Takes a job's victims from its group's trackers; pinned blocks (``pins``, None: a cache
    without soft pins) are passed over and counted."""

    def __init__(self, pins: PinView | None) -> None:
        self._pins = pins

    def select(self, job: Job, limit: int, now: float, pinned: list[int]) -> list[tuple[int, int]]:
        """Up to ``limit`` victims with their sizes, already removed from the group's trackers;
        pinned blocks are passed over (and counted in ``pinned[0]``)."""
        if job.keys is None and job.policy.name == "leaf_lru":
            return self._peel(job, limit, now, pinned)
        if job.keys is not None:
            keys: list[Hashable] = []
            while job.keys and len(keys) < limit:
                key = job.keys.popleft()
                if self.pinned(job.state, key, now):
                    pinned[0] += 1
                else:
                    keys.append(key)
            sizes = job.policy.sizes
            picked = [(k, sizes[k]) for k in keys if k in sizes]  # a TTL key may be untracked since
        else:
            picked = self._take(job, limit, now, pinned)  # the policy's own victims: all tracked
        for key, _ in picked:
            job.state.forget(job.stype, key)
        return picked  # type: ignore[return-value]  # the trackers hold key_of() ints only

    def pinned(self, state: GroupState, packed: Hashable, now: float) -> bool:
        if self._pins is None:
            return False
        iid, key = state.ikey(packed)  # type: ignore[arg-type]  # the trackers hold key_of() ints only
        return self._pins.is_pinned(iid, key, now)

    def _best(self, state: GroupState, policy: BasePolicy, n: int, now: float, pinned: list[int]) -> list[Hashable]:
        """The policy's ``n`` best victims that are not pinned (asking for more past pinned ones)."""
        want = n
        while True:
            found = policy.victims(want, now)
            free = [k for k in found if not self.pinned(state, k, now)]
            if len(free) >= n or len(found) < want:
                pinned[0] += len(found) - len(free)
                return free[:n]
            want = want * 2 + len(found) - len(free)

    def _take(self, job: Job, limit: int, now: float, pinned: list[int]) -> list[tuple[Hashable, int]]:
        """The policy's best victims with their sizes, as many as cover ``job.need`` (estimated
        by mean size)."""
        policy, sizes = job.policy, job.policy.sizes
        mean = policy.size_total / len(policy) if len(policy) else 1.0
        want = min(limit, max(1, math.ceil(job.need / max(mean, 1.0))))
        picked, total = [], 0
        for key in self._best(job.state, policy, want, now, pinned):
            size = sizes[key]
            picked.append((key, size))
            total += size
            if total >= job.need:
                break
        return picked

    def _peel(self, job: Job, limit: int, now: float, pinned: list[int]) -> list[tuple[int, int]]:
        """One victim at a time: removing a leaf can make its parent the next best (leaf_lru)."""
        policy, total = job.policy, 0
        picked: list[tuple[Hashable, int]] = []
        while len(picked) < limit and total < job.need:
            best = self._best(job.state, policy, 1, now, pinned)
            if not best:
                break
            size = policy.sizes[best[0]]
            picked.append((best[0], size))
            total += size
            job.state.forget(job.stype, best[0])
        return picked  # type: ignore[return-value]
