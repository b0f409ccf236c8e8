"""Write-session expiry under clock jumps, with injected clocks: deadlines run
on the monotonic clock, and the persisted wall-clock deadline only matters across a restart."""

from __future__ import annotations

from kvcm.backends.metastore import MemoryStore
from kvcm.cache.sessions import Sessions


class Clocks:
    def __init__(self) -> None:
        self.wall = 1_700_000_000.0
        self.mono = 100.0

    def sessions(self) -> Sessions:
        return Sessions(clock=lambda: self.wall, monotonic=lambda: self.mono)


def _open(store: MemoryStore, sessions: Sessions, timeout: float) -> str:
    with store.write() as txn:
        return sessions.create(txn, "inst", "g", [1, 2], ["a", "b"], timeout).id


def test_wall_clock_jumps_neither_expire_nor_extend_open_sessions():
    store, clocks = MemoryStore(), Clocks()
    sessions = clocks.sessions()
    sid = _open(store, sessions, timeout=30)
    clocks.wall += 86_400  # +1 day: nothing expires early
    clocks.mono += 10
    assert sessions.due() == [] and not sessions.is_due(sid)
    clocks.wall -= 86_400 + 3_600  # -1 hour from the start: nothing sticks either
    clocks.mono += 21
    assert sessions.is_due(sid) and sessions.due() == [sid]


def test_restart_keeps_the_rest_of_a_lifetime_clamped_to_the_timeout():
    store, clocks = MemoryStore(), Clocks()
    sid = _open(store, clocks.sessions(), timeout=30)
    clocks.wall += 10  # 20 s of the lifetime left when kvcm restarts
    clocks.mono = 5.0  # a new process: an unrelated monotonic origin
    with store.read() as view:
        later = clocks.sessions()
        assert later.load(view) == 1
    clocks.mono += 19
    assert later.due() == []
    clocks.mono += 2
    assert later.due() == [sid]
    # a clock set back by an hour before the restart cannot stretch a session past its timeout
    sid2 = _open(store, later, timeout=30)
    clocks.wall -= 3_600
    with store.read() as view:
        again = clocks.sessions()
        again.load(view)
    clocks.mono += 31
    assert sid2 in again.due()
    # and one whose wall-clock deadline passed while kvcm was down is due at once
    sid3 = _open(store, again, timeout=30)
    clocks.wall += 86_400
    with store.read() as view:
        last = clocks.sessions()
        last.load(view)
    assert sid3 in last.due()
