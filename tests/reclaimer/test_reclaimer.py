"""The reclaimer: victim order per policy, watermarks, quotas, fairness, runtime changes.

Unit tests drive ``Reclaimer.run_once(now)`` against :class:`FakeManager`, an in-test stand-in
for ``CacheManager``'s reclaimer hooks (no thread, no sockets, no sleeping). The live tests at
the bottom run a real server.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from kvcm.config import ReclaimConfig
from kvcm.reclaimer import Limits, Reclaimer

# -- a fake cache manager ----------------------------------------------------------------------


@dataclass
class Loc:
    nbytes: int
    status: str  # writing | serving | deleting
    written_at: float
    parent: int | None = None
    deleting_since: float = 0.0


@dataclass
class FakeManager:
    """Blocks per (instance, key, storage type); a deleter that frees after ``delay`` seconds."""

    groups: dict[str, list[str]] = field(default_factory=dict)  # group -> instances
    delay: float = 0.0
    now: float = 0.0
    locs: dict[tuple[str, int, str], Loc] = field(default_factory=dict)
    listeners: list[object] = field(default_factory=list)
    evicted: list[tuple[str, int, str]] = field(default_factory=list)

    def clock(self) -> float:
        return self.now

    def add_listener(self, listener: object) -> None:
        self.listeners.append(listener)

    def group_of(self, iid: str) -> str:
        return next(g for g, members in self.groups.items() if iid in members)

    # what clients do
    def write(self, iid: str, key: int, nbytes: int = 100, stype: str = "file", parent: int | None = None,
              now: float | None = None) -> None:
        now = self.now if now is None else now
        self.locs[(iid, key, stype)] = Loc(nbytes, "serving", now, parent)
        for lst in self.listeners:
            lst.on_serving(iid, key, nbytes, stype, parent, now)

    def start_write(self, iid: str, key: int, nbytes: int = 100, stype: str = "file") -> None:
        self.locs[(iid, key, stype)] = Loc(nbytes, "writing", self.now)

    def read(self, iid: str, keys: list[int], now: float | None = None) -> None:
        now = self.now if now is None else now
        hits = [k for k in keys if any(loc.status == "serving" for (i, kk, _), loc in self.locs.items() if i == iid and kk == k)]
        for lst in self.listeners:
            lst.on_read(iid, hits, now)

    # reclaimer hooks
    def usage(self, group: str) -> dict:
        members = self.groups[group]
        out: dict = {"bytes": 0, "keys": 0, "by_type": {}}
        for (iid, _, stype), loc in self.locs.items():
            if iid in members:
                out["bytes"] += loc.nbytes
                out["keys"] += 1
                t = out["by_type"].setdefault(stype, {"bytes": 0, "keys": 0})
                t["bytes"] += loc.nbytes
                t["keys"] += 1
        return out

    def evict(self, iid: str, keys: list[int], storage_type: str | None = None) -> int:
        freed = 0
        for key in keys:
            for (i, k, t), loc in self.locs.items():
                if i == iid and k == key and storage_type in (None, t) and loc.status == "serving":
                    loc.status, loc.deleting_since = "deleting", self.now
                    freed += loc.nbytes
                    self.evicted.append((iid, key, t))
        # as the real manager: a key is reported removed once no copy of it is serving
        gone = [k for k in keys if not any(i == iid and kk == k and loc.status == "serving"
                                           for (i, kk, _), loc in self.locs.items())]
        for lst in self.listeners:
            lst.on_removed(iid, gone)
        if self.delay == 0:
            self.run_deleter()
        return freed

    def run_deleter(self) -> None:
        """Free what was marked ``deleting`` at least ``delay`` seconds ago."""
        for k in [k for k, loc in self.locs.items() if loc.status == "deleting" and loc.deleting_since + self.delay <= self.now]:
            del self.locs[k]

    def instances_of_group(self, group: str) -> list[str]:
        return list(self.groups.get(group, []))

    def serving_keys(self, iid: str) -> Iterator[tuple[int, int, str, float]]:
        for (i, key, stype), loc in list(self.locs.items()):
            if i == iid and loc.status == "serving":
                yield key, loc.nbytes, stype, loc.written_at


def setup(limits: dict[str, Limits] | None = None, **cfg) -> tuple[FakeManager, Reclaimer, dict[str, Limits]]:
    """A fake manager with group ``g`` (instance ``i``) and a started reclaimer (state built)."""
    mgr = FakeManager(groups={"g": ["i"]})
    # default: reclaim at >= 850 of 1000 bytes, down to <= 800 (10 blocks of 100 B fill the quota)
    lim = limits if limits is not None else {"g": Limits(quota=1000, used_percentage=0.85)}
    cfg.setdefault("hysteresis", 0.05)
    rec = Reclaimer(mgr, lambda: lim, ReclaimConfig(**cfg), registry=CollectorRegistry())
    rec.run_once(0.0)
    return mgr, rec, lim


def keys_of(report) -> list[int]:
    return [ikey[1] for _, _, ikey, _ in report.victims]


# -- victim order per policy --------------------------------------------------------------------


def test_lru_evicts_least_recently_read_not_least_recently_written():
    mgr, rec, _ = setup()
    for k in range(1, 11):  # 10 x 100 B = the whole quota
        mgr.write("i", k, now=float(k))
    mgr.read("i", [1, 2], now=11.0)
    report = rec.run_once(12.0)
    assert keys_of(report) == [3, 4]  # 1 and 2 were written first but read since
    assert mgr.usage("g")["bytes"] == 800
    assert rec.run_once(13.0).victims == []  # at the watermark's low mark: nothing more


def test_lru_order_continues_across_rounds():
    mgr, rec, _ = setup()
    for k in range(1, 11):
        mgr.write("i", k, now=float(k))
    mgr.read("i", [5, 3, 1], now=11.0)
    assert keys_of(rec.run_once(12.0)) == [2, 4]
    mgr.write("i", 11, now=13.0)
    mgr.write("i", 12, now=14.0)
    assert keys_of(rec.run_once(15.0)) == [6, 7]


def test_lfu_keeps_the_hot_key():
    mgr, rec, _ = setup({"g": Limits(policy="lfu", quota=500, used_percentage=0.9)})
    for k in range(1, 6):
        mgr.write("i", k, now=float(k))
    for t in range(10):
        mgr.read("i", [1], now=6.0 + t)  # hot, and the oldest written
    mgr.read("i", [3], now=20.0)
    mgr.read("i", [3], now=21.0)
    mgr.read("i", [5], now=22.0)
    report = rec.run_once(23.0)
    assert keys_of(report) == [2]  # 500 -> <= 425: one victim, the least used
    mgr.write("i", 6, now=24.0)
    mgr.write("i", 7, now=25.0)
    assert keys_of(rec.run_once(26.0)) == [4, 6]  # counts 1, 1 (older first); 1, 3, 5 stay
    assert {k for (_, k, _) in mgr.locs} == {1, 3, 5, 7}


def test_ttl_reclaims_by_age_below_the_watermark():
    mgr, rec, _ = setup({"g": Limits(policy="ttl", ttl_seconds=100, quota=10**9, used_percentage=0.9)})
    mgr.write("i", 1, now=0.0)
    mgr.write("i", 2, now=50.0)
    mgr.write("i", 3, now=90.0)
    mgr.read("i", [1], now=95.0)  # a read does not extend a TTL
    assert rec.run_once(99.0).victims == []
    report = rec.run_once(120.0)
    assert keys_of(report) == [1]
    assert report.victims[0][3] == "ttl" and report.triggered == []  # far below the watermark
    assert keys_of(rec.run_once(155.0)) == [2]
    assert keys_of(rec.run_once(190.0)) == [3]


def test_ttl_applies_alongside_another_policy():
    mgr, rec, _ = setup({"g": Limits(policy="lru", ttl_seconds=10, quota=10**9)})
    mgr.write("i", 1, now=1.0)
    mgr.write("i", 2, now=5.0)
    mgr.read("i", [1], now=9.0)  # refreshes LRU recency, not the TTL
    assert keys_of(rec.run_once(12.0)) == [1]
    assert 1 not in {ikey[1] for ikey in rec.tracked("g", "file").sizes}
    assert keys_of(rec.run_once(15.0)) == [2]


def test_leaf_lru_never_evicts_a_parent_while_a_child_remains():
    mgr, rec, _ = setup({"g": Limits(policy="leaf_lru", quota=600, used_percentage=0.99)})
    # two prompts sharing prefix 1: 1 -> 2 -> 3 and 1 -> 4 -> 5; 6 is a lone block
    for t, (k, parent) in enumerate([(1, None), (2, 1), (3, 2), (4, 1), (5, 4), (6, None)]):
        mgr.write("i", k, parent=parent, now=float(t))
    mgr.read("i", [1, 2, 3], now=10.0)  # prompt A is hot
    mgr.read("i", [6], now=11.0)
    order: list[int] = []
    for step in range(6):
        mgr.write("i", 100 + step, now=20.0 + step)  # one new block per round pushes one out
        rec.run_once(20.5 + step)
        order = [k for (_, k, _) in mgr.evicted]
    parents = {2: 1, 3: 2, 4: 1, 5: 4}
    for i, k in enumerate(order):  # no child of k is still around when k goes
        assert not [c for c, p in parents.items() if p == k and c not in order[:i]], (k, order)
    assert order[:3] == [5, 4, 3]  # B's suffix first, then A's, then...
    assert order.index(2) < order.index(1)


def test_leaf_lru_exact_victim_order():
    mgr, rec, _ = setup({"g": Limits(policy="leaf_lru", quota=1000, used_percentage=0.5)})
    for t, (k, parent) in enumerate([(1, None), (2, 1), (3, 2), (4, 1)]):
        mgr.write("i", k, parent=parent, now=float(t))
    mgr.read("i", [4], now=5.0)
    mgr.write("i", 5, now=6.0)  # 500 B: at the watermark; strictly below it takes one victim
    report = rec.run_once(7.0)
    assert keys_of(report) == [3]
    assert mgr.usage("g")["bytes"] == 400


# -- status, watermarks, hysteresis, in-flight --------------------------------------------------


def test_writing_locations_are_never_reclaimed():
    mgr, rec, _ = setup()
    mgr.start_write("i", 99, nbytes=900)  # pushes usage over the watermark on its own
    mgr.write("i", 1, now=1.0)
    rec.run_once(2.0)
    assert mgr.locs[("i", 99, "file")].status == "writing"
    assert ("i", 1, "file") not in mgr.locs  # the serving block went


def test_hysteresis_reclaims_below_the_watermark():
    mgr, rec, _ = setup(hysteresis=0.2)
    for k in range(1, 9):
        mgr.write("i", k, now=float(k))
    assert rec.run_once(9.0).victims == []  # 800 < 850
    mgr.write("i", 9, now=9.5)
    assert keys_of(rec.run_once(10.0)) == [1, 2, 3]  # 900 -> 600 <= (0.85 - 0.2) * 1000
    mgr.write("i", 10, now=11.0)
    mgr.write("i", 11, now=11.0)
    assert rec.run_once(12.0).victims == []  # 800: between the marks, no churn


def test_in_flight_bytes_do_not_double_count():
    mgr, rec, _ = setup({"g": Limits(quota=1000, used_percentage=0.85, delay_before_delete_ms=5000)})
    mgr.delay = 5.0  # the deleter frees 5 s after eviction
    for k in range(1, 11):
        mgr.write("i", k, now=float(k))
    mgr.now = 11.0
    assert keys_of(rec.run_once(11.0)) == [1, 2]
    mgr.now = 12.0
    assert rec.run_once(12.0).victims == []  # 1 and 2 still use bytes, but are already handled
    assert mgr.usage("g")["bytes"] == 1000
    mgr.now = 16.0
    mgr.run_deleter()
    assert mgr.usage("g")["bytes"] == 800
    assert rec.run_once(16.0).victims == []
    assert rec.run_once(18.0).victims == []  # past delay + grace: nothing left in flight
    assert sum(len(p) for p in rec._groups["g"].inflight.values()) == 0


def test_type_quota_evicts_only_that_type():
    lim = {"g": Limits(quota=10**9, type_quotas={"shm": 300}, used_percentage=1.0)}
    mgr, rec, _ = setup(lim)
    for k in range(1, 4):
        mgr.write("i", k, stype="shm", now=float(k))
        mgr.write("i", k, stype="file", now=float(k))
    assert [(v[1], v[2][1]) for v in rec.run_once(5.0).victims] == [("shm", 1)]
    assert len([1 for (_, _, t) in mgr.locs if t == "file"]) == 3


def test_group_quota_is_shared_fairly_across_types():
    mgr, rec, _ = setup({"g": Limits(quota=2000, used_percentage=0.55)})
    for k in range(1, 11):
        mgr.write("i", k, stype="file", now=float(k))
        mgr.write("i", 100 + k, nbytes=100, stype="shm", now=float(k))
    report = rec.run_once(20.0)  # 2000 used, low mark 1000: 500 from each type
    by_type = {t: [ik[1] for _, tt, ik, _ in report.victims if tt == t] for t in ("file", "shm")}
    assert by_type == {"file": [1, 2, 3, 4, 5], "shm": [101, 102, 103, 104, 105]}
    types_in_order = [t for _, t, _, _ in report.victims]
    assert types_in_order[:2] != ["file", "file"] or len(set(types_in_order)) == 2


def test_round_robin_across_types_and_groups_under_a_small_budget():
    mgr = FakeManager(groups={"a": ["ia"], "b": ["ib"]})
    lim = {"a": Limits(quota=100_000, used_percentage=0.01), "b": Limits(quota=100_000, used_percentage=0.01)}
    rec = Reclaimer(mgr, lambda: lim, ReclaimConfig(hysteresis=0.0, max_victims_per_round=20), registry=CollectorRegistry())
    rec.run_once(0.0)
    for k in range(50):
        mgr.write("ia", k, now=1.0 + k)
        mgr.write("ib", k, now=1.0 + k)
    report = rec.run_once(100.0)
    assert len(report.victims) == 20
    assert sum(1 for g, *_ in report.victims if g == "a") == 10  # neither group starves


def test_shortfall_of_one_type_moves_to_another():
    mgr, rec, _ = setup({"g": Limits(quota=1000, used_percentage=0.5)})
    for k in range(1, 6):
        mgr.write("i", k, stype="file", now=float(k))
    for k in range(6, 11):
        mgr.start_write("i", k, stype="shm")  # 500 B of shm, none of it serving
    report = rec.run_once(20.0)
    assert keys_of(report) == [1, 2, 3, 4, 5]  # shm cannot give back, file pays the group's debt


# -- runtime changes, start-up, metrics ---------------------------------------------------------


def test_runtime_watermark_quota_and_policy_changes_apply_next_tick():
    mgr, rec, lim = setup({"g": Limits(quota=1000, used_percentage=1.0)})
    for k in range(1, 9):
        mgr.write("i", k, now=float(k))
    mgr.read("i", [1], now=9.0)
    assert rec.run_once(10.0).victims == []
    lim["g"] = Limits(quota=1000, used_percentage=0.7)
    assert keys_of(rec.run_once(11.0)) == [2, 3]  # 800 -> <= 650
    lim["g"] = Limits(quota=500, used_percentage=0.7)  # quota shrinks: 600 -> <= 325
    assert keys_of(rec.run_once(12.0)) == [4, 5, 6]
    lim["g"] = Limits(policy="ttl", ttl_seconds=100, quota=500, used_percentage=0.7)
    mgr.write("i", 20, now=13.0)  # 400 >= 350: ttl orders by write time, reads don't count
    report = rec.run_once(14.0)
    assert keys_of(report) == [1]
    assert rec.tracked("g", "file").name == "ttl"
    samples = {s.name: s.value for m in rec.metrics.rebuilds.collect() for s in m.samples if s.name.endswith("_total")}
    assert samples["kvcm_reclaim_rebuilds_total"] == 2  # start-up, then the policy switch
    lim["g"] = Limits(policy="ttl", ttl_seconds=5, quota=500, used_percentage=0.7)  # in place
    assert sorted(keys_of(rec.run_once(14.5))) == [7, 8]
    assert rec.tracked("g", "file").ttl_seconds == 5


def test_start_up_rebuilds_from_serving_keys_in_write_order():
    mgr = FakeManager(groups={"g": ["i"]})
    for k, t in [(5, 3.0), (6, 1.0), (7, 2.0), (8, 4.0)]:
        mgr.write("i", k, now=t)  # no reclaimer yet: no listener
    mgr.start_write("i", 9)
    lim = {"g": Limits(quota=500, used_percentage=0.9)}
    rec = Reclaimer(mgr, lambda: lim, ReclaimConfig(hysteresis=0.05), registry=CollectorRegistry())
    assert keys_of(rec.run_once(10.0)) == [6]  # 500 -> <= 425: the oldest written
    assert len(rec.tracked("g", "file")) == 3


def test_leaf_lru_rebuild_uses_parents_when_the_store_gives_them():
    class WithParents(FakeManager):
        def serving_keys(self, iid):
            for key, nbytes, stype, written in super().serving_keys(iid):
                yield key, nbytes, stype, written, self.locs[(iid, key, stype)].parent

    mgr = WithParents(groups={"g": ["i"]})
    for t, (k, parent) in enumerate([(1, None), (2, 1), (3, 2), (4, None)]):
        mgr.write("i", k, parent=parent, now=float(t))
    lim = {"g": Limits(policy="leaf_lru", quota=400, used_percentage=0.9)}
    rec = Reclaimer(mgr, lambda: lim, ReclaimConfig(hysteresis=0.3), registry=CollectorRegistry())
    assert keys_of(rec.run_once(10.0)) == [3, 2]  # 400 -> <= 240: the chain's leaf, then its parent


class _Deleter:
    """Stand-in for kvcm.cache.deleter.Deleter's queue head, driven by the test."""

    def __init__(self) -> None:
        self.head: float | None = None

    def next_due(self) -> float | None:
        return self.head


