"""The MetaStore contract, run against LMDB and the in-memory twin."""

from __future__ import annotations

import pytest

from kvcm.backends.metastore import DataDirLocked, LmdbStore, from_i64, i64, u64
from kvcm.backends.metastore.base import MAX_KEY
from kvcm.errors import CapacityError, Code, InvalidArgument


def test_put_get_delete(store):
    with store.write() as txn:
        txn.put("blocks", b"k1", b"v1")
        txn.put_many("blocks", [(b"k2", b"v2"), (b"k3", b"v3")])
        assert txn.get("blocks", b"k2") == b"v2"  # own writes visible
    with store.read() as view:
        assert view.get_many("blocks", [b"k1", b"k3", b"nope"]) == [b"v1", b"v3", None]
        assert view.count("blocks") == 3
    with store.write() as txn:
        assert txn.delete("blocks", b"k1") is True
        assert txn.delete("blocks", b"k1") is False
        assert txn.delete_many("blocks", [b"k2", b"zz"]) == 1
    with store.read() as view:
        assert [k for k, _ in view.scan("blocks")] == [b"k3"]


def test_keys_outside_the_size_limit_are_absent_and_refused(store):
    """Found by the B6 fuzzer: looking up an empty storage name gave IO_ERROR (LMDB's
    MDB_BAD_VALSIZE) where "not found" is the answer; writing one must be a caller error."""
    bad = [b"", b"x" * (MAX_KEY + 1)]
    with store.write() as txn:
        txn.put("storages", b"x" * MAX_KEY, b"longest")
        for key in bad:
            assert txn.get("storages", key) is None
            assert txn.delete("storages", key) is False
        assert txn.get_many("storages", [*bad, b"x" * MAX_KEY]) == [None, None, b"longest"]
    with store.read() as view:
        assert view.get_many("storages", bad) == [None, None]
    for key in bad:
        with pytest.raises(InvalidArgument), store.write() as txn:
            txn.put("storages", key, b"v")
    with store.read() as view:
        assert [k for k, _ in view.scan("storages")] == [b"x" * MAX_KEY]


def test_databases_are_separate(store):
    with store.write() as txn:
        txn.put("blocks", b"a", b"1")
        txn.put("sessions", b"a", b"2")
    with store.read() as view:
        assert view.get("blocks", b"a") == b"1"
        assert view.get("sessions", b"a") == b"2"


def test_scan_is_ordered_with_prefix_start_and_limit(store):
    keys = [u64(i) for i in (5, 1, 300, 2**40, 7)]
    with store.write() as txn:
        txn.put_many("blocks", [(k, b"x") for k in keys])
        txn.put("blocks", b"\xff\xff", b"y")
    with store.read() as view:
        got = [k for k, _ in view.scan("blocks")]
        assert got == [*sorted(keys), b"\xff\xff"]
        assert [k for k, _ in view.scan("blocks", start=u64(6))][:2] == [u64(7), u64(300)]
        assert [k for k, _ in view.scan("blocks", prefix=b"\xff")] == [b"\xff\xff"]
        assert len(list(view.scan("blocks", limit=2))) == 2


def test_signed_keys_sort_numerically():
    values = [-(2**63), -5, -1, 0, 1, 2**63 - 1]
    assert sorted(i64(v) for v in values) == [i64(v) for v in values]
    assert [from_i64(i64(v)) for v in values] == values


def test_failed_write_rolls_back_and_skips_callbacks(store):
    fired = []
    with pytest.raises(RuntimeError), store.write() as txn:
        txn.put("blocks", b"a", b"1")
        txn.on_commit(lambda: fired.append("a"))
        raise RuntimeError("boom")
    with store.read() as view:
        assert view.get("blocks", b"a") is None
    assert fired == []


def test_group_children_commit_or_roll_back_alone(store):
    fired = []
    with store.group():
        with store.write() as txn:
            txn.put("blocks", b"a", b"1")
            txn.on_commit(lambda: fired.append("a"))
        with pytest.raises(ValueError), store.write() as txn:
            txn.put("blocks", b"b", b"2")
            txn.on_commit(lambda: fired.append("b"))
            raise ValueError
        with store.write() as txn:
            assert txn.get("blocks", b"a") == b"1"  # sees the earlier child of the group
            assert txn.get("blocks", b"b") is None
        assert fired == []  # nothing runs before the group commits
    assert fired == ["a"]
    with store.read() as view:
        assert view.get("blocks", b"a") == b"1" and view.get("blocks", b"b") is None


