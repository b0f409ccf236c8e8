"""Held refusals: a big request refused for its sender's own fault is answered later, not at once.

The RPC loop is shared. A client that loops a request the server refuses — a list over its
schema's cap, work over the turn budget, a report sent again before the wait it was told — costs
the loop a receive and a refusal each time, and when the refusal comes straight back the client
sends again at once: a few hundred multi-megabyte refusals a second, and every other client's
tail latency pays for them. Holding the refusal makes such a client wait as a well-behaved one
would: a synchronous client then sends at most one refused request per hold.

Only requests of :data:`MIN_BYTES` or more are held (a small mistake is cheap to refuse and is
answered at once), only for the codes that are the sender's fault, and at most
:data:`MAX_HELD` replies at a time (past it, refusals are answered at once: memory stays bounded
whatever a pipelining client sends). A held reply is bytes, so holding costs its size only.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable

from kvcm.errors import Code

#: Requests smaller than this are answered at once, refused or not.
MIN_BYTES = 16 << 10
#: Replies held at most at any time, all peers together.
MAX_HELD = 4096
#: No reply is held longer than this, whatever the wait it names.
MAX_HOLD_S = 1.0
#: The codes that say the sender broke a bound it was told of (a schema cap, a size, a limit).
SENDER_FAULT = frozenset({Code.INVALID_ARGUMENT, Code.MESSAGE_TOO_LARGE, Code.TOO_MANY_KEYS, Code.TOO_LARGE,
                          Code.METHOD_NOT_FOUND, Code.UNAUTHENTICATED, Code.PERMISSION_DENIED})


class Tarpit:
    """Replies waiting for their release time, earliest first. Owned by the RPC thread."""

    def __init__(self, hold_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        """``hold_s``: how long a sender-fault refusal is held (0 = never held)."""
        self.hold_s = min(max(0.0, hold_s), MAX_HOLD_S)
        self.clock = clock
        self._heap: list[tuple[float, int, object, bytes]] = []  # (release at, order, tag, reply)
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def hold_for(self, code: int, size: int, told_until: float | None = None) -> float:
        """Seconds to hold the refusal ``code`` of a request of ``size`` bytes (0 = answer now).
        ``told_until``: the sender was told to wait until then and sent again sooner; the
        refusal is held until that wait is over."""
        if size < MIN_BYTES or len(self._heap) >= MAX_HELD:
            return 0.0
        if told_until is not None:
            return min(MAX_HOLD_S, max(0.0, told_until - self.clock()))
        return self.hold_s if code in SENDER_FAULT else 0.0

    def hold(self, tag: object, reply: bytes, seconds: float) -> None:
        heapq.heappush(self._heap, (self.clock() + seconds, next(self._order), tag, reply))

    def due(self) -> list[tuple[object, bytes]]:
        """The held replies whose time has come, removed, in release order."""
        now = self.clock()
        out: list[tuple[object, bytes]] = []
        while self._heap and self._heap[0][0] <= now:
            _, _, tag, reply = heapq.heappop(self._heap)
            out.append((tag, reply))
        return out

    def wait_ms(self) -> int | None:
        """Milliseconds until the next release (at least 1), or None when nothing is held."""
        if not self._heap:
            return None
        return max(1, math.ceil((self._heap[0][0] - self.clock()) * 1000))


__all__ = ["MAX_HELD", "MAX_HOLD_S", "MIN_BYTES", "SENDER_FAULT", "Tarpit"]