def test_in_flight_bytes_follow_the_deleter_queue():
    mgr = FakeManager(groups={"g": ["i"]}, delay=5.0)
    mgr.deleter = _Deleter()  # type: ignore[attr-defined]
    lim = {"g": Limits(quota=1000, used_percentage=0.85, delay_before_delete_ms=5000)}
    rec = Reclaimer(mgr, lambda: lim, ReclaimConfig(hysteresis=0.05), registry=CollectorRegistry())
    rec.run_once(0.0)
    for k in range(1, 11):
        mgr.write("i", k, now=float(k))
    mgr.now = 11.0
    assert keys_of(rec.run_once(11.0)) == [1, 2]  # due at 16
    mgr.deleter.head = 16.0
    mgr.now = 30.0  # long past the delay, but the deleter lags: its head is still at our entries
    assert rec.run_once(30.0).victims == []
    mgr.run_deleter()
    mgr.deleter.head = None  # queue drained; usage counters may lag one commit callback...
    assert rec.run_once(31.0).victims == []
    assert rec.run_once(32.0).victims == []  # ... so the entry goes a round later
    assert rec._groups["g"].inflight["file"] == []
    mgr.write("i", 11, now=33.0)
    mgr.write("i", 12, now=33.0)
    assert keys_of(rec.run_once(34.0)) == [3, 4]  # back to plain watermark work


