"""An LMDB store read live by follower processes beside its one writer: the per-database versions
each commit counts, and :meth:`LmdbStore.follow` (read-only, no lock, no migration, map growth).

The cross-process cases run the writer in a real subprocess (:class:`Writer`), driven line by
line over stdin: an LMDB environment must not be opened twice in one process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import lmdb
import pytest

from kvcm.backends.metastore import DATABASES, DataDirLocked, LmdbStore
from kvcm.errors import Code, Unavailable

WRITER = r"""
import sys
from kvcm.backends.metastore import LmdbStore

store = LmdbStore(sys.argv[1], map_size=int(sys.argv[2]), sync=True)
with store.write() as txn:
    txn.put("meta", b"registry.schema", sys.argv[3].encode())
print("ready", flush=True)
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "put":  # put DB KEY SIZE: one commit
        db, key, size = args
        with store.write() as txn:
            txn.put(db, key.encode(), key.encode() * int(size))
    elif cmd == "fill":  # fill N SIZE: N commits of one SIZE-byte value each
        for i in range(int(args[0])):
            with store.write() as txn:
                txn.put("blocks", b"fill%05d" % i, b"x" * int(args[1]))
    print("ok", store.stats()["map_size"], flush=True)
store.close()
"""

READER = r"""
import sys, time
from kvcm.backends.metastore import LmdbStore

store = LmdbStore.follow(sys.argv[1])
with store.read() as view:
    print("holding", flush=True)
    time.sleep(60)
