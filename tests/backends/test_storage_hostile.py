"""Hostile local users against kvcm's storages: what another user with write access to
``/dev/shm`` or a storage root can plant at the names kvcm uses (a symlink, a directory, a FIFO,
a hand-written ownership marker), the modes kvcm creates its files with, and a storage whose
lock a paused (SIGSTOP) process holds, on one node and on two HA nodes over a real Redis.

Real servers, real files in temp dirs and in ``/dev/shm``: every name this module makes there
carries a unique prefix and is removed afterwards. The tests run as root, so "not followed" is
checked by the target's bytes, not by a permission error.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from kvcm import Client
from kvcm.errors import Code, KvcmError
from kvcm.testing import serve_in_thread
from tests.helpers import TIME_FACTOR, add_file_storage, add_group, register, start, wait_for, write

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")

QUIET = {"reclaim": {"enabled": False},
         "cache": {"delete_poll_ms": 20, "session_check_ms": 50, "storage_health_interval_s": 0.1}}


@pytest.fixture
def prefix() -> Iterator[str]:
    """An shm prefix of our own; whatever carries it is gone after the test."""
    p = f"kvcm.hostile.{uuid.uuid4().hex[:10]}."
    yield p
    for path in glob.glob(f"/dev/shm/{p}*"):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


@pytest.fixture
def umask_022() -> Iterator[None]:
    """The usual umask, so a mode kvcm gets right is its own doing."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def _add_shm(c: Any, name: str, prefix: str, **extra: Any) -> None:
    c.call("add_storage", {"storage": {"global_unique_name": name, "storage_type": "shm",
                                       "storage_spec": {"prefix": prefix, "segment_size": 1 << 20}}, **extra})


def _served(c: Any, keys: list[int], instance: str = "inst") -> int:
    found = c.call("get_cache_location", {"instance_id": instance, "query_type": "batch_get", "block_keys": keys})
    return sum(1 for loc in found["locations"] if loc["location_specs"] and loc["location_specs"][0]["uri"])


def _status(c: Any, key: int, instance: str = "inst") -> str:
    metas = c.call("get_cache_meta", {"instance_id": instance, "block_keys": [key]})["metas"]
    return str(metas[0]["status"])


def _unblock(fifo: str) -> None:
    """Open ``fifo`` for writing and close it: a reader blocked in ``open()`` goes on (to EOF)."""
    with contextlib.suppress(OSError):
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


class Sampler:
    """Reads a storage's ``available`` flag every 50 ms on a thread (``read`` returns None when
    it could not tell): was it ever false?"""

    def __init__(self, read: Any) -> None:
        self.read = read
        self.seen: list[bool] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            with contextlib.suppress(KvcmError, KeyError):
                flag = self.read()
                if flag is not None:
                    self.seen.append(bool(flag))

    def stop(self) -> list[bool]:
        self._stop.set()
        self._thread.join()
        return self.seen


# -- finding 1: the health probe ---------------------------------------------------------------


def test_the_health_probe_never_opens_what_others_planted_at_its_name(tmp_path: Any, prefix: str) -> None:
    """A symlink at the probe name the old layout predicted (``<prefix>probe.<pid>``) must not
    get its target truncated; a directory or a FIFO there must not make the storage unavailable
    (served blocks stay found, writes go on)."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious bytes " * 64)
    roots = {"fs": tmp_path / "fs", "fifo": tmp_path / "fifo"}
    pid = os.getpid()  # the server runs in this process
    with serve_in_thread(data_dir=str(tmp_path / "data"), overrides=QUIET) as server, server.client() as c:
        _add_shm(c, "sh", prefix)
        for name, root in roots.items():
            add_file_storage(c, name, root)
        for name in ("sh", *roots):
            add_group(c, f"g-{name}", [name])
            register(c, f"i-{name}", group=f"g-{name}")
            write(c, [1, 2], instance=f"i-{name}")
        os.symlink(victim, f"/dev/shm/{prefix}probe.{pid}")
        os.mkdir(roots["fs"] / f".kvcm-probe-{pid}")
        os.mkfifo(roots["fifo"] / f".kvcm-probe-{pid}")
        time.sleep(1.0 * TIME_FACTOR)  # proving a negative: ten probe rounds; two failed probes make a storage unavailable
        health = c.call("check_health")["storages"]
        assert all(health[name]["available"] for name in ("sh", *roots)), health
        for name in ("sh", *roots):
            assert _served(c, [1, 2], f"i-{name}") == 2, name
            write(c, [3], instance=f"i-{name}")  # writes are not refused
    assert victim.read_bytes() == b"precious bytes " * 64
    # Nothing left behind either: only what was planted carries a probe name.
    assert glob.glob(f"/dev/shm/{prefix}probe.*") == [f"/dev/shm/{prefix}probe.{pid}"]
    for root in roots.values():
        assert [p.name for p in root.iterdir() if p.name.startswith(".kvcm-probe-")] == [f".kvcm-probe-{pid}"]


def test_a_container_swapped_for_a_symlink_never_gets_its_target_punched(tmp_path: Any) -> None:
    """Freeing a slot punches a hole at its range of the container: through a symlink put in
    the container's place, that would zero another file's bytes."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"v" * 4096)
    root = tmp_path / "fs"
    with serve_in_thread(data_dir=str(tmp_path / "data"), overrides=QUIET) as server, server.client() as c:
        add_file_storage(c, "fs", root)
        add_group(c, "g", ["fs"])
        register(c, group="g")
        write(c, [1, 2])  # one packed container, never freed from yet
        (container,) = glob.glob(str(root / "s1024" / "*.kv"))
        os.unlink(container)
        os.symlink(victim, container)
        c.call("remove_cache", {"instance_id": "inst", "block_keys": [1]})
        assert wait_for(lambda: _status(c, 1) == "not_found")
    assert victim.read_bytes() == b"v" * 4096