def test_abort_callbacks_run_exactly_when_changes_never_commit(store):
    fired = []
    with store.write() as txn:  # committed: its abort callback is dropped
        txn.on_abort(lambda: fired.append("committed"))
    with pytest.raises(RuntimeError), store.write() as txn:  # rolled back alone
        txn.on_abort(lambda: fired.append("own rollback"))
        raise RuntimeError
    assert fired == ["own rollback"]
    fired.clear()
    # A savepoint that committed inside a group is undone with the group: its callback runs
    # then, after the ones of the failing savepoint, newest first.
    with pytest.raises(ValueError), store.group():
        with store.write() as txn:
            txn.put("blocks", b"a", b"1")
            txn.on_abort(lambda: fired.append("first"))
            with store.write() as inner:
                inner.on_abort(lambda: fired.append("inner"))
        assert fired == []
        with pytest.raises(KeyError), store.write() as txn:
            txn.on_abort(lambda: fired.append("second"))
            raise KeyError
        assert fired == ["second"]
        raise ValueError("the group fails")
    assert fired == ["second", "inner", "first"]
    with store.read() as view:
        assert view.get("blocks", b"a") is None


def test_abort_callback_failure_does_not_hide_the_error(store):
    fired = []
    with pytest.raises(RuntimeError, match="cause"), store.write() as txn:
        txn.on_abort(lambda: fired.append("later"))
        txn.on_abort(lambda: 1 / 0)  # newest runs first and fails: logged, the rest still run
        raise RuntimeError("cause")
    assert fired == ["later"]


def test_nested_write_joins_outer(store):
    with store.write() as outer:
        outer.put("blocks", b"a", b"1")
        with store.write() as inner:
            assert inner.get("blocks", b"a") == b"1"
            inner.put("blocks", b"b", b"2")
    with store.read() as view:
        assert view.count("blocks") == 2


def test_write_join_reuses_the_open_block(store):
    with store.group():
        with store.write() as outer, store.write(join=True) as joined:
            assert joined is outer
            joined.put("blocks", b"a", b"1")
        # A joined block has no savepoint of its own: its error takes the enclosing block down.
        with pytest.raises(RuntimeError), store.write() as outer:
            outer.put("blocks", b"b", b"2")
            with store.write(join=True) as joined:
                joined.put("blocks", b"c", b"3")
                raise RuntimeError("boom")
    with store.write(join=True) as alone:  # outside any block: an ordinary write
        alone.put("blocks", b"d", b"4")
    with store.read() as view:
        assert [view.get("blocks", k) for k in (b"a", b"b", b"c", b"d")] == [b"1", None, None, b"4"]


def test_drop_and_sample(store):
    with store.write() as txn:
        txn.put_many("runs", [(u64(i), b"v") for i in range(100)])
    picked = store.sample("runs", 10)
    assert len(picked) == 10 and len({k for k, _ in picked}) == 10
    with store.write() as txn:
        txn.drop("runs")
    with store.read() as view:
        assert view.count("runs") == 0


def test_lmdb_second_process_lock_refused(tmp_path):
    first = LmdbStore(str(tmp_path / "d"))
    try:
        # flock is per open file description: a second open in this process conflicts too.
        with pytest.raises(DataDirLocked, match="in use by another kvcm"):
            LmdbStore(str(tmp_path / "d"))
    finally:
        first.close()
    LmdbStore(str(tmp_path / "d")).close()  # free again after close
    assert not (tmp_path / "d" / "kvcm.lock").exists()  # a clean close leaves no lock file


def test_lmdb_lock_survives_a_forked_child_closing_the_store(tmp_path):
    """A child of fork() that closes its inherited store must not remove the parent's lock file:
    a third process could then lock a new one and open the data dir beside the parent."""
    import os

    store = LmdbStore(str(tmp_path / "d"))
    try:
        pid = os.fork()
        if pid == 0:  # the child: close the inherited store, and exit without running cleanups
            try:
                store.close()
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert (tmp_path / "d" / "kvcm.lock").exists()
        with pytest.raises(DataDirLocked):
            LmdbStore(str(tmp_path / "d"))
    finally:
        store.close()
    assert not (tmp_path / "d" / "kvcm.lock").exists()