def test_new_instance_and_group_at_runtime():
    mgr, rec, lim = setup()
    mgr.groups["g"].append("j")  # registered after the last sync
    for k in range(10):
        mgr.write("j", k, now=1.0 + k)
    assert keys_of(rec.run_once(20.0)) == [0, 1]
    mgr.groups["h"] = ["x"]
    lim["h"] = Limits(quota=100, used_percentage=0.5)
    mgr.write("x", 1, now=21.0)  # before the group is known: the rebuild picks it up
    assert [(g, ik) for g, _, ik, _ in rec.run_once(22.0).victims] == [("h", ("x", 1))]
    del lim["h"]
    rec.run_once(23.0)
    assert rec.tracked("h", "file") is None


def test_removed_blocks_leave_the_policy():
    mgr, rec, _ = setup()
    for k in range(1, 4):
        mgr.write("i", k, now=float(k))
    for listener in mgr.listeners:
        listener.on_removed("i", [1, 2])
    rec.run_once(5.0)
    assert {ik[1] for ik in rec.tracked("g", "file").sizes} == {3}


def test_a_read_folded_after_its_key_was_evicted_is_ignored():
    mgr, rec, _ = setup()
    for k in range(1, 11):
        mgr.write("i", k, now=float(k))
    assert keys_of(rec.run_once(11.0)) == [1, 2]
    for listener in mgr.listeners:  # a hit served just before the eviction, folded just after
        listener.on_read("i", [1, 2, 3], 10.5)
    mgr.write("i", 11, now=12.0)
    mgr.write("i", 12, now=12.0)
    assert keys_of(rec.run_once(13.0)) == [4, 5]  # 3 was read: it stays


