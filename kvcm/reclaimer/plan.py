"""Planning a round: the TTL jobs, and the bytes each storage type of a group must give back to
end under its watermark (a per-type quota's own excess, the group quota's shared in proportion
to usage)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from kvcm.reclaimer.state import GroupState
from kvcm.reclaimer.victims import Job


def ttl_jobs(groups: Iterable[GroupState], now: float) -> list[Job]:
    return [
        Job(state, stype, "ttl", keys=deque(keys))
        for state in groups
        for stype, keys in state.expired(now).items()
    ]


def usage_less_inflight(state: GroupState, usage: Mapping[str, Any],
                        net: tuple[int, dict[str, int]] | None) -> tuple[dict[str, int], int]:
    """``(bytes per storage type, bytes in all)`` of a group's usage sample, less what is on its
    way out: known exactly when the cache gives ``net`` (:class:`~kvcm.reclaimer.hooks.ExactUsage`),
    else estimated from what this reclaimer handed over (see :mod:`kvcm.reclaimer.core`)."""
    if net is not None:
        # ... and what was marked since (this round's TTL sweep, in-line evictions) is not in it
        since = state.marked_since_sample
        by_type = {t: n - since.get(t, 0) for t, n in net[1].items()}
        return by_type, net[0] - sum(since.values())
    by_type = {t: int(u.get("bytes", 0)) - state.inflight_bytes(t) for t, u in usage.get("by_type", {}).items()}
    return by_type, int(usage.get("bytes", 0)) - sum(state.inflight_bytes(t) for t in state.inflight)


def needs(state: GroupState, by_type: Mapping[str, int], total: int, hysteresis: float,
          sample: tuple[int, int] = (0, 0)) -> dict[str, int]:
    """Bytes to free per storage type so the group (``total`` bytes used) and each type
    (``by_type``) end under their floors; ``sample``: ``(bytes, copies)`` of the usage sample,
    for the block-count mark."""
    lim = state.limits
    high, low = lim.used_percentage, max(0.0, lim.used_percentage - hysteresis)
    out = {t: excess(by_type.get(t, 0), q, high, low) for t, q in lim.type_quotas.items()}
    # The byte watermark is a quota of its own reached at 100%: whichever mark asks more wins.
    group = max(excess(total, lim.quota, high, low), excess(total, lim.used_bytes, 1.0, 1.0 - hysteresis),
                block_excess(lim.max_blocks, sample, total, high, low))
    extra = group - sum(out.values())
    if extra > 0:
        # only types with serving blocks can give anything back
        rest = {t: max(0, u - out.get(t, 0)) for t, u in by_type.items() if t in state.policies}
        for t, share in shares(extra, rest).items():
            out[t] = out.get(t, 0) + share
    return {t: n for t, n in out.items() if n > 0}


def excess(used: int, quota: int, high: float, low: float) -> int:
    """Bytes to free when ``used`` reached the high mark (``>=``, as Tair, so a watermark of 1.0
    means "when full"); the target is the low mark, and always strictly below the high one."""
    high_mark, low_mark = round(quota * high, 6), round(quota * low, 6)  # 1000 * 0.8 is 800, not 799.99
    if quota <= 0 or used <= 0 or used < high_mark:
        return 0
    target = min(math.floor(low_mark), math.ceil(high_mark) - 1)
    return max(0, used - max(target, 0))


def block_excess(max_blocks: int, sample: tuple[int, int], total: int, high: float, low: float) -> int:
    """Bytes to free for the block-count mark (``max_blocks * used_percentage``), at the sample's
    mean copy size: copies on their way out (``sample`` bytes beyond ``total``) are not counted."""
    nbytes, copies = sample
    if max_blocks <= 0 or nbytes <= 0 or copies <= 0:
        return 0
    mean = nbytes / copies
    live = copies - round(max(0, nbytes - total) / mean)
    return math.ceil(excess(live, max_blocks, high, low) * mean)


def shares(total: int, weights: Mapping[str, int]) -> dict[str, int]:
    """Split ``total`` in proportion to ``weights`` (rounded up, so the sum covers ``total``)."""
    whole = sum(weights.values())
    if whole <= 0:
        return {}
    return {k: math.ceil(total * w / whole) for k, w in weights.items() if w > 0}


def pass_on(job: Job, active: list[Job]) -> None:
    """A watermark job that ran out of victims hands what it still owes to its group's others."""
    if job.keys is not None or job.need <= 0:
        return
    siblings = [j for j in active if j.state is job.state and j.keys is None]
    for sibling in siblings:
        sibling.need += math.ceil(job.need / len(siblings))
    job.need = 0
