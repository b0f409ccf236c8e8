"""Peers told to wait: a request refused ``RATE_LIMITED`` with ``retry_after_ms`` makes its peer's
big requests of the same method refused from their envelope's head until then, undecoded. A
client that does not wait (a flood) then costs the loop microseconds a request, not a decode.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple

from kvcm.errors import Code, KvcmError, error
from kvcm.proto import wire

#: (peer, method) pairs told to wait that are remembered at most.
MAX_TOLD_TO_WAIT = 4096
#: Requests smaller than this are read even from a peer told to wait: the box spares the loop
#: decoding big requests, and a small one (a heartbeat) may be one the refusal did not concern.
TOLD_TO_WAIT_MIN_BYTES = 16 << 10


class StillWaiting(NamedTuple):
    """A request refused unread: its envelope's ``msgid`` and ``method``, when its sender may
    send again (``until``, on the box's clock) and the refusal."""

    msgid: int
    method: str
    until: float
    refusal: KvcmError


class ToldToWait:
    """The ``(peer, method)`` pairs told to wait, each with until when and the refusal's words."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._until: dict[tuple[bytes, str], tuple[float, str]] = {}

    def __len__(self) -> int:
        return len(self._until)

    def __contains__(self, key: object) -> bool:
        return key in self._until

    def __iter__(self) -> Iterator[tuple[bytes, str]]:
        return iter(self._until)

    def remember(self, peer: bytes, method: str, refusal: Mapping[str, object]) -> None:
        """Note a wire error answered to ``peer``'s ``method``, if it told the peer to wait (never
        for kvcm's own relays: one caller behind a relay must not stop all of them)."""
        if refusal.get("code") != Code.RATE_LIMITED or peer.startswith(wire.RELAY_ID_PREFIX):
            return
        detail = refusal.get("detail")
        retry_ms = detail.get("retry_after_ms") if isinstance(detail, Mapping) else None
        if not isinstance(retry_ms, (str, int)):
            return
        if len(self._until) >= MAX_TOLD_TO_WAIT:
            now = self._clock()
            self._until = {k: v for k, v in self._until.items() if v[0] > now}
            if len(self._until) >= MAX_TOLD_TO_WAIT:
                return
        until = self._clock() + int(retry_ms) / 1000.0
        self._until[(peer, method)] = (until, str(refusal.get("message", "")))

    def refusal(self, payload: bytes, peer: bytes) -> StillWaiting | None:
        """The refusal of a request its sender sent before its wait was over; None to read it."""
        if len(payload) < TOLD_TO_WAIT_MIN_BYTES:
            return None  # cheap to read: read it (a heartbeat of a source over its budget goes through)
        split = wire.split_request(payload)
        if split is None:
            return None
        msgid, name, _ = split
        told = self._until.get((peer, name))
        if told is None:
            return None
        left = told[0] - self._clock()
        if left <= 0:
            del self._until[(peer, name)]
            return None
        refused = error(Code.RATE_LIMITED, f"{name}: told to retry in {left:.3f} s and sent again sooner "
                                          f"(not read); earlier: {told[1][:300]}")
        refused.detail["retry_after_ms"] = str(max(1, round(left * 1000)))
        return StillWaiting(msgid, name, told[0], refused)
