"""kill -9 during write bursts with real bytes, on a packed ``file`` storage (256 blocks per file)
and the default storage: six cycles (forty in the slow run).

Clients write a pattern unique to each (instance, key, spec) at the URIs they were handed, then
finish; some remove blocks they wrote. After every kill the data dir is opened again and: every
acknowledged block is served with its bytes intact (no live file deleted, no slot handed out
twice), no removed block is served, usage equals a recount and ``check()`` finds every storage
in agreement with the metadata, and the files on disk are exactly the containers the storages
account (no orphan the sweep missed).
"""

from __future__ import annotations

import random
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field

import pytest

from kvcm.client import Client
from kvcm.errors import KvcmError
from kvcm.testing import serve_in_thread, start_subprocess, stop_subprocess
from tests.block_bytes import container_files, read_problems, served, storage_roots, write_session
from tests.helpers import add_group, register, start, wait_for

FAST = ["--set", "cache.session_check_ms=50", "--set", "cache.delete_poll_ms=20"]
QUIET = {"cache": {"session_check_ms": 50, "delete_poll_ms": 20}, "reclaim": {"enabled": False}}
SPECS = [{"name": "tp0", "size": 1024}, {"name": "tp1", "size": 1024}]
INSTANCES = {"pk": "packed", "df": "default-file"}  # instance -> the storage its group writes to


@dataclass
class Ledger:
    """What the clients know for sure: finished (acknowledged) and removed keys per instance.
    A key whose remove got no reply is in neither: it may or may not be served."""

    acked: dict[str, set[int]] = field(default_factory=lambda: {i: set() for i in INSTANCES})
    removed: dict[str, set[int]] = field(default_factory=lambda: {i: set() for i in INSTANCES})
    lock: threading.Lock = field(default_factory=threading.Lock)


class ByteWriters:
    """Threads writing 1-16 fresh keys per session with real bytes; one in seven rounds removes
    up to 8 keys the thread wrote before."""

    def __init__(self, endpoint: str, roots: dict[str, str], ledger: Ledger, n: int, seed: int) -> None:
        self.endpoint, self.roots, self.ledger = endpoint, roots, ledger
        self.stop = threading.Event()
        names = sorted(INSTANCES)
        self.threads = [threading.Thread(target=self._run, args=(names[i % len(names)], random.Random(seed * 100 + i)),
                                         daemon=True) for i in range(n)]

    def _run(self, instance: str, rng: random.Random) -> None:
        mine: list[int] = []
        # A short timeout: after the kill every thread waits this long for a reply that never comes.
        with Client(self.endpoint, timeout=1.0, retries=0) as c:
            while not self.stop.is_set():
                try:
                    if mine and rng.random() < 1 / 7:
                        self._remove(c, instance, mine, rng)
                    else:
                        mine.extend(self._write(c, instance, rng))
                except (KvcmError, OSError):
                    return  # the server died: a reply that never came acknowledges nothing

    def _write(self, c: Client, instance: str, rng: random.Random) -> list[int]:
        keys = [rng.getrandbits(62) for _ in range(rng.randint(1, 16))]
        session = start(c, keys, instance, write_timeout_seconds=1)
        write_session(session, instance, keys, self.roots)
        c.call("finish_write_cache", {"instance_id": instance, "write_session_id": session["write_session_id"],
                                      "success_blocks": {"offset": len(keys)}})
        with self.ledger.lock:
            self.ledger.acked[instance].update(keys)
        return keys

    def _remove(self, c: Client, instance: str, mine: list[int], rng: random.Random) -> None:
        doomed = [mine.pop(rng.randrange(len(mine))) for _ in range(min(len(mine), rng.randint(1, 8)))]
        with self.ledger.lock:
            self.ledger.acked[instance].difference_update(doomed)
        c.call("remove_cache", {"instance_id": instance, "block_keys": doomed})
        with self.ledger.lock:
            self.ledger.removed[instance].update(doomed)

    def run_for(self, seconds: float) -> None:
        for t in self.threads:
            t.start()
        time.sleep(seconds)  # the load's length, not a wait for anything: not scaled

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(10)


@pytest.fixture
def sock_dir():
    path = tempfile.mkdtemp(prefix="kvcm-crashp-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _setup(c, packed_root: str) -> None:
    c.call("add_storage", {"storage": {"global_unique_name": "packed", "storage_type": "file",
                                       "storage_spec": {"root_path": packed_root, "key_count_per_file": 256}}})
    for instance, storage in INSTANCES.items():
        add_group(c, f"g-{instance}", [storage], delay_ms=0)
        register(c, instance, group=f"g-{instance}", specs=SPECS)


def _check_after_kill(data: str, ledger: Ledger, cycle: int) -> None:
    """Open the data dir the killed server left; everything the clients know must hold."""
    with serve_in_thread(data_dir=data, overrides=QUIET) as srv, srv.client() as c:
        roots = storage_roots(c)
        for instance in INSTANCES:
            problems = read_problems(c, instance, ledger.acked[instance], roots)
            assert problems == [], f"cycle {cycle}: {len(problems)} problem(s) reading acknowledged blocks: " \
                                   f"{problems[:5]}"
            assert served(c, instance, ledger.removed[instance]) == set(), f"cycle {cycle}: removed blocks served"
        cache = srv.app.cache
        # The killed run's sessions expire and their blocks are freed; then the server is quiet.
        assert wait_for(lambda: len(cache.sessions) == 0 and cache.deleter.pending() == 0, timeout=30)
        cache.check()  # usage == recount, and every storage agrees with the metadata both ways
        for storage in set(INSTANCES.values()):
            inventory = cache.pool.get(storage).inventory()
            assert container_files(roots[storage]) == set(inventory.containers), \
                f"cycle {cycle}: files on disk of {storage!r} differ from its containers"


@pytest.mark.parametrize("cycles", [6, pytest.param(40, marks=[pytest.mark.slow, pytest.mark.timeout(900)])])
def test_kill_during_byte_bursts_on_packed_files(tmp_path, sock_dir, cycles):
    data, packed_root = str(tmp_path / "data"), str(tmp_path / "packed")
    ledger = Ledger()
    rng = random.Random(23)
    for cycle in range(cycles):
        server = start_subprocess(data, f"ipc://{sock_dir}/rpc", FAST)
        try:
            with server.client() as c:
                if cycle == 0:
                    _setup(c, packed_root)
                roots = storage_roots(c)
            writers = ByteWriters(server.endpoint, roots, ledger, 6, seed=cycle)
            writers.run_for(rng.uniform(0.3, 0.8))
        finally:
            stop_subprocess(server, kill=True)
        writers.join()
        _check_after_kill(data, ledger, cycle)
    assert all(ledger.acked.values()) and all(ledger.removed.values())  # both paths ran
    assert len(container_files(packed_root)) >= 2  # packed: several files, many blocks in each