def test_lmdb_map_full_is_capacity_error_then_grows(tmp_path):
    s = LmdbStore(str(tmp_path / "d"), map_size=256 << 10, map_size_max=256 << 10)
    try:
        with pytest.raises(CapacityError) as info:
            for i in range(10_000):
                with s.write() as txn:
                    txn.put("blocks", u64(i), b"x" * 200)
        assert info.value.code == Code.CAPACITY_EXHAUSTED
        with s.read() as view:
            committed = view.count("blocks")
        assert committed > 0  # everything committed before the error is intact
        s.map_size_max = 8 << 20
        for i in range(10_000, 10_500):
            with s.write() as txn:
                txn.put("blocks", u64(i), b"x" * 200)
        assert s.stats()["map_size"] > 256 << 10
    finally:
        s.close()


def test_lmdb_full_map_runs_the_groups_abort_callbacks(tmp_path):
    s = LmdbStore(str(tmp_path / "d"), map_size=256 << 10, map_size_max=256 << 10)
    released = []
    try:
        with pytest.raises(CapacityError), s.group():
            for i in range(10_000):
                with s.write() as txn:
                    txn.on_abort(lambda i=i: released.append(i))
                    txn.put("blocks", u64(i), b"x" * 200)
        # every savepoint of the group, the one that hit the full map included, never committed
        assert sorted(released) == list(range(len(released))) and len(released) > 1
        with s.read() as view:
            assert view.count("blocks") == 0
    finally:
        s.close()


def _hold_a_reader(path, ready):
    import time

    import lmdb

    env = lmdb.open(path, readonly=True, max_dbs=32, max_readers=4)
    txn = env.begin()  # takes a reader slot, never given back: the process is killed holding it
    ready.set()
    time.sleep(60)
    txn.abort()


def test_lmdb_reader_slots_of_killed_processes_are_reclaimed_when_full(tmp_path):
    """Other processes (an inspection tool) die holding every reader slot;
    the next read clears them instead of failing with MDB_READERS_FULL."""
    import multiprocessing as mp
    import os
    import signal

    s = LmdbStore(str(tmp_path / "d"), max_readers=4)
    try:
        with s.write() as txn:
            txn.put("meta", b"k", b"v")
        spawn = mp.get_context("spawn")
        for _ in range(4):
            ready = spawn.Event()
            holder = spawn.Process(target=_hold_a_reader, args=(str(tmp_path / "d" / "meta"), ready))
            holder.start()
            assert ready.wait(30)
            os.kill(holder.pid, signal.SIGKILL)
            holder.join()
        with s.read() as view:
            assert view.get("meta", b"k") == b"v"
        assert s.stale_readers_cleared == 4
    finally:
        s.close()


def test_lmdb_store_refuses_use_in_a_forked_child(tmp_path):
    """LMDB must not be used across fork(); the child gets a clear error
    instead of undefined behaviour, and the parent is unaffected."""
    import os

    from kvcm.errors import ServerError

    s = LmdbStore(str(tmp_path / "d"))
    try:
        with s.write() as txn:
            txn.put("meta", b"k", b"v")
        pid = os.fork()
        if pid == 0:  # the child: report through the exit code only
            code = 3
            try:
                with s.read():
                    code = 1
            except ServerError as exc:
                code = 0 if "fork()" in str(exc) else 2
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        with s.read() as view:
            assert view.get("meta", b"k") == b"v"
    finally:
        s.close()


def test_lmdb_survives_reopen(tmp_path):
    s = LmdbStore(str(tmp_path / "d"))
    with s.write() as txn:
        txn.put("instances", b"i1", b"rec")
    s.close()
    s = LmdbStore(str(tmp_path / "d"))
    with s.read() as view:
        assert view.get("instances", b"i1") == b"rec"
    s.close()


def test_lmdb_moves_the_runs_table_out_of_its_old_name(tmp_path):
    """A data dir written when the runs table was named ``access`` (and an ``engine_hashes``
    database existed) opens with its runs in ``runs`` and the old names gone."""
    import lmdb

    env = lmdb.open(str(tmp_path / "meta"), max_dbs=32, subdir=True)
    with env.begin(write=True) as txn:
        txn.put(b"run-key", b"run-value", db=env.open_db(b"access", txn=txn))
        env.open_db(b"engine_hashes", txn=txn)
    env.close()
    store = LmdbStore(str(tmp_path))
    try:
        with store.read() as view:
            assert view.get("runs", b"run-key") == b"run-value"
    finally:
        store.close()
    env = lmdb.open(str(tmp_path / "meta"), max_dbs=32, subdir=True, readonly=True)
    with env.begin() as txn:
        names = {bytes(k) for k, _ in txn.cursor()}
    env.close()
    assert b"runs" in names and b"access" not in names and b"engine_hashes" not in names