"""


class Writer:
    """A writer ``LmdbStore`` in its own process; each command answers once committed."""

    def __init__(self, path: str, map_size: int = 1 << 20, schema: str = "1") -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", WRITER, path, str(map_size), schema],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._line() == "ready"

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        assert line, f"the writer process ended (exit {self.proc.poll()})"
        return line

    def do(self, command: str) -> int:
        """Run one command; returns the writer's map size after it."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        word, size = self._line().split()
        assert word == "ok"
        return int(size)

    def stop(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def writer(tmp_path) -> Iterator[Writer]:
    w = Writer(str(tmp_path / "data"))
    yield w
    w.stop()


@pytest.fixture
def store(tmp_path) -> Iterator[LmdbStore]:
    s = LmdbStore(str(tmp_path / "w"), map_size=1 << 22, sync=False)
    yield s
    s.close()


def _versions(store: LmdbStore) -> dict[str, int]:
    return dict(zip(DATABASES, store.versions(DATABASES), strict=True))


def _moved(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {db: after[db] - before[db] for db in DATABASES if after[db] != before[db]}


# -- versions on the writer ----------------------------------------------------------------------


def test_versions_count_each_commit_per_database_it_wrote(store):
    assert store.versions(DATABASES) == (0,) * len(DATABASES)
    with store.write() as txn:
        txn.put("blocks", b"a", b"1")
    assert _versions(store)["blocks"] == 1 and sum(store.versions(DATABASES)) == 1
    before = _versions(store)
    with store.group():
        with store.write() as txn:
            txn.put("blocks", b"b", b"1")
            txn.put_many("runs", [(b"r", b"1")])
        with store.write() as txn:
            txn.put("blocks", b"c", b"1")  # a second write to blocks in the same commit counts once
    assert _moved(before, _versions(store)) == {"blocks": 1, "runs": 1}
    before = _versions(store)
    with store.write() as txn:
        txn.delete("sessions", b"none")  # attempted: counts
    with store.write() as txn:
        txn.drop("pins")
    with store.write() as txn:
        txn.put("meta", b"registry.defaults_created", b"1")  # a caller's write of meta counts
    assert _moved(before, _versions(store)) == {"sessions": 1, "pins": 1, "meta": 1}
    before = _versions(store)
    with store.write() as txn:  # read only: commits nothing new
        assert txn.get("blocks", b"a") == b"1"
    with store.group():
        pass
    assert _versions(store) == before
    assert store.versions(["runs", "blocks", "runs"]) == (1, 2, 1)  # in the order asked


def test_versions_survive_reopening(tmp_path):
    path = str(tmp_path / "w")
    first = LmdbStore(path, sync=False)
    for _ in range(2):
        with first.write() as txn:
            txn.put("groups", b"g", b"1")
    first.close()
    again = LmdbStore(path, sync=False)
    try:
        assert again.versions(["groups", "blocks"]) == (2, 0)
        with again.write() as txn:
            txn.put("groups", b"g", b"2")
        assert again.versions(["groups"]) == (3,)
    finally:
        again.close()


def test_a_store_nobody_follows_counts_nothing(tmp_path):
    """``count_versions=False`` (a kvcm without file coordination): commits write no version."""
    store = LmdbStore(str(tmp_path / "w"), sync=False, count_versions=False)
    try:
        with store.write() as txn:
            txn.put("groups", b"g", b"1")
        assert store.versions(["groups", "meta"]) == (0, 0)
        with store.read() as view:
            assert view.get("groups", b"g") == b"1"
    finally:
        store.close()


def test_rolled_back_savepoint_in_a_committed_group(store):
    before = _versions(store)
    with store.group():
        with store.write() as txn:
            txn.put("blocks", b"a", b"kept")
        with pytest.raises(RuntimeError), store.write() as txn:
            txn.put("blocks", b"a", b"undone")
            txn.put("sessions", b"s", b"undone")
            raise RuntimeError("this request fails")
        with store.write() as txn:
            assert txn.get("blocks", b"a") == b"kept" and txn.get("sessions", b"s") is None
    with store.read() as view:
        assert view.get("blocks", b"a") == b"kept" and view.get("sessions", b"s") is None
    # blocks was written by a savepoint that committed; sessions only by the rolled-back one
    assert _moved(before, _versions(store)) == {"blocks": 1}


def test_nested_rollback_forgets_only_its_own_databases(store):
    before = _versions(store)
    with store.group(), store.write() as outer:
        outer.put("runs", b"r", b"1")
        with pytest.raises(RuntimeError), store.write() as inner:
            inner.put("runs", b"r2", b"1")  # runs stays: the outer block wrote it first
            inner.put("pins", b"p", b"1")
            raise RuntimeError("inner fails")
        outer.put("usage", b"u", b"1")
    assert _moved(before, _versions(store)) == {"runs": 1, "usage": 1}


def test_aborted_group_bumps_nothing(store):
    before = _versions(store)
    with pytest.raises(RuntimeError), store.group():
        with store.write() as txn:
            txn.put("sessions", b"s", b"1")
        raise RuntimeError("the group aborts")
    with pytest.raises(RuntimeError), store.write() as txn:
        txn.put("deletes", b"d", b"1")
        raise RuntimeError("a lone write aborts")
    assert _versions(store) == before
    with store.write() as txn:  # the next commit counts only what it wrote itself
        txn.put("blocks", b"b", b"1")
    assert _moved(before, _versions(store)) == {"blocks": 1}
    with store.read() as view:
        assert view.get("sessions", b"s") is None and view.get("deletes", b"d") is None


# -- a follower of another process's writer -------------------------------------------------------


def test_follower_reads_each_commit_once_acknowledged(tmp_path, writer):
    follower = LmdbStore.follow(str(tmp_path / "data"))
    try:
        start = follower.versions(["blocks", "sessions"])
        assert start == (0, 0)
        for i in range(20):
            writer.do(f"put blocks k{i} 3")
            with follower.read() as view:  # a new read transaction: the latest commit
                assert view.get("blocks", f"k{i}".encode()) == f"k{i}".encode() * 3
            assert follower.versions(["blocks", "sessions"]) == (i + 1, 0)
        writer.do("put sessions s 1")
        assert follower.versions(["blocks", "sessions"]) == (20, 1)
    finally:
        follower.close()


def test_follower_follows_the_writer_growing_the_map(tmp_path, writer):
    follower = LmdbStore.follow(str(tmp_path / "data"))
    try:
        assert follower.stats()["map_size"] == 1 << 20
        grown = writer.do("fill 48 65536")  # 3 MiB in 48 commits: the writer doubles its map twice
        assert grown >= 4 << 20
        with follower.read() as view:
            assert view.get("blocks", b"fill00047") == b"x" * 65536
            assert view.count("blocks") == 48
        assert follower.stats()["map_size"] == grown
        writer.do("fill 80 65536")  # grows again; a follower's group is a read transaction too
        with follower.group(), follower.write() as txn:
            assert txn.get("blocks", b"fill00079") == b"x" * 65536
    finally:
        follower.close()


def test_follower_holding_a_transaction_through_growth_is_told_to_retry(tmp_path, writer):
    follower = LmdbStore.follow(str(tmp_path / "data"))
    refused: list[Unavailable] = []

    def nested() -> None:
        with follower.read() as old:
            writer.do("fill 48 65536")
            assert old.get("blocks", b"fill00000") is None  # its snapshot predates the fill
            try:
                with follower.read():
                    pass
            except Unavailable as exc:
                refused.append(exc)

    # In a thread: a remap that waited for this thread's own transaction would hang, not fail.
    thread = threading.Thread(target=nested, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the nested read waits for its own thread's transaction to end"
    try:
        assert len(refused) == 1 and "grew the LMDB map" in str(refused[0])
        assert refused[0].code == Code.SERVICE_NOT_READY
        with follower.read() as view:  # nothing live any more: it maps the new size
            assert view.get("blocks", b"fill00047") == b"x" * 65536
    finally:
        follower.close()


def test_follower_refuses_every_write(tmp_path, writer):
    writer.do("put blocks a 1")
    follower = LmdbStore.follow(str(tmp_path / "data"), reason="node-2 follows node-1")
    try:
        before = follower.versions(DATABASES)
        attempts = [
            lambda t: t.put("blocks", b"a", b"changed"),
            lambda t: t.put_many("blocks", [(b"b", b"1")]),
            lambda t: t.delete("blocks", b"a"),
            lambda t: t.delete_many("blocks", [b"a"]),
            lambda t: t.drop("blocks"),
        ]
        for attempt in attempts:
            with pytest.raises(Unavailable, match="node-2 follows node-1") as exc, follower.write() as txn:
                attempt(txn)
            assert exc.value.code == Code.SERVER_NOT_LEADER
        with pytest.raises(Unavailable) as exc, follower.group(), follower.write() as txn:
            txn.put("sessions", b"s", b"1")
        assert exc.value.code == Code.SERVER_NOT_LEADER
        with follower.write() as txn:  # a look that writes nothing (the registry's open) passes
            assert txn.get("meta", b"registry.schema") == b"1"
        assert follower.grow() is False
        with follower.read() as view:
            assert view.get("blocks", b"a") == b"a" and view.get("blocks", b"b") is None
            assert view.count("blocks") == 1 and view.count("sessions") == 0
        assert follower.versions(DATABASES) == before
    finally:
        follower.close()


def test_follower_before_the_env_exists(tmp_path):
    path = tmp_path / "data"
    with pytest.raises(Unavailable, match="no leader has initialised the store yet") as exc:
        LmdbStore.follow(str(path))
    assert exc.value.code == Code.SERVICE_NOT_READY
    assert not path.exists()  # it created nothing
    (path / "meta").mkdir(parents=True)
    with pytest.raises(Unavailable, match=r"no leader has initialised the store yet \(no meta/data.mdb\)") as exc:
        LmdbStore.follow(str(path))
    assert exc.value.code == Code.SERVICE_NOT_READY
    assert os.listdir(path / "meta") == []  # not even lock.mdb


def test_follower_before_a_database_exists(tmp_path):
    env_dir = tmp_path / "data" / "meta"
    env_dir.mkdir(parents=True)
    env = lmdb.open(str(env_dir), max_dbs=32, map_size=1 << 20)
    for name in DATABASES[:3]:  # a writer part way through creating them
        env.open_db(name.encode())
    env.close()
    with pytest.raises(Unavailable, match=f"no leader has initialised the store yet.*{DATABASES[3]}") as exc:
        LmdbStore.follow(str(tmp_path / "data"))
    assert exc.value.code == Code.SERVICE_NOT_READY
    env = lmdb.open(str(env_dir), max_dbs=32, map_size=1 << 20)
    with env.begin() as txn:
        assert txn.get(DATABASES[3].encode()) is None  # the follower did not create it
    env.close()


def test_follower_before_the_schema_is_written(tmp_path):
    LmdbStore(str(tmp_path / "data")).close()  # every database, but no registry.schema yet
    with pytest.raises(Unavailable, match=r"no leader has initialised the store yet.*no schema version") as exc:
        LmdbStore.follow(str(tmp_path / "data"))
    assert exc.value.code == Code.SERVICE_NOT_READY


@pytest.mark.parametrize("found", ["2", "0"])
def test_follower_refuses_another_schema_version(tmp_path, found):
    w = Writer(str(tmp_path / "data"), schema=found)
    try:
        with pytest.raises(Unavailable, match=f"schema version {found} found, this kvcm reads version 1") as exc:
            LmdbStore.follow(str(tmp_path / "data"))
        assert exc.value.code == Code.SERVICE_NOT_READY
        w.do("put blocks a 1")  # the writer is unaffected
    finally:
        w.stop()


def test_writer_and_follower_in_one_process(tmp_path, writer):
    own = LmdbStore(str(tmp_path / "own"), sync=False)
    follower = LmdbStore.follow(str(tmp_path / "data"))
    try:
        with own.write() as txn:
            txn.put("blocks", b"mine", b"1")
        writer.do("put blocks theirs 1")
        with follower.read() as view:
            assert view.get("blocks", b"mine") is None and view.get("blocks", b"theirs") == b"theirs"
        with own.read() as view:
            assert view.get("blocks", b"theirs") is None and view.get("blocks", b"mine") == b"1"
        assert own.versions(["blocks"]) == (1,) and follower.versions(["blocks"]) == (1,)
        # lmdb.h: one environment is never opened twice in one process (py-lmdb refuses it)
        for path in ("own", "data"):
            with pytest.raises(Unavailable, match="already open in this process") as exc:
                LmdbStore.follow(str(tmp_path / path))
            assert exc.value.code == Code.SERVICE_NOT_READY
        own.close()
        writer.do("put blocks later 1")
        with follower.read() as view:
            assert view.get("blocks", b"later") == b"later"
    finally:
        follower.close()
        own.close()


def test_writer_keeps_its_lock_while_followers_come_and_go(tmp_path, writer):
    data = tmp_path / "data"
    follower = LmdbStore.follow(str(data))
    with pytest.raises(DataDirLocked):
        LmdbStore(str(data))
    follower.close()
    assert (data / "kvcm.lock").exists()  # a follower's close drops no lock file
    with pytest.raises(DataDirLocked):
        LmdbStore(str(data))
    writer.do("put blocks a 1")  # and the writer writes on


def test_no_writer_of_a_data_dir_this_process_follows(tmp_path):
    data = tmp_path / "data"
    Writer(str(data)).stop()
    follower = LmdbStore.follow(str(data))
    with pytest.raises(lmdb.Error, match="already open in this process"):
        LmdbStore(str(data))
    follower.close()
    LmdbStore(str(data)).close()  # the refused writer did not keep kvcm.lock
    assert not (data / "kvcm.lock").exists()


def test_follower_clears_reader_slots_of_dead_followers(tmp_path, writer):
    dead = subprocess.Popen([sys.executable, "-c", READER, str(tmp_path / "data")], stdout=subprocess.PIPE, text=True)
    try:
        assert dead.stdout is not None and dead.stdout.readline().strip() == "holding"
    finally:
        os.kill(dead.pid, signal.SIGKILL)
        dead.wait()
    follower = LmdbStore.follow(str(tmp_path / "data"))
    try:
        assert follower.stale_readers_cleared == 1  # the killed follower's slot, at the open
        writer.do("put blocks a 1")
        with follower.read() as view:
            assert view.get("blocks", b"a") == b"a"
    finally:
        follower.close()
