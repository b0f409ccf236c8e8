"""``kvcm serve --standby``: the shorthand of one-host HA on a shared LMDB data dir (a lock file
in the data dir elects the leader). Two such servers on one data dir, each on its own endpoint:
the first leads, the second follows (bound and answering), and leads the moment the first dies
(kill -9) or stops, with every acknowledged block and its bytes, and a write session left open
finishes on it; a follower stopped exits 0 and leaves the leader alone; Redis and memory refuse
it. Real subprocesses, real LMDB, real ``ipc://`` sockets, real block bytes."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcm.client import Client
from kvcm.errors import KvcmError
from kvcm.lockfile import lock_holder
from kvcm.testing import TEST_ALLOWED_ROOTS, RunningServer, start_subprocess, stop_subprocess
from tests.block_bytes import read_problems, storage_roots, write_session
from tests.helpers import TIME_FACTOR

KEYS = list(range(1, 33))
OPEN_KEYS = list(range(100, 108))  # a write session still open when the first server dies
# The probe's own part of a measured takeover, whatever the servers do: one probe attempt may
# have just been sent to the dying server (it waits its timeout), the reap of the killed
# process, and a fresh connect per attempt.
PROBE_SLACK_S = 0.2
LEASE = ["--set", "ha.lease_ms=1000", "--set", "ha.renew_ms=100"]


@pytest.fixture
def place() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvcm-sb-", dir="/tmp"))  # short: ipc paths are capped
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _serve_cmd(place: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kvcm", "serve", "--endpoint", f"ipc://{place}/rpc", "--data-dir",
            str(place / "data"), "--http-port", "0", "--set", "storage.allowed_roots=" + ",".join(TEST_ALLOWED_ROOTS),
            *extra]


def _standby(place: Path, name: str) -> RunningServer:
    """``kvcm serve --standby`` on the shared data dir and an endpoint of its own, once it answers."""
    return start_subprocess(str(place / "data"), f"ipc://{place}/{name}", ["--standby", *LEASE])


def _populate(endpoint: str) -> dict:
    """Blocks with real bytes, acknowledged by finish_write_cache; returns a session left open
    (its bytes written, not finished)."""
    with Client(endpoint) as c:
        c.call("register_instance", {
            "instance_group": "default", "instance_id": "inst-a", "block_size": 16,
            "location_spec_infos": [{"name": "tp0", "size": 1024}]})
        session = c.call("start_write_cache", {"instance_id": "inst-a", "block_keys": KEYS})
        write_session(session, "inst-a", KEYS, storage_roots(c))
        done = c.call("finish_write_cache", {"instance_id": "inst-a", "write_session_id": session["write_session_id"],
                                             "success_blocks": {"offset": len(KEYS)}})
        assert done is not None
        left_open = c.call("start_write_cache", {"instance_id": "inst-a", "block_keys": OPEN_KEYS})
        write_session(left_open, "inst-a", OPEN_KEYS, storage_roots(c))
        return left_open


def _leads(endpoint: str, timeout: float) -> int:
    """The pid of the server at ``endpoint`` once it says it leads, probing with a fresh
    connection each time."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with Client(endpoint, timeout=0.05, retries=0) as c:
                health = c.call("check_health", retry=False)
            if health["is_leader"]:
                return int(health["node"]["pid"])
        except KvcmError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{endpoint} did not lead within {timeout} s")
        time.sleep(0.005)


@pytest.mark.parametrize("how", ["kill9", "sigterm"])
def test_standby_takes_over_with_every_acknowledged_block(place: Path, how: str) -> None:
    first = _standby(place, "a")
    second = None
    try:
        assert first.process is not None
        assert _leads(first.endpoint, 10 * TIME_FACTOR) == first.process.pid
        second = _standby(place, "b")
        assert second.process is not None
        with Client(second.endpoint, timeout=1.0, retries=0) as c:  # bound, answering, following
            health = c.call("check_health")
            assert health["is_health"] is True and health["is_leader"] is False
        left_open = _populate(first.endpoint)

        first.process.send_signal(signal.SIGKILL if how == "kill9" else signal.SIGTERM)
        start = time.monotonic()
        assert first.process.wait(20) == (-9 if how == "kill9" else 0)
        assert _leads(second.endpoint, 10 * TIME_FACTOR) == second.process.pid
        took = time.monotonic() - start
        if how == "kill9":  # a clean stop drains first (server.shutdown_grace_s): not timed
            assert took < 1.1 * TIME_FACTOR + PROBE_SLACK_S, f"took over in {took:.3f} s"

        with Client(second.endpoint) as c:
            assert read_problems(c, "inst-a", KEYS, storage_roots(c)) == []
            c.call("finish_write_cache", {"instance_id": "inst-a", "write_session_id": left_open["write_session_id"],
                                          "success_blocks": {"offset": len(OPEN_KEYS)}})
            assert read_problems(c, "inst-a", OPEN_KEYS, storage_roots(c)) == []
        assert lock_holder(str(place / "data" / "kvcm.lock")) == second.process.pid
    finally:
        stop_subprocess(first, kill=True)
        if second is not None:
            assert stop_subprocess(second) == 0
    assert not (place / "data" / "kvcm.lock").exists()  # the last leader's clean stop removed it


def test_a_follower_stopped_exits_0_and_leaves_the_leader_alone(place: Path) -> None:
    first = _standby(place, "a")
    try:
        assert first.process is not None
        assert _leads(first.endpoint, 10 * TIME_FACTOR) == first.process.pid
        second = _standby(place, "b")
        assert stop_subprocess(second) == 0
        # The first server kept the data dir and the lead throughout.
        assert _leads(first.endpoint, 1) == first.process.pid
        assert lock_holder(str(place / "data" / "kvcm.lock")) == first.process.pid
    finally:
        assert stop_subprocess(first) == 0


@pytest.mark.parametrize("extra", [
    ["--set", "store.backend=redis"],
    ["--set", "store.backend=redis", "--set", "ha.enabled=true", "--set", "ha.node_id=n1"],
    ["--memory"],
], ids=["redis", "ha", "memory"])
def test_standby_refused_without_lmdb(place: Path, extra: list[str]) -> None:
    done = subprocess.run(_serve_cmd(place, "--standby", *extra), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "ha.enabled" in lines[0] and "server.standby" in lines[0], done.stderr
    assert "LMDB data dir" in lines[0]
    assert not (place / "data").exists()  # refused before anything was made
