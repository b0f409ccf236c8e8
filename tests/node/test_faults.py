"""Faults the other suites do not cover: a paused server (F5)
and a full disk under the metadata store (F7). Real subprocesses, a real tmpfs mount."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from kvcm.errors import KvcmError, Unavailable
from kvcm.testing import serve_in_subprocess, serve_in_thread
from tests.helpers import add_file_storage, add_group, locate, register, write


def test_paused_server_times_out_calls_then_serves_again():
    """F5: SIGSTOP the server. Calls fail with TIMEOUT within their deadline (no hang); a write
    is not re-sent, so it is applied at most once, and after SIGCONT the server serves again."""
    with serve_in_subprocess() as srv:
        with srv.client(timeout=0.5, retries=1) as c:
            register(c, "inst")
            assert srv.process is not None
            os.kill(srv.process.pid, signal.SIGSTOP)
            try:
                began = time.monotonic()
                with pytest.raises(Unavailable, match=r"2 attempt\(s\)"):
                    c.call("get_metrics", {})  # idempotent: one retry, then TIMEOUT
                with pytest.raises(Unavailable, match=r"1 attempt\(s\)"):
                    c.call("start_write_cache", {"instance_id": "inst", "block_keys": [1, 2]})
                assert time.monotonic() - began < 10  # bounded by the deadlines, not by the pause
            finally:
                os.kill(srv.process.pid, signal.SIGCONT)
        with srv.client(timeout=10) as c:
            # The timed-out start was never re-sent. Whether it reached the server before the
            # client dropped its socket is up to the transport: applied at most once.
            metas = c.call("get_cache_meta", {"instance_id": "inst", "block_keys": [1, 2], "detail_level": 1})["metas"]
            assert {m["status"] for m in metas} in ({"writing"}, {"not_found"})
            assert all(m.get("location_count", 0) <= 1 for m in metas)
            assert len(write(c, [3, 4])["locations"]) == 2  # serving again


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 3 MiB tmpfs (root with mount rights only); unmounted afterwards."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount_point)],
                          capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)  # fails if kvcm left a file open


def test_full_disk_fails_writes_typed_keeps_reads_and_loses_nothing(small_tmpfs, tmp_path):
    """F7: the metadata store's filesystem fills up (tmpfs reports EIO). Writes get a typed
    error and the server keeps serving reads; with space back, writes succeed again, and a
    restart finds every acknowledged write."""
    data = str(small_tmpfs / "data")
    acked: list[list[int]] = []
    errors: set[str] = set()
    with serve_in_thread(data_dir=data) as srv, srv.client(retries=0) as c:
        add_file_storage(c, "disk", tmp_path / "blocks")  # block files elsewhere: only metadata fills up
        add_group(c, "g", ["disk"])
        register(c, "inst", group="g")
        key = 1
        while len(errors) == 0 and key < 200_000:
            keys = list(range(key, key + 16))
            key += 16
            try:
                write(c, keys)
                acked.append(keys)
            except KvcmError as exc:
                errors.add(exc.code.name)
        assert errors and errors <= {"IO_ERROR", "CAPACITY_EXHAUSTED"}
        assert len(locate(c, acked[-1])) == 16  # reads unaffected
        # Still full: typed errors, and the server lives on. A write may still fit now and then
        # (one that needs no new page where the refused one needed a split); it is acknowledged
        # and must survive the restart like any other.
        refused = 0
        for _ in range(1000):  # the refused write's rollback may leave room for many small ones
            keys = list(range(key, key + 16))
            key += 16
            try:
                write(c, keys)
                acked.append(keys)
            except KvcmError as exc:
                assert exc.code.name in {"IO_ERROR", "CAPACITY_EXHAUSTED"}
                refused += 1
                if refused == 3:
                    break
        assert refused == 3
        subprocess.run(["mount", "-o", "remount,size=64m", str(small_tmpfs)], check=True)
        write(c, list(range(key, key + 16)))
        acked.append(list(range(key, key + 16)))
        srv.app.cache.check()
    with serve_in_thread(data_dir=data) as srv, srv.client() as c:
        assert all(len(locate(c, keys)) == 16 for keys in acked)
