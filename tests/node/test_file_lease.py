"""The leader lease as a lock file in a private directory (``ha.coordination = file:///dir``):
one holder at a time, epochs that only rise, the holder's record, release, demote with its
campaign delay, a holder killed or paused (real subprocesses), a lock file removed by hand, and a
directory others may write refused."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvcm.errors import StartRefused
from kvcm.ha.campaign import not_leader
from kvcm.ha.filelease import LOCK_FILE, MEMBERS_DIR, RECORD_FILE, FileLease, coordination_dir
from kvcm.ha.floor import EpochFloor
from tests.helpers import TIME_FACTOR, wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def lease(d: Path, node: str, **kw) -> FileLease:
    kw.setdefault("lease_ms", 1000)
    kw.setdefault("renew_ms", 100)
    return FileLease(str(d), node, f"tcp://127.0.0.1:{abs(hash(node)) % 20000 + 20000}", **kw)


def record(d: Path) -> dict:
    return json.loads((d / RECORD_FILE).read_text())


def test_one_holder_names_itself_and_the_other_follows(tmp_path):
    a, b = lease(tmp_path, "n1"), lease(tmp_path, "n2")
    assert a.try_acquire() and a.is_leader() and a.epoch == 1
    assert not b.try_acquire() and not b.is_leader()
    assert b.holder is not None and (b.holder.node_id, b.holder.epoch) == ("n1", 1)
    assert record(tmp_path)["pid"] == os.getpid()
    for name in (LOCK_FILE, RECORD_FILE):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600
    err = not_leader(b.known_holder(max_age_s=0), "n2")
    assert err.detail == {"leader_endpoint": a.endpoint, "leader_node_id": "n1"}
    a.release()
    assert not a.is_leader() and b.refresh_holder() is None  # released: names nobody
    assert not (tmp_path / LOCK_FILE).exists()  # a clean release leaves no lock file
    assert b.try_acquire() and b.epoch == 2
    assert not a.try_acquire() and a.holder is not None and a.holder.node_id == "n2"


def test_epochs_rise_above_the_floor_and_the_last_record(tmp_path):
    floor = EpochFloor(str(tmp_path / "floor"))
    floor.raise_to(41)
    a = lease(tmp_path / "c", "n1", floor=floor)
    assert a.try_acquire() and a.epoch == 42 and floor.get() == 42
    a.release()
    b = lease(tmp_path / "c", "n2")  # no floor of its own: the record alone says 42
    assert b.try_acquire() and b.epoch == 43


HOLDER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from kvcm.ha.filelease import FileLease
    lease = FileLease({d!r}, "child", "tcp://127.0.0.1:1", lease_ms=1000, renew_ms=100)
    assert lease.try_acquire()
    print("held", flush=True)
    while True:
        time.sleep(0.05)
        lease.renew()
""")


def _child_holder(d: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER.format(root=ROOT, d=str(d))], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_killed_holder_frees_the_lease_at_once(tmp_path):
    child = _child_holder(tmp_path)
    b = lease(tmp_path, "n2")
    try:
        assert not b.try_acquire()
        assert b.known_holder(max_age_s=0) is not None and b.holder.node_id == "child"
        child.kill()
        child.wait()
        # The record still names the dead process: it names nobody now.
        assert b.refresh_holder() is None
        assert b.try_acquire() and b.epoch == 2  # the kernel dropped the dead holder's flock
    finally:
        child.kill()
        b.release()


def test_a_paused_holder_keeps_the_lease_and_renews_on_resume(tmp_path):
    """A flock does not expire: while its holder is stopped nobody takes over (it writes
    nothing meanwhile); once resumed it still holds the lock."""
    child = _child_holder(tmp_path)
    b = lease(tmp_path, "n2")
    try:
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 1.5 * TIME_FACTOR
        while time.monotonic() < deadline:
            assert not b.try_acquire()
            time.sleep(0.1)
        os.kill(child.pid, signal.SIGCONT)
        time.sleep(0.3)
        assert not b.try_acquire() and b.holder is not None and b.holder.node_id == "child"
    finally:
        child.kill()
        child.wait()