def test_sampled_choice_stays_in_the_cold_half():
    mgr, rec, _ = setup({"g": Limits(quota=100_000, used_percentage=1.0)}, sample_size=16)
    for k in range(1000):
        mgr.write("i", k, nbytes=100, now=float(k))
    report = rec.run_once(2000.0)  # 100_000 -> 95_000: 50 victims out of 1000
    chosen = keys_of(report)
    assert len(chosen) == 50
    assert max(chosen) < 500, chosen  # each is the oldest of 16 random draws (seeded)
    assert chosen != list(range(50))  # ... but not the exact order


def test_metrics_families():
    mgr, rec, _ = setup()
    for k in range(1, 11):
        mgr.write("i", k, now=float(k))
    rec.run_once(12.0)
    totals = {s.labels["group"]: s.value for m in rec.metrics.group_usage_bytes.collect() for s in m.samples}
    assert totals == {"g": 1000}  # at round start
    by_type = [s for m in rec.metrics.usage_bytes.collect() for s in m.samples]
    assert by_type and all(s.labels["storage_type"] != "all" for s in by_type)
    assert sum(s.value for s in by_type) == 1000
    blocks = [s for m in rec.metrics.blocks.collect() for s in m.samples if s.name == "kvcm_reclaim_blocks_total"]
    assert blocks[0].value == 2 and blocks[0].labels["policy"] == "lru" and blocks[0].labels["reason"] == "watermark"
    freed = [s for m in rec.metrics.bytes.collect() for s in m.samples if s.name == "kvcm_reclaim_bytes_total"]
    assert freed[0].value == 200


