"""Recency that survives: no event dropped for a group being rebuilt, a policy change that keeps
what the old policy learnt, a restart (clean or kill -9) that finds the order it left, pins
honoured, and in-line eviction (``make_room``) by the group's own policy.

Driven against ``test_reclaimer.FakeManager`` with ``run_once(now)``; the restarts open a new
``Reclaimer`` on the same state dir (real files)."""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import CollectorRegistry

from kvcm.config import ReclaimConfig
from kvcm.reclaimer import Limits, Reclaimer
from tests.reclaimer.test_reclaimer import FakeManager, keys_of

LIM = {"g": Limits(quota=1000, used_percentage=0.85)}  # >= 850 of 1000: evict down to <= 800
ROOMY = {"g": Limits(quota=100_000, used_percentage=0.85)}  # the same group before its quota shrank


def _reclaimer(mgr: FakeManager, state_dir: str | None = None, limits: dict[str, Limits] | None = None) -> Reclaimer:
    lim = LIM if limits is None else limits
    return Reclaimer(mgr, lambda: lim, ReclaimConfig(hysteresis=0.05), registry=CollectorRegistry(),
                     state_dir=state_dir)


def _fill(mgr: FakeManager, keys: range, start: float = 1.0) -> None:
    for k in keys:
        mgr.write("i", k, now=start + k)


def test_reads_before_a_groups_first_round_count():
    """The group's state is stale until its first round rebuilds it; the reads buffered before
    it are applied after the rebuild, not dropped."""
    mgr = FakeManager(groups={"g": ["i"]})
    rec = _reclaimer(mgr)
    _fill(mgr, range(1, 11))
    mgr.read("i", [1, 2], now=20.0)
    assert keys_of(rec.run_once(21.0)) == [3, 4]  # not [1, 2]: least recently *written*


def test_a_policy_change_keeps_the_order_learnt():
    mgr = FakeManager(groups={"g": ["i"]})
    limits = {"g": Limits(policy="lru", quota=10_000, used_percentage=0.85)}
    rec = Reclaimer(mgr, lambda: limits, ReclaimConfig(hysteresis=0.05), registry=CollectorRegistry())
    rec.run_once(0.0)
    _fill(mgr, range(1, 11))
    mgr.read("i", [1, 2], now=20.0)
    rec.run_once(21.0)  # folded into LRU
    mgr.read("i", [3], now=22.0)  # buffered when the policy changes
    limits["g"] = Limits(policy="lfu", quota=1000, used_percentage=0.85)
    # LFU rebuilt in LRU's order (all counts equal, ties by recency), then the read of 3 counts
    assert keys_of(rec.run_once(23.0)) == [4, 5]


def test_clean_restart_finds_the_order_it_left(tmp_path: Any):
    state = str(tmp_path / "reclaim")
    mgr = FakeManager(groups={"g": ["i"]})
    rec = _reclaimer(mgr, state)
    rec.run_once(0.0)
    _fill(mgr, range(1, 11))
    mgr.read("i", [1, 2, 3], now=20.0)
    mgr.read("i", [1], now=20.5)
    rec.close()
    mgr.listeners.clear()
    again = _reclaimer(mgr, state)
    assert keys_of(again.run_once(21.0)) == [4, 5]
    # the whole order, not just its head: 6..10 then 2, 3, 1
    assert list(again.tracked("g", "file").victims(10, 21.0)) == [("i", k) for k in (6, 7, 8, 9, 10, 2, 3, 1)]


def test_kill_loses_at_most_the_round_not_yet_journalled(tmp_path: Any):
    state = str(tmp_path / "reclaim")
    mgr = FakeManager(groups={"g": ["i"]})
    rec = _reclaimer(mgr, state, ROOMY)
    rec.run_once(0.0)
    _fill(mgr, range(1, 11))
    mgr.read("i", [1, 2], now=20.0)
    rec.run_once(20.5)  # journalled (no snapshot yet: journal only)
    mgr.read("i", [3, 4], now=21.0)  # buffered, never journalled: lost with the process
    mgr.listeners.clear()  # "kill -9": no close()
    assert not os.path.exists(os.path.join(state, "snapshot"))
    mgr.write("i", 11, now=22.0)  # committed, its event lost with the process too
    again = _reclaimer(mgr, state)
    report = again.run_once(30.0)
    assert keys_of(report) == [3, 4, 5]  # 1 and 2 kept their reads; 11, found in the store, goes last
    assert list(again.tracked("g", "file").victims(10, 30.0))[-3:] == [("i", 1), ("i", 2), ("i", 11)]


