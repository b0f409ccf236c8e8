"""``kvcm serve --standby``: a second server on the same LMDB data dir and endpoint waits on the
data dir's lock, binding nothing, and serves the moment the first one dies (kill -9) or stops,
with every acknowledged block; a standby stopped while waiting exits 0; Redis / HA refuse it.
Real subprocesses, real LMDB, real ``ipc://`` sockets; plus the lock hand-over in-process."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvcm.backends.metastore import LmdbStore
from kvcm.client import Client
from kvcm.errors import KvcmError
from kvcm.lockfile import drop_unclaimed, lock_holder, pass_lock_file, wait_lock_file
from kvcm.testing import TEST_ALLOWED_ROOTS, start_subprocess, stop_subprocess
from tests.block_bytes import read_problems, storage_roots, write_session
from tests.helpers import TIME_FACTOR

KEYS = list(range(1, 33))
OPEN_KEYS = list(range(100, 108))  # a write session still open when the first server dies
STANDING_BY = "standing by for data dir"
# The probe's own part of a measured takeover, whatever the servers do: one probe attempt may
# have just been sent to the dying server (it waits its 50 ms timeout), the reap of the killed
# process, and a fresh connect per attempt.
PROBE_SLACK_S = 0.2


@dataclass
class Node:
    process: subprocess.Popen[bytes]
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def place() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvcm-sb-", dir="/tmp"))  # short: ipc paths are capped
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _serve_cmd(place: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kvcm", "serve", "--endpoint", f"ipc://{place}/rpc", "--data-dir",
            str(place / "data"), "--http-port", "0", "--set", "storage.allowed_roots=" + ",".join(TEST_ALLOWED_ROOTS),
            *extra]


def _standby(place: Path, name: str = "b") -> Node:
    """``kvcm serve --standby`` on the same data dir and endpoint, once it says it stands by."""
    log = place / f"{name}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCM_") or k.startswith("KVCM_TEST_")}
    with open(log, "wb") as out:
        process = subprocess.Popen(_serve_cmd(place, "--standby"), env=env, stdout=out, stderr=subprocess.STDOUT)
    node = Node(process, log)
    deadline = time.monotonic() + 30 * TIME_FACTOR
    while STANDING_BY not in node.text():
        assert process.poll() is None, f"the standby exited with {process.returncode}:\n{node.text()}"
        assert time.monotonic() < deadline, f"the standby never said it stands by:\n{node.text()}"
        time.sleep(0.02)
    return node


def _sockets(pid: int) -> list[str]:
    """The sockets a process has open (a bound ZeroMQ endpoint or HTTP port is one)."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if target.startswith("socket:"):
            out.append(target)
    return out


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