# -- live: a real server ------------------------------------------------------------------------

BLOCK = 1024  # bytes per block (one spec)
QUOTA_BLOCKS = 64
WATERMARK = 0.5
DELAY_MS = 300  # the read lease: a location handed out stays readable this long after eviction
INTERVAL = 0.05


def _configure(c, policy: str = "lru") -> str:
    """Quota + strategy on the default group, one instance; returns the file storage's root."""
    group = c.call("get_instance_group", {"name": "default"})["instance_group"]
    c.call("update_instance_group", {"current_version": group["version"], "instance_group": {
        "name": "default", "quota": {"capacity": QUOTA_BLOCKS * BLOCK},
        "reclaim_strategy": {"reclaim_policy": policy, "used_percentage": WATERMARK,
                             "delay_before_delete_ms": DELAY_MS}}})
    c.call("register_instance", {"instance_group": "default", "instance_id": "live", "block_size": 4,
                                 "location_spec_infos": [{"name": "tp0", "size": BLOCK}],
                                 "model_deployment": {"model_name": "m", "dtype": "fp16"}})
    storage = next(s for s in c.call("list_storage")["storage"] if s["global_unique_name"] == "default-file")
    return storage["storage_spec"]["root_path"]


def _marker(key: int) -> bytes:
    return b"kvcm" + key.to_bytes(8, "big", signed=True)