def test_a_lock_file_removed_by_hand_ends_the_term_at_the_next_renew(tmp_path):
    a = lease(tmp_path, "n1")
    changes: list[bool] = []
    a._on_change = changes.append
    a.step()
    assert a.is_leader() and changes == [True]
    (tmp_path / LOCK_FILE).unlink()
    a.step()  # the renew finds the path no longer names the locked file; the same round takes it anew
    assert a.is_leader() and a.epoch == 2 and changes == [True, True]  # a new term: told as such
    assert (tmp_path / LOCK_FILE).exists()
    a.release()


def test_demote_hands_over_and_waits_the_campaign_delay(tmp_path):
    a = lease(tmp_path, "n1", campaign_delay_ms=600)
    b = lease(tmp_path, "n2")
    a.step()
    b.step()
    assert a.is_leader() and not b.is_leader()
    assert a.demote() and not b.demote()
    a.step()  # gives the lease up
    assert not a.is_leader() and record(tmp_path).get("released") is True
    b.step()
    assert b.is_leader() and b.epoch == 2
    b.release()
    a.step()  # within its campaign delay: does not contend
    assert not a.is_leader()
    wait_until(lambda: (a.step(), a.is_leader())[1], timeout=3 * TIME_FACTOR)
    assert a.epoch == 3
    a.release()


def test_the_thread_takes_over_within_a_renew_interval(tmp_path):
    a = lease(tmp_path, "n1")
    b = lease(tmp_path, "n2", renew_ms=100)
    assert a.try_acquire()
    b.start()
    try:
        time.sleep(0.3)
        assert not b.is_leader()
        released = time.monotonic()
        a.release()
        wait_until(b.is_leader, timeout=2 * TIME_FACTOR)
        assert time.monotonic() - released < 0.5 * TIME_FACTOR
    finally:
        b.stop()
    assert not b.is_leader()


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_a_directory_others_may_write_is_refused(tmp_path, mode):
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(mode)
    with pytest.raises(StartRefused, match="writable by nobody else"):
        lease(d, "n1")
    assert os.listdir(d) == []  # nothing created there


def test_a_symlink_at_the_record_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    d = tmp_path / "c"
    d.mkdir(mode=0o700)
    (d / RECORD_FILE).symlink_to(victim)
    a = lease(d, "n1")
    assert a.try_acquire() and a.epoch == 1
    assert victim.read_text() == "precious"
    assert not (d / RECORD_FILE).is_symlink() and record(d)["node_id"] == "n1"
    a.release()


def test_coordination_uri():
    assert coordination_dir("file:///var/lib/kvcm/") == "/var/lib/kvcm"
    with pytest.raises(ValueError):
        coordination_dir("file://host/dir")


def test_members_list_the_announced_nodes_and_the_leader_forgets_the_long_silent(tmp_path):
    a, b = lease(tmp_path, "n1"), lease(tmp_path, "n2")
    assert a.try_acquire()
    a.announce()
    b.announce()
    members = tmp_path / MEMBERS_DIR
    silent = members / (b"n9".hex() + ".json")  # a node gone for 100 s: ten leases ago
    silent.write_text(json.dumps({"node_id": "n9", "endpoint": "tcp://10.0.0.9:6381", "at": time.time() - 100}))
    (members / "notes.txt").write_text("not ours")  # neither read nor removed
    (members / (b"n8".hex() + ".json")).symlink_to(tmp_path / RECORD_FILE)  # not followed
    assert [m.node_id for m in b.members()] == ["n1", "n2"]
    assert silent.exists()  # a follower lists without removing
    assert [(m.node_id, m.endpoint) for m in a.members()] == [("n1", a.endpoint), ("n2", b.endpoint)]
    assert not silent.exists() and (members / "notes.txt").exists()
    assert stat.S_IMODE(members.stat().st_mode) == 0o700
    assert stat.S_IMODE((members / (b"n1".hex() + ".json")).stat().st_mode) == 0o600