def _pid_answering(endpoint: str, timeout: float) -> int:
    """The pid of the server answering at ``endpoint``, probing every 50 ms (a fresh connection
    each time) until one answers."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with Client(endpoint, timeout=0.05, retries=0) as c:
                return int(c.call("check_health", retry=False)["node"]["pid"])
        except KvcmError:
            if time.monotonic() > deadline:
                raise


@pytest.mark.parametrize("how", ["kill9", "sigterm"])
def test_standby_takes_over_with_every_acknowledged_block(place: Path, how: str) -> None:
    endpoint = f"ipc://{place}/rpc"
    first = start_subprocess(str(place / "data"), endpoint)
    standby = None
    try:
        assert first.process is not None
        left_open = _populate(endpoint)
        standby = _standby(place)
        line = next(x for x in standby.text().splitlines() if STANDING_BY in x)
        assert f"held by pid {first.process.pid}" in line
        assert _sockets(standby.process.pid) == []  # standing by binds nothing
        assert _pid_answering(endpoint, 5) == first.process.pid

        first.process.send_signal(signal.SIGKILL if how == "kill9" else signal.SIGTERM)
        start = time.monotonic()
        assert first.process.wait(20) == (-9 if how == "kill9" else 0)
        assert _pid_answering(endpoint, 10 * TIME_FACTOR) == standby.process.pid
        took = time.monotonic() - start
        if how == "kill9":  # a clean stop drains first (server.shutdown_grace_s): not timed
            assert took < 1.0 * TIME_FACTOR + PROBE_SLACK_S, f"took over in {took:.3f} s\n{standby.text()}"

        with Client(endpoint) as c:
            assert read_problems(c, "inst-a", KEYS, storage_roots(c)) == []
            c.call("finish_write_cache", {"instance_id": "inst-a", "write_session_id": left_open["write_session_id"],
                                          "success_blocks": {"offset": len(OPEN_KEYS)}})
            assert read_problems(c, "inst-a", OPEN_KEYS, storage_roots(c)) == []
        assert lock_holder(str(place / "data" / "kvcm.lock")) == standby.process.pid
    finally:
        stop_subprocess(first, kill=True)
        if standby is not None:
            standby.process.terminate()
            assert standby.process.wait(20) == 0, standby.text()
    assert not (place / "data" / "kvcm.lock").exists()  # the standby's clean stop removed it


def test_sigterm_while_standing_by_exits_0_without_binding(place: Path) -> None:
    endpoint = f"ipc://{place}/rpc"
    first = start_subprocess(str(place / "data"), endpoint)
    try:
        assert first.process is not None
        standby = _standby(place)
        standby.process.terminate()
        assert standby.process.wait(20) == 0, standby.text()
        assert "kvcm serving on" not in standby.text()
        assert "never served" in standby.text()
        # The first server kept the data dir and the endpoint throughout.
        assert _pid_answering(endpoint, 5) == first.process.pid
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
    assert not (place / "data").exists()  # refused before anything was made


def _taken_by_another_process(path: str) -> bool:
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # a lock taken here is released with the descriptor
    return False


def _try_in_child(path: str) -> bool:
    """Whether another process finds the lock file taken (a child: flock is per open file)."""
    code = ("import fcntl, os, sys\nfd = os.open(sys.argv[1], os.O_RDWR)\n"
            "try:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept BlockingIOError:\n    sys.exit(3)\n")
    return subprocess.run([sys.executable, "-c", code, path], timeout=30).returncode == 3


def test_lock_passes_to_the_store_with_no_gap(tmp_path: Path) -> None:
    data = tmp_path / "d"
    data.mkdir()
    lock = str(data / "kvcm.lock")
    assert wait_lock_file(lock, "the standby", "data dir", threading.Event())
    assert lock_holder(lock) == os.getpid()
    pass_lock_file(lock)
    assert _try_in_child(lock)  # passed on, still held against other processes
    store = LmdbStore(str(data), map_size=1 << 20)  # the next owner takes it over
    drop_unclaimed(lock)  # claimed: nothing to drop
    assert _try_in_child(lock)
    store.close()
    assert not os.path.exists(lock)

    assert wait_lock_file(lock, "the standby", "data dir", threading.Event())
    pass_lock_file(lock)
    drop_unclaimed(lock)  # a start that failed before the store opened frees it
    assert not os.path.exists(lock)


def test_wait_gives_up_when_stopped_and_reports_the_holder_once(tmp_path: Path) -> None:
    lock = str(tmp_path / "kvcm.lock")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\nsys.path.insert(0, sys.argv[2])\nfrom kvcm.lockfile import hold_lock_file\n"
        "hold_lock_file(sys.argv[1], 'other', 'data dir')\nprint('held', flush=True)\ntime.sleep(60)\n"),
        lock, str(Path(__file__).resolve().parents[2])], stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        seen: list[int | None] = []
        stop = threading.Event()
        threading.Timer(0.3, stop.set).start()
        assert not wait_lock_file(lock, "the standby", "data dir", stop, on_busy=seen.append)
        assert seen == [holder.pid]
        assert _taken_by_another_process(lock)
    finally:
        holder.kill()
        holder.wait()
    assert wait_lock_file(lock, "the standby", "data dir", threading.Event())  # a dead holder's lock is free
    drop_unclaimed(lock)  # not passed on: still ours
    assert lock_holder(lock) == os.getpid()
    from kvcm.lockfile import drop_lock_file

    drop_lock_file(lock)
    assert not os.path.exists(lock)


HOLDER = """
import fcntl, os, socket, sys, time
lock, path = sys.argv[1:]
fd = os.open(lock, os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, str(os.getpid()).encode())
listener = socket.socket(socket.AF_UNIX)
listener.bind(path)
listener.listen()
print("ready", flush=True)
sys.stdin.readline()
os.close(fd)  # the lock goes first, the endpoint a moment later
time.sleep(0.5)
listener.close()
os.unlink(path)
"""


def test_standby_waits_for_the_endpoint_its_holder_still_closes(place: Path) -> None:
    """A holder lets go of the lock just before its endpoint (a clean stop closes the socket in
    ZeroMQ's I/O thread): the standby waits for the endpoint instead of refusing it as taken."""
    (place / "data").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(place / "data" / "kvcm.lock"), str(place / "rpc")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    standby = None
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline() == b"ready\n"
        standby = _standby(place)
        assert f"held by pid {holder.pid}" in standby.text()
        holder.stdin.write(b"go\n")
        holder.stdin.flush()
        assert holder.wait(20) == 0
        assert _pid_answering(f"ipc://{place}/rpc", 20 * TIME_FACTOR) == standby.process.pid, standby.text()
    finally:
        holder.kill()
        holder.wait()
        if standby is not None:
            standby.process.terminate()
            assert standby.process.wait(20) == 0, standby.text()