def _slot(root: str, location: dict) -> tuple[str, int]:
    from kvcm.backends.storage.file import resolve_file_uri

    path, offset, _ = resolve_file_uri(location["location_specs"][0]["uri"], root)
    return path, offset


def _write_prompt(c, root: str, keys: list[int], finish: bool = True) -> str | None:
    """Two-phase write of ``keys`` with a marker in each block's slot; None when over quota."""
    from kvcm.errors import CapacityError

    try:
        reply = c.call("start_write_cache", {"instance_id": "live", "block_keys": keys})
    except CapacityError:
        return None
    assert reply["block_mask"] == {"offset": 0}, reply["block_mask"]  # all new
    for key, location in zip(keys, reply["locations"]):
        path, offset = _slot(root, location)
        with open(path, "r+b") as fh:
            fh.seek(offset)
            fh.write(_marker(key))
    if finish:
        c.call("finish_write_cache", {"instance_id": "live", "write_session_id": reply["write_session_id"],
                                      "success_blocks": {"offset": len(keys)}})
    return str(reply["write_session_id"])


def _check_read(c, root: str, keys: list[int]) -> tuple[int, list[str]]:
    """prefix_match, then read each returned slot at once: it must still hold that key's data."""
    locations = c.call("get_cache_location", {"instance_id": "live", "query_type": "prefix_match",
                                              "block_keys": keys})["locations"]
    errors = []
    for key, location in zip(keys, locations):
        path, offset = _slot(root, location)
        try:
            with open(path, "rb") as fh:
                fh.seek(offset)
                data = fh.read(12)
        except FileNotFoundError:
            errors.append(f"key {key}: {path} already freed")
            continue
        if data != _marker(key):
            errors.append(f"key {key}: slot holds {data!r}")
    return len(locations), errors


