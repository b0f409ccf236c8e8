"""Crash tests with a real ``kvcm serve`` subprocess killed with SIGKILL.

After every restart: no acknowledged write is missing, no ``writing`` location outlives its
session, the persisted usage equals a recount from the block records, and every storage agrees
with the metadata both ways (checked in-process with ``CacheManager.check`` on the same data dir
once the subprocess is gone). ``test_crash_packed`` does the same with real bytes.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import threading
import time

import pytest

from kvcm.errors import CapacityError, KvcmError
from kvcm.testing import serve_in_thread, start_subprocess, stop_subprocess
from tests.helpers import add_group, finish, register, start, wait_for

FAST = ["--set", "cache.session_check_ms=50", "--set", "cache.delete_poll_ms=20"]


@pytest.fixture
def sock_dir():
    path = tempfile.mkdtemp(prefix="kvcm-crash-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _start(data, sock_dir):
    return start_subprocess(data, f"ipc://{sock_dir}/rpc", FAST)


def _served(c, instance, keys):
    found = c.call("get_cache_location", {"instance_id": instance, "query_type": "batch_get", "block_keys": keys})
    return {k for k, loc in zip(keys, found["locations"]) if loc["location_specs"][0]["uri"]}


def _check_offline(data, instance=None, acked=()):
    """Consistency of the data dir, after the writing sessions of the crashed run expired."""
    # No reclaimer: check() needs a quiet index, and a round evicting meanwhile is a write in progress.
    quiet = {"cache": {"session_check_ms": 50, "delete_poll_ms": 20}, "reclaim": {"enabled": False}}
    with serve_in_thread(data_dir=data, overrides=quiet) as srv:
        cache = srv.app.cache
        if acked:
            keys = sorted(acked)
            with srv.client() as c:
                found = set().union(*(_served(c, instance, keys[i:i + 1000]) for i in range(0, len(keys), 1000)))
            assert found == set(acked), f"{len(set(acked) - found)} acknowledged writes lost"
        wait_for(lambda: len(cache.sessions) == 0 and cache.deleter.pending() == 0, timeout=30)
        cache.check()  # usage == recount, no writing copy without its session, index invariants


def test_kill_between_start_and_finish(tmp_path, sock_dir):
    data = str(tmp_path / "data")
    server = _start(data, sock_dir)
    try:
        with server.client() as c:
            add_group(c, "g", ["default-file"], delay_ms=0)
            register(c, "inst", group="g")
            acked = start(c, [1, 2, 3], "inst")
            finish(c, acked, instance="inst")
            pending = start(c, [4, 5], "inst", write_timeout_seconds=30)
            doomed = start(c, [6, 7], "inst", write_timeout_seconds=1)
    finally:
        stop_subprocess(server, kill=True)
    server = _start(data, sock_dir)
    try:
        with server.client() as c:
            assert _served(c, "inst", [1, 2, 3]) == {1, 2, 3}
            assert _served(c, "inst", [4, 5, 6, 7]) == set()  # writing blocks stay invisible
            finish(c, pending, instance="inst")  # the session survived the crash
            assert _served(c, "inst", [4, 5]) == {4, 5}
            # the short session expires on time after the restart: its blocks are freed
            wait_for(lambda: c.call("get_cache_meta", {"instance_id": "inst", "block_keys": [6, 7]})["metas"][0]
                     ["status"] == "not_found")
            with pytest.raises(KvcmError) as info:
                finish(c, doomed, instance="inst")
            assert info.value.code.name in ("WRITE_SESSION_EXPIRED", "WRITE_SESSION_UNKNOWN")
    finally:
        stop_subprocess(server, kill=True)
    _check_offline(data)


class Writers:
    """Threads writing 1–16 fresh keys per start/finish pair; records what was acknowledged."""

    def __init__(self, endpoint: str, instance: str, n: int, seed: int, over_quota_ok: bool = False) -> None:
        self.endpoint, self.instance = endpoint, instance
        self.over_quota_ok = over_quota_ok  # QUOTA_EXCEEDED: wait for the reclaimer and go on
        self.acked: set[int] = set()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(random.Random(seed * 100 + i),), daemon=True)
                        for i in range(n)]

    def _run(self, rng: random.Random) -> None:
        from kvcm.client import Client

        with Client(self.endpoint, timeout=2.0, retries=0) as c:
            while not self.stop.is_set():
                keys = [rng.getrandbits(62) for _ in range(rng.randint(1, 16))]
                try:
                    session = start(c, keys, self.instance, write_timeout_seconds=1)
                    finish(c, session, instance=self.instance)
                except CapacityError:
                    if not self.over_quota_ok:
                        raise
                    time.sleep(0.01)  # pacing: back off while the group is full
                    continue
                except KvcmError:
                    return  # the server died: a reply that never came is not an acknowledgement
                with self.lock:
                    self.acked.update(keys)

    def run_for(self, seconds: float) -> None:
        for t in self.threads:
            t.start()
        time.sleep(seconds)  # the load's length, not a wait for anything: not scaled


def test_kill_during_write_bursts(tmp_path, sock_dir):
    data = str(tmp_path / "data")
    acked: set[int] = set()
    rng = random.Random(11)
    for cycle in range(3):
        server = _start(data, sock_dir)
        try:
            with server.client() as c:
                if cycle == 0:
                    add_group(c, "g", ["default-file"], delay_ms=0)
                    register(c, "burst", group="g")
                else:
                    keys = sorted(acked)
                    found = set()
                    for i in range(0, len(keys), 1000):
                        found |= _served(c, "burst", keys[i:i + 1000])
                    assert found == acked, f"{len(acked - found)} acknowledged writes lost in cycle {cycle}"
            writers = Writers(server.endpoint, "burst", 6, seed=cycle)
            writers.run_for(rng.uniform(0.4, 1.0))
        finally:
            stop_subprocess(server, kill=True)
        writers.stop.set()
        for t in writers.threads:
            t.join(10)
        with writers.lock:
            acked |= writers.acked
        _check_offline(data, "burst", acked)  # after every kill, storages compared with the metadata too
    assert acked  # the bursts did write something


def test_kill_during_eviction(tmp_path, sock_dir):
    """F3: writers keep a quota'd group above its watermark, so the reclaimer evicts all the time;
    SIGKILL at a random moment, three times. The store stays consistent (usage equals a recount,
    no record without its index entries), and after the restart eviction goes on."""
    data = str(tmp_path / "data")
    spec_bytes, quota_blocks = 1024, 200
    capacity = quota_blocks * 2 * spec_bytes  # two specs per block
    rng = random.Random(5)
    for cycle in range(3):
        server = start_subprocess(data, f"ipc://{sock_dir}/rpc", [*FAST, "--set", "reclaim.interval_s=0.02"])
        try:
            with server.client() as c:
                if cycle == 0:
                    c.call("create_instance_group", {"instance_group": {
                        "name": "ev", "storage_candidates": ["default-file"], "quota": {"capacity": capacity},
                        "reclaim_strategy": {"reclaim_policy": "lru", "used_percentage": 0.5,
                                             "delay_before_delete_ms": 0}}})
                    register(c, "ev", group="ev")
            writers = Writers(server.endpoint, "ev", 4, seed=cycle, over_quota_ok=True)
            writers.run_for(rng.uniform(0.5, 1.2))
            with server.client() as c:  # the kill below lands while evicting
                metrics = c.call("get_metrics")["metrics"]
            assert sum(x["value"] for x in metrics.get("kvcm_reclaim_blocks_total", [])) > 0
        finally:
            stop_subprocess(server, kill=True)
        writers.stop.set()
        for t in writers.threads:
            t.join(10)
        assert writers.acked  # each cycle wrote, so the group went over its watermark
        _check_offline(data)
    with serve_in_thread(data_dir=data, overrides={"reclaim": {"interval_s": 0.02}}) as srv:
        assert wait_for(lambda: srv.app.cache.usage("ev")["bytes"] <= 0.5 * capacity, timeout=30)


def test_sigterm_under_load_drains_and_loses_nothing(tmp_path, sock_dir):
    """F4: SIGTERM while 6 writers run. The server answers what it already received, exits 0
    within its grace period, and after a restart every acknowledged write is there."""
    data = str(tmp_path / "data")
    server = _start(data, sock_dir)
    with server.client() as c:
        add_group(c, "g", ["default-file"], delay_ms=0)
        register(c, "term", group="g")
    writers = Writers(server.endpoint, "term", 6, seed=4)
    writers.run_for(0.8)
    began = time.monotonic()
    code = stop_subprocess(server)  # SIGTERM
    assert code == 0
    assert time.monotonic() - began < 15  # server.shutdown_grace_s is 10 s
    writers.stop.set()
    for t in writers.threads:
        t.join(10)
    assert writers.acked
    _check_offline(data, "term", writers.acked)
