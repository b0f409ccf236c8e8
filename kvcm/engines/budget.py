"""A work budget per owner: how much of the RPC loop's time one account (or, with auth off, one
push source) may spend on engine reports, refilled continuously.

The RPC loop is one thread: a report of 16,000 blocks holds it for tens of milliseconds, and a
client that sends them back to back would make every other client wait behind each one. The
dispatcher's estimate of a report's work (µs) is charged to its owner's bucket before the report
is decoded or run; an owner whose bucket cannot pay is refused at once with ``RATE_LIMITED`` and
the time to wait, which costs the loop next to nothing. Engines within their budget never notice
it: the default lets one account apply about 65,000 blocks per second.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvcm.errors import Code, KvcmError, error

#: Owners remembered at most; past it those whose bucket is full again are forgotten (a full
#: bucket is what a forgotten owner starts with, so forgetting one changes nothing).
MAX_OWNERS = 4096


class WorkBudget:
    """Per owner, ``rate_ms_per_s`` milliseconds of estimated work per second; a bucket holds at
    most one second's worth, so an idle owner may spend a second's budget at once."""

    def __init__(self, rate_ms_per_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate_us = rate_ms_per_s * 1000.0  # µs of work per second of wall time
        self.clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # owner -> (µs available, when)

    def available(self, owner: str) -> float:
        """µs ``owner`` may spend now."""
        level, at = self._buckets.get(owner, (self.rate_us, 0.0))
        return min(self.rate_us, level + (self.clock() - at) * self.rate_us)

    def check(self, owner: str, us: float, what: str) -> None:
        """Refuse (RATE_LIMITED) unless ``owner`` could pay ``us`` now; charges nothing. Work
        beyond a full bucket costs a full bucket (the turn budget bounds one request anyway)."""
        have = self.available(owner)
        if min(us, self.rate_us) > have:
            raise self._refusal(owner, us, have, what)

    def charge(self, owner: str, us: float, what: str) -> None:
        """Take ``us`` from ``owner``'s bucket, or refuse (RATE_LIMITED) and take nothing."""
        self.check(owner, us, what)
        if len(self._buckets) >= MAX_OWNERS and owner not in self._buckets:
            self._forget_full()
        self._buckets[owner] = (max(0.0, self.available(owner) - us), self.clock())

    def _refusal(self, owner: str, us: float, have: float, what: str) -> KvcmError:
        wait_s = (min(us, self.rate_us) - have) / self.rate_us
        refused = error(Code.RATE_LIMITED, f"{what}: {owner[:200]!r} has used its budget of "
                                           f"{self.rate_us / 1000:g} ms of work per second "
                                           f"(events.push_budget_ms_per_s); retry in {wait_s:.3f} s")
        refused.detail["retry_after_ms"] = str(max(1, round(wait_s * 1000)))
        return refused

    def _forget_full(self) -> None:
        now = self.clock()
        self._buckets = {o: (level, at) for o, (level, at) in self._buckets.items()
                         if level + (now - at) * self.rate_us < self.rate_us}
        while len(self._buckets) >= MAX_OWNERS:  # all busy: the least recently charged go
            del self._buckets[min(self._buckets, key=lambda o: self._buckets[o][1])]


__all__ = ["MAX_OWNERS", "WorkBudget"]