# -- finding 11: a FIFO at an ownership-marker name ------------------------------------------------


def test_a_fifo_or_directory_at_a_marker_name_is_refused_at_once_not_waited_on(tmp_path: Any, prefix: str) -> None:
    fifos = [f"/dev/shm/{prefix}kvcm-storage", str(tmp_path / "fs" / ".kvcm-storage")]
    os.makedirs(tmp_path / "fs")
    for fifo in fifos:
        os.mkfifo(fifo)
    (tmp_path / "dir" / ".kvcm-storage").mkdir(parents=True)
    with serve_in_thread(data_dir=str(tmp_path / "data"), overrides=QUIET) as server, \
            server.client(timeout=5.0 * TIME_FACTOR, retries=0) as c:
        try:
            for add in (lambda: _add_shm(c, "sh", prefix), lambda: add_file_storage(c, "fs", tmp_path / "fs"),
                        lambda: add_file_storage(c, "dir", tmp_path / "dir")):
                with pytest.raises(KvcmError) as info:
                    add()
                assert info.value.code is Code.INVALID_ARGUMENT, info.value
                assert "not a regular file" in info.value.message
            assert c.call("check_health")["status"] == "ok"  # the RPC loop never stalled
        finally:
            for fifo in fifos:  # what a stalled loop waits for, so the server can stop
                _unblock(fifo)


def test_a_fifo_named_like_a_marker_does_not_stall_the_start_up_leftover_check(tmp_path: Any, prefix: str) -> None:
    """Where the metadata is missing, the start looks for markers in ``/dev/shm`` naming its data
    dir: a FIFO with a marker's name is passed over, not waited on."""
    from kvcm.backends.storage.ownership import leftovers

    fifo = f"/dev/shm/{prefix}kvcm-storage"
    os.mkfifo(fifo)
    found: list[Any] = []
    looking = threading.Thread(target=lambda: found.append(leftovers(str(tmp_path))), daemon=True)
    looking.start()
    looking.join(5.0 * TIME_FACTOR)
    stalled = looking.is_alive()
    _unblock(fifo)
    looking.join()
    assert not stalled and found == [[]]


# -- planted at a lock name: the storage waits, and comes back ------------------------------------


def test_a_directory_planted_at_a_lock_name_makes_the_storage_wait_not_fail(tmp_path: Any, prefix: str) -> None:
    """A clean stop removes the lock file, so another user may put something at its name before
    the next start: that storage waits for it to go (retried, never recorded unavailable) and
    serves again once it is gone; the other storages are untouched meanwhile."""
    data = str(tmp_path / "data")
    with serve_in_thread(data_dir=data, overrides=QUIET) as server, server.client() as c:
        _add_shm(c, "sh", prefix)
        add_group(c, "g", ["sh"])
        register(c, group="g")
        write(c, [1, 2])
    planted = f"/dev/shm/{prefix}lock"
    os.mkdir(planted)
    with serve_in_thread(data_dir=data, overrides=QUIET) as server, server.client(timeout=5.0, retries=0) as c:
        sampler = Sampler(lambda: server.app.registry.get_storage("sh").available)
        time.sleep(0.5 * TIME_FACTOR)  # proving a negative: five health rounds, sampled all along
        register(c, "other")
        write(c, [7], instance="other")  # the default storage serves on
        os.rmdir(planted)
        assert wait_for(lambda: _served(c, [1, 2]) == 2, timeout=10 * TIME_FACTOR)
        write(c, [3])
        seen = sampler.stop()
        assert seen and all(seen), "the registry recorded the storage unavailable"
        server.app.cache.check()