def test_live_reclaim_under_quota_below_watermark_and_reads_stay_valid():
    import threading
    import time

    from kvcm.cache.deleter import pending_bytes
    from kvcm.cache.usage import Usage
    from kvcm.testing import serve_in_thread
    from tests.helpers import wait_for

    quota = QUOTA_BLOCKS * BLOCK
    overrides = {"reclaim": {"interval_s": INTERVAL, "hysteresis": 0.05}, "cache": {"delete_poll_ms": 20}}
    with serve_in_thread(overrides=overrides) as srv:
        app = srv.app
        with srv.client() as c:
            root = _configure(c)
            hot = [1, 2, 3, 4]
            assert _write_prompt(c, root, hot)
            pending = _write_prompt(c, root, [900, 901], finish=False)  # stays ``writing`` throughout
            written: list[list[int]] = []
            stop = threading.Event()
            seen = {"peak": 0, "reads": 0, "hits": 0, "errors": [], "hot_reads": 0}

            def sample() -> None:
                # The quota bounds what is not on its way out: usage less the deleting copies'
                # bytes, both read from one snapshot so that they agree.
                while not stop.is_set():
                    with app.cache.store.read() as view:
                        used = Usage.group_used(view, "default")[0]
                        going = sum(n for (g, _), n in pending_bytes(view).items() if g == "default")
                    seen["peak"] = max(seen["peak"], used - going)
                    time.sleep(0.0005)  # sampling period

            def read() -> None:
                with srv.client() as rc:
                    while not stop.is_set():
                        # an older prompt, likely next to go (its reads race the eviction), then
                        # the hot one: at most a few blocks are ever more recent than it
                        for keys in (*written[-5:-4], hot):
                            hits, errors = _check_read(rc, root, keys)
                            seen["reads"] += 1
                            seen["hits"] += hits
                            seen["errors"] += errors
                            seen["hot_reads"] += keys is hot

            threads = [threading.Thread(target=sample), threading.Thread(target=read)]
            for t in threads:
                t.start()
            try:
                rejected, prompt, hot_reads = 0, 100, 0
                while len(written) < 60:  # 240 blocks through a 64-block quota
                    # Writes wait for a read of the hot prompt in between, whatever the thread
                    # scheduling: LRU must then keep it (the write rate alone cannot push it out).
                    while seen["hot_reads"] == hot_reads and threads[1].is_alive():
                        time.sleep(0.0005)  # until the reader thread's next hot read
                    hot_reads = seen["hot_reads"]
                    keys = [prompt * 10 + i for i in range(4)]
                    if _write_prompt(c, root, keys):
                        written.append(keys)
                        prompt += 1
                    else:
                        rejected += 1
                        time.sleep(INTERVAL)  # the hard quota: wait for the reclaimer
                rounds_at_stop = _rounds(app)
                wait_for(lambda: app.cache.usage("default")["bytes"] < WATERMARK * quota, timeout=60, interval=INTERVAL / 5)
                rounds_to_watermark = _rounds(app) - rounds_at_stop
            finally:
                stop.set()
                for t in threads:
                    t.join()
            assert seen["peak"] <= quota, seen
            # evict within a tick, then the deleter frees after DELAY_MS: a few ticks in all
            assert rounds_to_watermark <= DELAY_MS / 1000 / INTERVAL + 6, rounds_to_watermark
            assert seen["errors"] == [], seen["errors"][:5]
            assert seen["reads"] > 0 and seen["hits"] > 0, seen
            # reads refresh recency: the prompt read all along survived 240 writes through the quota
            assert _check_read(c, root, hot) == (4, [])
            # the block being written all along was never touched
            done = c.call("finish_write_cache", {"instance_id": "live", "write_session_id": pending,
                                                 "success_blocks": {"offset": 2}})
            assert done["served"] == 2, done
            blocks = _sample_value(app, "kvcm_reclaim_blocks_total")
            assert blocks >= 240 - QUOTA_BLOCKS, blocks
        def deleting() -> bool:
            with app.cache.store.read() as view:
                return bool(pending_bytes(view))

        wait_for(lambda: not deleting(), timeout=30)  # the last deletes finish: usage = recount then
        app.cache.check()