def test_a_torn_journal_tail_and_a_damaged_snapshot_are_survived(tmp_path: Any):
    state = str(tmp_path / "reclaim")
    mgr = FakeManager(groups={"g": ["i"]})
    rec = _reclaimer(mgr, state, ROOMY)
    rec.run_once(0.0)
    _fill(mgr, range(1, 11))
    mgr.read("i", [1, 2], now=20.0)
    rec.run_once(20.5)
    mgr.listeners.clear()
    with open(os.path.join(state, "journal.0"), "ab") as f:
        f.write(b"\x92\x93\x01")  # a round cut short mid-write
    again = _reclaimer(mgr, state)
    assert keys_of(again.run_once(21.0)) == [3, 4]  # the whole rounds before the tear count
    again.close()
    mgr.listeners.clear()
    with open(os.path.join(state, "snapshot"), "wb") as f:
        f.write(b"not msgpack at all \xc1")
    third = _reclaimer(mgr, state)
    report = third.run_once(22.0)  # rebuilt from the store (write order), not a crash
    assert report.victims == [] and len(third.tracked("g", "file")) == 8
    assert os.path.exists(os.path.join(state, "snapshot.bad"))


def test_restart_under_another_policy_carries_the_order(tmp_path: Any):
    state = str(tmp_path / "reclaim")
    mgr = FakeManager(groups={"g": ["i"]})
    rec = _reclaimer(mgr, state)
    rec.run_once(0.0)
    _fill(mgr, range(1, 11))
    mgr.read("i", [1, 2], now=20.0)
    rec.close()
    mgr.listeners.clear()
    again = _reclaimer(mgr, state, {"g": Limits(policy="lfu", quota=1000, used_percentage=0.85)})
    assert keys_of(again.run_once(21.0)) == [3, 4]


class _Pins:
    def __init__(self) -> None:
        self.keys: dict[tuple[str, int], float] = {}

    def is_pinned(self, instance_id: str, key: int, now: float) -> bool:
        return self.keys.get((instance_id, key), -1.0) > now


class _Pinned(FakeManager):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.pins = _Pins()


def test_pinned_blocks_are_passed_over_until_their_pin_expires():
    mgr = _Pinned(groups={"g": ["i"]})
    rec = _reclaimer(mgr)
    rec.run_once(0.0)
    _fill(mgr, range(1, 11))
    mgr.pins.keys[("i", 1)] = 100.0
    mgr.pins.keys[("i", 2)] = 100.0
    assert keys_of(rec.run_once(20.0)) == [3, 4]
    _fill(mgr, range(11, 13), start=10.0)
    assert keys_of(rec.run_once(150.0)) == [1, 2]  # expired: the coldest again


def test_pins_hold_against_ttl_expiry_too():
    mgr = _Pinned(groups={"g": ["i"]})
    rec = _reclaimer(mgr, limits={"g": Limits(policy="ttl", ttl_seconds=5.0)})
    rec.run_once(0.0)
    _fill(mgr, range(1, 4), start=0.0)
    mgr.pins.keys[("i", 2)] = 100.0
    assert sorted(keys_of(rec.run_once(10.0))) == [1, 3]
    assert ("i", 2) in rec.tracked("g", "file")