# -- finding 15: hand-written markers -------------------------------------------------------------


def _forged(storage_id: str, data_dir_id: str, data_dir: str, **extra: Any) -> bytes:
    return json.dumps({"kvcm_marker": 2, "storage_id": storage_id, "storage": "gone", "data_dir_id": data_dir_id,
                       "data_dir": data_dir, "adopted": [], **extra}).encode()


def test_a_hand_written_marker_naming_this_data_dir_proves_nothing(tmp_path: Any, prefix: str) -> None:
    data = str(tmp_path / "data")
    theirs = {f"/dev/shm/{prefix}0badf00d-{i}": f"someone else's {i}".encode() for i in range(3)}
    with serve_in_thread(data_dir=data, overrides=QUIET) as server, server.client() as c:
        data_dir_id = server.app.registry.data_dir_id  # no secret: earlier markers were world-readable
        with open(f"/dev/shm/{prefix}kvcm-storage", "wb") as f:
            f.write(_forged("0badf00d", data_dir_id, data, mac="00" * 32))
        for path, body in theirs.items():
            with open(path, "wb") as f:
                f.write(body)
        with pytest.raises(KvcmError) as info:
            _add_shm(c, "sh", prefix)
        assert info.value.code is Code.INVALID_ARGUMENT and "cannot authenticate" in info.value.message
        # Taken over on the admin's word, the forged marker's ids are not kept: no later
        # --discard-orphans deletes a file on its word.
        _add_shm(c, "sh", prefix, adopt_directory=True)
        with open(f"/dev/shm/{prefix}kvcm-storage", "rb") as f:
            marker = json.loads(f.read())
        assert marker["storage_id"] != "0badf00d" and marker["adopted"] == [] and marker["mac"]
    for path, body in theirs.items():
        with open(path, "rb") as f:
            assert f.read() == body


def test_a_marker_planted_where_a_storages_marker_vanished_is_not_taken_for_its_own(tmp_path: Any,
                                                                                    prefix: str) -> None:
    """A reboot empties ``/dev/shm``, marker included; before kvcm starts again, someone writes
    an unsigned marker of this data dir naming another storage id, beside files of that id. The
    storage (recorded in the metadata) must not take it for its own: no id of it is signed in."""
    data = str(tmp_path / "data")
    with serve_in_thread(data_dir=data, overrides=QUIET) as server, server.client() as c:
        _add_shm(c, "sh", prefix)
        data_dir_id = server.app.registry.data_dir_id
    for path in glob.glob(f"/dev/shm/{prefix}*"):
        os.unlink(path)
    forged = _forged("0badf00d", data_dir_id, data)
    with open(f"/dev/shm/{prefix}kvcm-storage", "wb") as f:
        f.write(forged)
    with open(f"/dev/shm/{prefix}0badf00d-0", "wb") as f:
        f.write(b"someone else's")
    with serve_in_thread(data_dir=data, overrides=QUIET) as server, server.client() as c:
        health = c.call("check_health")["storages"]["sh"]
        assert health["available"] is False and "cannot authenticate" in health["unavailable_reason"]
    with open(f"/dev/shm/{prefix}kvcm-storage", "rb") as f:
        assert f.read() == forged
    with open(f"/dev/shm/{prefix}0badf00d-0", "rb") as f:
        assert f.read() == b"someone else's"