def _rounds(app) -> float:
    return _sample_value(app, "kvcm_reclaim_rounds_total")


def _sample_value(app, name: str) -> float:
    return sum(s.value for m in app.metrics.registry.collect() for s in m.samples if s.name == name)


def test_live_policy_change_applies_without_restart():
    from kvcm.testing import serve_in_thread
    from tests.helpers import wait_for

    with serve_in_thread(overrides={"reclaim": {"interval_s": INTERVAL}}) as srv:
        app = srv.app
        with srv.client() as c:
            root = _configure(c, policy="lru")
            for p in range(8):
                assert _write_prompt(c, root, [p * 10 + i for i in range(4)])
            group = c.call("get_instance_group", {"name": "default"})["instance_group"]
            c.call("update_instance_group", {"current_version": group["version"], "instance_group": {
                "name": "default", "reclaim_strategy": {"reclaim_policy": "ttl", "ttl_seconds": 1,
                                                        "used_percentage": 0.9, "delay_before_delete_ms": 0}}})
            wait_for(lambda: app.cache.usage("default")["bytes"] == 0, timeout=30, interval=INTERVAL)
            assert app.cache.usage("default")["bytes"] == 0  # TTL reclaimed all, far below the watermark
            assert app.reclaimer.tracked("default", "file").name == "ttl"
