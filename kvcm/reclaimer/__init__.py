"""Capacity management: the reclaimer thread and its per-group state (docs/capacity.md).

:mod:`kvcm.reclaimer.core` has :class:`Reclaimer` (the round: sync, drain, TTL sweep, watermark,
eviction); :mod:`kvcm.reclaimer.state` has :class:`Limits`, the per-group policies and the
metrics; :mod:`kvcm.reclaimer.plan` what each round must free, :mod:`kvcm.reclaimer.victims`
who goes; :mod:`kvcm.reclaimer.hooks` what the reclaimer needs of the cache, and the optional
capabilities it checks for; :mod:`kvcm.reclaimer.persist` recency across restarts. Policies
themselves live in :mod:`kvcm.policies`, shared with the optimizer.
"""

from __future__ import annotations

from kvcm.reclaimer.core import CHUNK, CacheHooks, Reclaimer, Round, duty_pacer
from kvcm.reclaimer.state import GroupState, Limits, ReclaimMetrics, build_policy, limits_from_registry, limits_of

__all__ = [
    "CHUNK",
    "CacheHooks",
    "GroupState",
    "Limits",
    "ReclaimMetrics",
    "Reclaimer",
    "Round",
    "build_policy",
    "duty_pacer",
    "limits_from_registry",
    "limits_of",
]
