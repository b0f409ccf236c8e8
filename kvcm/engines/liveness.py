"""Liveness of one event source: when it was last heard and what its silence means.

An idle engine, a dead one and one restarted in place all look the same on a SUB socket: nothing
arrives. So a source is *heard* on every live message and replay answer (a push source: on every
report or heartbeat). One silent for ``probe_interval_s`` is due a probe (a replay from
``last_seq`` itself, asked by :class:`~kvcm.engines.sequencer.Sequencer`). Not heard for
``stale_after_s`` it is ``stale`` (left out of matches); for ``expire_after_s`` (0 = never) its
blocks are to be dropped — it is ``expired`` until heard again, and rebuilt from 0 then.

Like the sequencer, this reads no clock: ``now`` (monotonic) and the wall time come with each call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict


class Freshness(TypedDict):
    """A source's state and its seconds since last heard, as ``match_engines`` replies give them."""

    state: str
    age_s: float


@dataclass(frozen=True)
class LivenessRules:
    """How long a silence may last before a probe, before stale, before expiry (0 = never)."""

    probe_interval_s: float = 5.0
    stale_after_s: float = 30.0
    expire_after_s: float = 600.0


class Liveness:
    """When one source was last heard; the verdicts its silence earns (see the module docstring)."""

    def __init__(self, rules: LivenessRules, now: float) -> None:
        self.rules = rules
        self.heard_at = now  # monotonic; a source never heard ages from when it was added
        self.heard_wall: float | None = None  # wall time of the last message, None = never heard
        self.probe_at = 0.0  # no probe before this
        self.stale = False
        self.expired = False

    def heard(self, now: float, wall: float) -> None:
        self.heard_at = now
        self.heard_wall = wall
        self.expired = False

    def idle(self, now: float) -> float:
        return now - self.heard_at

    def probe_due(self, now: float) -> bool:
        """Silent for a probe interval, and none sent for one (the caller also asks the sequencer)."""
        return self.idle(now) >= self.rules.probe_interval_s and now >= self.probe_at

    def probed(self, now: float) -> None:
        self.probe_at = now + self.rules.probe_interval_s

    def update_stale(self, now: float) -> bool | None:
        """Whether the source is stale now, if that changed (None: unchanged)."""
        stale = self.idle(now) >= self.rules.stale_after_s
        if stale == self.stale:
            return None
        self.stale = stale
        return stale

    def expire_due(self, now: float) -> bool:
        """Stale for ``expire_after_s`` and not expired yet: its blocks are to be dropped."""
        expire_after = self.rules.expire_after_s
        return self.stale and expire_after > 0 and self.idle(now) >= expire_after and not self.expired

    def state(self, now: float, replaying: bool, gap: bool) -> tuple[str, float]:
        """``(state, age_s)``: ``expired``, ``stale``, ``replaying`` (a replay, not a probe, is
        running), ``gap`` (a gap accepted without replay) or ``live``; age since last heard."""
        age = max(0.0, now - self.heard_at)
        if self.expired:
            return "expired", age
        if age >= self.rules.stale_after_s:
            return "stale", age
        if replaying:
            return "replaying", age
        return ("gap" if gap else "live"), age