def test_make_room_evicts_by_policy_just_enough_and_gives_back():
    mgr = _Pinned(groups={"g": ["i"]})
    rec = _reclaimer(mgr)
    rec.run_once(0.0)
    _fill(mgr, range(1, 9))  # 800 B: under the watermark, the reclaimer does nothing
    mgr.read("i", [1], now=20.0)  # buffered: make_room folds it in first
    mgr.pins.keys[("i", 2)] = 1e12
    room = rec.make_room("g", {"": 250}, limit=10)
    assert room.victims == [("i", 3, "file"), ("i", 4, "file"), ("i", 5, "file")]
    assert "1 pinned" in room.why
    assert ("i", 3) not in rec.tracked("g", "file")
    assert rec.make_room("g", {"file": 10_000}, limit=2).victims == [("i", 6, "file"), ("i", 7, "file")]
    rec.on_evicted("i", [7], 0.0)  # 7 committed: nothing to give back any more
    rec.give_back([("i", 6, "file"), ("i", 7, "file")])  # that transaction did not commit: 6 still serves
    assert ("i", 6) in rec.tracked("g", "file") and ("i", 7) not in rec.tracked("g", "file")
    blocks = rec.metrics.blocks.labels("g", "file", "lru", "inline")._value.get()
    assert blocks == 5
    assert rec.make_room("nope", {"": 1}, limit=1).victims == []


def test_in_line_victims_are_journalled_when_chosen_and_their_removal_not_folded_twice(tmp_path: Any):
    """make_room forgets its victims and journals that at once; the cache's report of their
    removal (on commit) is then not queued again. A victim written again afterwards goes to
    the back of the order, after a kill -9 too (the replayed journal has the removal between
    its two writes; without it, the second write would be taken for one already known)."""
    state = str(tmp_path / "reclaim")
    mgr = FakeManager(groups={"g": ["i"]})
    rec = _reclaimer(mgr, state, ROOMY)
    rec.run_once(0.0)
    _fill(mgr, range(1, 11))
    rec.run_once(20.0)  # journalled
    room = rec.make_room("g", {"": 250}, limit=10)
    victims = [key for _, key, _ in room.victims]
    assert victims == [1, 2, 3]
    mgr.evict("i", victims, "file")  # the cache drops them and, on commit, reports the removal ...
    rec.on_evicted("i", victims, 0.0)  # ... and the eviction
    assert rec.queued() == 0
    mgr.write("i", 1, now=25.0)
    rec.run_once(26.0)  # journalled
    mgr.listeners.clear()  # "kill -9": no close()
    again = _reclaimer(mgr, state, ROOMY)
    again.run_once(30.0)
    assert list(again.tracked("g", "file").victims(10, 30.0)) == [("i", k) for k in (4, 5, 6, 7, 8, 9, 10, 1)]


def test_a_group_of_several_instances_restarts_in_order(tmp_path: Any):
    state = str(tmp_path / "reclaim")
    mgr = FakeManager(groups={"g": ["a", "b"]})
    rec = _reclaimer(mgr, state, ROOMY)
    rec.run_once(0.0)
    for k in range(1, 6):
        mgr.write("a", k, now=float(k))
        mgr.write("b", -k, now=float(k) + 0.5)  # block keys are int64: negative ones too
    mgr.read("a", [1], now=10.0)
    mgr.read("b", [-1], now=10.5)
    rec.run_once(11.0)
    before = rec.tracked("g", "file").victims(10, 11.0)
    rec.close()
    mgr.listeners.clear()
    again = _reclaimer(mgr, state, ROOMY)
    again.run_once(12.0)
    assert again.tracked("g", "file").victims(10, 12.0) == before
    assert before[-2:] == [("a", 1), ("b", -1)]
    assert os.path.exists(os.path.join(state, "snapshot"))


def test_without_a_state_dir_nothing_is_kept_for_a_journal():
    """With no state dir there is no journal to append to: what would go there (folded events,
    in-line victims) is dropped at each round instead of piling up for the process's life."""
    mgr = FakeManager(groups={"g": ["i"]})
    rec = _reclaimer(mgr, None, ROOMY)
    rec.run_once(0.0)
    _fill(mgr, range(1, 11))
    mgr.read("i", [1, 2], now=20.0)
    rec.make_room("g", {"": 250}, limit=10)
    rec.run_once(21.0)
    assert rec._journal == []