def _serve(data: str, *extra: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """``kvcm serve`` in a subprocess; stopped by SIGTERM once it printed that it serves."""
    proc = subprocess.Popen([sys.executable, "-m", "kvcm", "serve", "--data-dir", data, "--endpoint",
                             f"ipc://{data}/rpc.sock", "--http-port", "0", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.startswith("kvcm serving"):
        proc.terminate()
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, line + out, err)


def test_discard_orphans_deletes_nothing_on_a_forged_markers_word(tmp_path: Any) -> None:
    data = str(tmp_path / "data")
    with serve_in_thread(data_dir=data, overrides=QUIET) as server, server.client() as c:
        register(c)
        write(c, [1, 2])
        root = server.app.storages.get("default-file").directory
    os.unlink(os.path.join(data, "meta", "data.mdb"))  # the metadata is lost
    with open(os.path.join(root, ".kvcm-storage"), "wb") as f:  # and someone wrote the marker
        f.write(_forged("0badf00d", "feedf00d", data, adopted=["0badf00e"]))
    theirs = {os.path.join(root, "s4096", name): name.encode()
              for name in ("0badf00d-00000001.kv", "0badf00e-00000002.kv", "0badf00d-00000003.kv")}
    os.makedirs(os.path.join(root, "s4096"), exist_ok=True)
    for path, body in theirs.items():
        with open(path, "wb") as f:
            f.write(body)
    done = _serve(data, "--discard-orphans")
    assert done.returncode == 0, done.stderr
    for path, body in theirs.items():
        with open(path, "rb") as f:
            assert f.read() == body, path


def test_an_unsigned_marker_of_an_earlier_kvcm_keeps_serving_and_is_signed(tmp_path: Any) -> None:
    """Markers from before signatures name the storage id the metadata records: still kvcm's."""
    data = str(tmp_path / "data")
    with serve_in_thread(data_dir=data, overrides=QUIET) as server, server.client() as c:
        register(c)
        write(c, [1, 2, 3])
        marker = os.path.join(server.app.storages.get("default-file").directory, ".kvcm-storage")
    with open(marker, "rb") as f:
        body = json.loads(f.read())
    old = {k: v for k, v in body.items() if k != "mac"} | {"kvcm_marker": 1}
    os.unlink(marker)
    with open(marker, "w") as f:  # as an earlier kvcm left it
        json.dump(old, f)
    with serve_in_thread(data_dir=data, overrides=QUIET) as server, server.client() as c:
        assert _served(c, [1, 2, 3]) == 3
        write(c, [4])
        server.app.cache.check()
    with open(marker, "rb") as f:
        again = json.loads(f.read())
    assert again["mac"] and again["storage_id"] == body["storage_id"]
    assert stat.S_IMODE(os.stat(marker).st_mode) == 0o600


# -- finding 19: modes ---------------------------------------------------------------------------


def test_files_kvcm_creates_in_shared_directories_are_private(tmp_path: Any, prefix: str, umask_022: None) -> None:
    data = str(tmp_path / "data")
    root = tmp_path / "fs"
    with serve_in_thread(data_dir=data, overrides=QUIET) as server, server.client() as c:
        _add_shm(c, "sh", prefix)
        add_file_storage(c, "fs", root)
        for name in ("sh", "fs"):
            add_group(c, f"g-{name}", [name])
            register(c, f"i-{name}", group=f"g-{name}")
            write(c, [1, 2], instance=f"i-{name}")
        made = glob.glob(f"/dev/shm/{prefix}*") + [os.path.join(d, n) for d, _, names in os.walk(root) for n in names]
        names = {os.path.basename(p) for p in made}
        assert {f"{prefix}lock", f"{prefix}kvcm-storage", ".kvcm-lock", ".kvcm-storage"} <= names
        assert len(glob.glob(f"/dev/shm/{prefix}*-0")) == 1 and glob.glob(str(root / "s1024" / "*.kv"))
        made.append(os.path.join(data, "marker.key"))
        loose = {p: oct(stat.S_IMODE(os.stat(p).st_mode)) for p in made if os.stat(p).st_mode & 0o077}
        assert loose == {}


# -- finding 3: a storage whose lock a paused process holds ---------------------------------------

HOLD = r"""
import sys
from kvcm.lockfile import hold_lock_file
hold_lock_file(sys.argv[1], "a paused kvcm", "the storage")
print("held", flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def _paused_holder(lock: str) -> Iterator[subprocess.Popen[str]]:
    """A process holding ``lock`` and then stopped with SIGSTOP; killed on exit."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, lock], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        os.kill(proc.pid, signal.SIGSTOP)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_storage_locked_by_a_paused_process_waits_and_comes_back(tmp_path: Any) -> None:
    data = str(tmp_path / "data")
    with serve_in_thread(data_dir=data, overrides=QUIET) as server, server.client() as c:
        add_group(c, "g", ["default-file"])
        register(c, group="g")
        write(c, [1, 2, 3, 4])
        lock = os.path.join(server.app.storages.get("default-file").directory, ".kvcm-lock")
    with _paused_holder(lock) as holder, serve_in_thread(data_dir=data, overrides=QUIET) as server, \
            server.client() as c:
        sampler = Sampler(lambda: server.app.registry.get_storage("default-file").available)
        assert _served(c, [1, 2, 3, 4]) == 0  # not served while another process holds the storage
        with pytest.raises(KvcmError) as info:
            start(c, [9])
        assert info.value.code is Code.NO_STORAGE_AVAILABLE
        c.call("remove_cache", {"instance_id": "inst", "block_keys": [4]})
        time.sleep(0.5 * TIME_FACTOR)  # proving a negative: 25 deleter rounds: it waits for the storage, it never drops the copy unfreed
        assert _status(c, 4) == "deleting"
        waiting = c.call("check_health")["storages"]["default-file"]
        assert waiting["available"] is True and "lock" in waiting["waiting"]  # why this node serves nothing
        holder.kill()  # the lock frees (a paused process can still be killed)
        holder.wait()
        assert wait_for(lambda: _served(c, [1, 2, 3]) == 3, timeout=10 * TIME_FACTOR)
        assert wait_for(lambda: _status(c, 4) == "not_found", timeout=10 * TIME_FACTOR)
        write(c, [5])
        assert _served(c, [1, 2, 3, 5]) == 4
        assert c.call("check_health")["storages"]["default-file"] == {"enabled": True, "available": True}
        seen = sampler.stop()
        assert seen and all(seen), "the registry recorded the storage unavailable"
        server.app.cache.check()  # slots rebuilt from the metadata, the freed one freed


def test_after_a_leader_pause_the_next_leader_gets_its_file_storage_back(redis_factory: Any, tmp_path: Any) -> None:
    """Leader A is SIGSTOPped with A holding the default file storage's lock; B takes the lease
    and waits for the storage (never recording it unavailable); A resumes and steps down; B
    then serves the blocks A served, and takes writes, within a few health rounds."""
    from tests.node.test_ha import Pair, _leads, _raw_call, wait_until

    server = redis_factory("--appendonly", "yes", "--appendfsync", "always")
    sock_dir = tempfile.mkdtemp(prefix="kvcm-hostile-", dir="/tmp")
    pair = Pair(server.url, str(tmp_path), sock_dir, extra=[
        "--set", "cache.storage_health_interval_s=0.2", "--set", "cache.delete_poll_ms=50",
        "--set", "reclaim.enabled=false"])
    try:
        pair.start("n1")
        pair.start("n2")
        a = pair.leader()
        b = "n2" if a == "n1" else "n1"
        with Client(pair.endpoints[a], timeout=5.0) as c:
            add_group(c, "g", ["default-file"])
            register(c, group="g")
            write(c, [1, 2, 3, 4])
            assert _served(c, [1, 2, 3, 4]) == 4

        def available() -> bool | None:
            err, health = _raw_call(pair.endpoints[b], "check_health", {}, timeout=2.0)
            return None if err is not None else bool(health["storages"]["default-file"]["available"])

        os.kill(pair.nodes[a].process.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: _leads(pair, b), timeout=20)
            sampler = Sampler(available)
            with Client(pair.endpoints[b], timeout=5.0) as c:
                c.call("remove_cache", {"instance_id": "inst", "block_keys": [4]})
                time.sleep(0.5 * TIME_FACTOR)  # proving a negative: deleter rounds, the free still waits
                assert _status(c, 4) == "deleting"  # its free waits for the storage
        finally:
            os.kill(pair.nodes[a].process.pid, signal.SIGCONT)
        wait_until(lambda: _answers_as_follower(pair, a), timeout=20)  # A resumed and stepped down
        with Client(pair.endpoints[b], timeout=5.0) as c:
            assert wait_for(lambda: _served(c, [1, 2, 3]) == 3, timeout=15 * TIME_FACTOR)
            write(c, [5])
            assert _served(c, [1, 2, 3, 5]) == 4
            assert wait_for(lambda: _status(c, 4) == "not_found", timeout=10 * TIME_FACTOR)
        time.sleep(0.5 * TIME_FACTOR)  # the sampler watches a while longer
        seen = sampler.stop()
        assert seen and all(seen), "the registry recorded the storage unavailable"
    finally:
        pair.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)


def _answers_as_follower(pair: Any, node: str) -> bool:
    try:
        return pair.info(node)["leader"] is False
    except KvcmError:
        return False
