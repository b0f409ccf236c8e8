"""Storage roots left by a deleted data dir: taken over when the owner is provably gone, refused
otherwise, and nothing kvcm did not create is ever deleted (real files, /dev/shm, a real server,
``kvcm storage release`` as a subprocess).

The attacker is a local user who can write the shared root: every marker they can plant is
unsigned, or signed with a key they do not have, and proves nothing.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvcm.backends.storage.file import FileStorage
from kvcm.backends.storage.host import TAKEOVERS, machine_id
from kvcm.backends.storage.ownership import ForeignDirectory, Marker, Owner, marker_key, read_marker, write_marker
from kvcm.backends.storage.shm import ShmStorage
from kvcm.config import ConfigError, load
from kvcm.errors import Code, KvcmError
from kvcm.testing import serve_in_thread
from tests.helpers import add_group, finish, register, start

QUIET = {"reclaim": {"enabled": False}, "cache": {"delete_poll_ms": 20, "session_check_ms": 50}}
DELETE = {**QUIET, "storage": {"orphans": "delete"}}  # storage.orphans: a takeover deletes the dead owner's containers
SPECS = [{"name": "tp0", "size": 4096}]
Listing = Callable[[], dict[str, bytes]]


@pytest.fixture(autouse=True)
def host_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """This host's key in a temp dir: the test's kvcm and its subprocesses share it."""
    state = str(tmp_path / "state")
    monkeypatch.setenv("KVCM_STATE_DIR", state)
    return state


@pytest.fixture
def shm_prefix() -> Iterator[str]:
    prefix = f"kvcm.takeover.{uuid.uuid4().hex[:8]}."
    yield prefix
    for path in glob.glob(f"/dev/shm/{prefix}*"):
        os.unlink(path)


@dataclasses.dataclass
class Root:
    storage: dict[str, Any]
    marker: str
    release: str  # what ``kvcm storage release`` takes
    listing: Listing
    plant: Callable[[str, bytes], None]  # a file kvcm did not create, by name


def _file_root(tmp_path: Path) -> Root:
    root = tmp_path / "shared"
    root.mkdir()

    def listing() -> dict[str, bytes]:
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

    def plant(name: str, data: bytes) -> None:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)

    storage = {"global_unique_name": "shared", "storage_type": "file", "storage_spec": {"root_path": str(root)}}
    return Root(storage, str(root / ".kvcm-storage"), str(root), listing, plant)


def _shm_root(prefix: str) -> Root:
    def listing() -> dict[str, bytes]:
        return {p: Path(p).read_bytes() for p in sorted(glob.glob(f"/dev/shm/{prefix}*"))}

    def plant(name: str, data: bytes) -> None:
        Path(f"/dev/shm/{prefix}{name}").write_bytes(data)

    spec = {"shm_dir": "/dev/shm", "prefix": prefix, "segment_size": 1 << 20}
    storage = {"global_unique_name": "shared", "storage_type": "shm", "storage_spec": spec}
    return Root(storage, f"/dev/shm/{prefix}kvcm-storage", f"/dev/shm/{prefix}", listing, plant)


@pytest.fixture(params=["file", "shm"])
def root(request: pytest.FixtureRequest, tmp_path: Path, shm_prefix: str) -> Root:
    return _file_root(tmp_path) if request.param == "file" else _shm_root(shm_prefix)


def _use(c: Any, root: Root, keys: list[int], group: str = "g") -> None:
    """add_storage (no adopt), a group on it, and a write that creates containers."""
    c.call("add_storage", {"storage": root.storage})
    add_group(c, group, ["shared"])
    register(c, group=group, specs=SPECS)
    finish(c, start(c, keys))


def _owned_root(tmp_path: Path, root: Root) -> tuple[str, Marker]:
    """A data dir ``first`` that used the root, stopped; the marker it left."""
    first = str(tmp_path / "first")
    with serve_in_thread(data_dir=first, overrides=QUIET) as server, server.client() as c:
        _use(c, root, [1, 2, 3])
    marker = read_marker(root.marker)
    assert marker is not None and marker.host_signed and marker.host == machine_id()
    root.plant("precious" if root.storage["storage_type"] == "shm" else "s4096/00000099.kv", b"not kvcm's")
    return first, marker


def test_root_of_a_deleted_data_dir_is_taken_over(tmp_path: Path, root: Root) -> None:
    first, old = _owned_root(tmp_path, root)
    before = root.listing()
    assert any(old.storage_id in name for name in before)  # the dead owner's containers are there
    shutil.rmtree(first)
    count = TAKEOVERS.count
    second = str(tmp_path / "second")
    with serve_in_thread(data_dir=second, overrides=QUIET) as server, server.client() as c:
        assert _takeovers_scraped(server.http_port) == count
        _use(c, root, [4, 5])
        assert TAKEOVERS.count == count + 1 == _takeovers_scraped(server.http_port)
    new = read_marker(root.marker, marker_key(second, create=False))
    assert new is not None and new.authentic and new.data_dir == second and old.storage_id in new.adopted
    after = root.listing()
    assert {k: v for k, v in after.items() if k in before and "kvcm-storage" not in k} == \
        {k: v for k, v in before.items() if "kvcm-storage" not in k}  # kept, unindexed, byte for byte
    assert any(new.storage_id in name for name in after)  # and the new owner writes its own


def test_root_of_this_data_dir_recreated_at_the_same_path_is_taken_over(tmp_path: Path, root: Root) -> None:
    first, old = _owned_root(tmp_path, root)
    shutil.rmtree(first)  # a redeploy wipes the working dir and starts again there
    with serve_in_thread(data_dir=first, overrides=QUIET) as server, server.client() as c:
        _use(c, root, [7])
    new = read_marker(root.marker, marker_key(first, create=False))
    assert new is not None and new.authentic and new.data_dir_id != old.data_dir_id


def _refused(tmp_path: Path, root: Root, *needles: str, overrides: dict[str, Any] = DELETE) -> None:
    """add_storage from another data dir is refused and nothing in the root changes (by default
    even under ``storage.orphans = "delete"``: it applies to proven takeovers only)."""
    before, count = root.listing(), TAKEOVERS.count
    with serve_in_thread(data_dir=str(tmp_path / "second"), overrides=overrides) as server, server.client() as c, \
            pytest.raises(KvcmError) as info:
        c.call("add_storage", {"storage": root.storage})
    assert info.value.code is Code.INVALID_ARGUMENT
    for needle in needles:
        assert needle in info.value.message
    assert root.listing() == before and TAKEOVERS.count == count


@pytest.mark.parametrize("orphans", ["keep", "delete"])
def test_root_of_a_live_data_dir_is_refused_and_untouched(tmp_path: Path, root: Root, orphans: str) -> None:
    _owned_root(tmp_path, root)
    _refused(tmp_path, root, "belongs to storage 'shared'", "nothing there was touched",
             f"kvcm storage release {root.release}", overrides={**QUIET, "storage": {"orphans": orphans}})


def test_root_whose_data_dir_path_holds_another_data_dir_is_taken_over(tmp_path: Path, root: Root) -> None:
    first, _ = _owned_root(tmp_path, root)
    shutil.rmtree(first)
    marker_key(first)  # another data dir lives at that path now (its own key)
    with serve_in_thread(data_dir=str(tmp_path / "second"), overrides=QUIET) as server, server.client() as c:
        _use(c, root, [4])


def test_another_hosts_marker_is_refused_even_when_signed(tmp_path: Path, root: Root) -> None:
    first, old = _owned_root(tmp_path, root)
    shutil.rmtree(first)
    # Signed with this host's key (a home directory shared by several hosts holds one key for
    # all): the marker is kvcm's, but whether that host's data dir lives cannot be seen here.
    write_marker(root.marker, dataclasses.replace(old, host="0" * 32))
    assert (m := read_marker(root.marker)) is not None and m.host_signed
    _refused(tmp_path, root, "on host " + "0" * 32, "kvcm storage release")


def _plant_marker(root: Root, old: Marker, **fields: object) -> None:
    body = {"kvcm_marker": 3, "storage_id": old.storage_id, "storage": "shared", "data_dir_id": "ffffffff",
            "data_dir": "/nonexistent/kvcm-data", "adopted": [], "host": machine_id(), **fields}
    os.unlink(root.marker)
    Path(root.marker).write_text(json.dumps(body))


@pytest.mark.parametrize("forged", [{}, {"host_mac": "00" * 32, "mac": "11" * 32}], ids=["unsigned", "forged-mac"])
def test_planted_marker_is_refused_and_nothing_is_deleted(tmp_path: Path, root: Root, forged: dict[str, str]) -> None:
    first, old = _owned_root(tmp_path, root)
    shutil.rmtree(first)
    _plant_marker(root, old, **forged)  # names this host and a data dir that does not exist
    _refused(tmp_path, root, "belongs to storage 'shared'")
    if root.storage["storage_type"] != "file":
        return
    before = root.listing()
    data = str(tmp_path / "third")  # even an open told to discard orphans deletes nothing on its word
    owner = Owner("abcdef01", "eeeeeeee", data, on_foreign="discard", key=marker_key(data))
    backend = FileStorage("shared", root.storage["storage_spec"], data, owner)
    backend.open()
    backend.close()
    assert {k: v for k, v in root.listing().items() if k != ".kvcm-storage"} == \
        {k: v for k, v in before.items() if k != ".kvcm-storage"}


def test_takeover_with_discard_deletes_only_the_dead_owners_containers(tmp_path: Path) -> None:
    root = _file_root(tmp_path)
    first, old = _owned_root(tmp_path, root)
    root.plant(f"s4096/{old.storage_id}-notes.txt", b"named like kvcm's, but no container name")
    shutil.rmtree(first)
    before = root.listing()
    data = str(tmp_path / "second")
    owner = Owner("abcdef01", "eeeeeeee", data, on_foreign="discard", key=marker_key(data))
    backend = FileStorage("shared", root.storage["storage_spec"], data, owner)
    backend.open()
    backend.close()
    after = root.listing()
    gone = sorted(set(before) - set(after))
    assert gone and all(name.startswith(f"s4096/{old.storage_id}-0") for name in gone)
    assert after["s4096/00000099.kv"] == b"not kvcm's"
    assert f"s4096/{old.storage_id}-notes.txt" in after


def _takeovers_scraped(port: int | None) -> float:
    """``kvcm_storage_takeovers_total`` as the side HTTP port's ``/metrics`` serves it."""
    assert port is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "kvcm_storage_takeovers_total")


def _container_of(name: str, storage_id: str) -> bool:
    """Whether ``name`` (a listing key) is a container kvcm named with ``storage_id``:
    ``s4096/<id>-<index>.kv`` in a file root, ``<prefix><id>-<index>`` in /dev/shm."""
    return re.search(rf"(^s\d+/|\.){storage_id}-\d+(\.kv)?$", name) is not None


def test_takeover_with_orphans_delete_deletes_exactly_the_dead_owners_containers(tmp_path: Path, root: Root) -> None:
    first, old = _owned_root(tmp_path, root)
    lookalike = f"s4096/{old.storage_id}-notes.txt" if root.storage["storage_type"] == "file" else f"{old.storage_id}-notes"
    root.plant(lookalike, b"named like kvcm's, but no container name")
    shutil.rmtree(first)
    before = root.listing()
    doomed = {name for name in before if _container_of(name, old.storage_id)}
    assert doomed and len(before) - len(doomed) >= 3  # the marker and both planted files stay
    count, second = TAKEOVERS.count, str(tmp_path / "second")
    with serve_in_thread(data_dir=second, overrides=DELETE) as server, server.client() as c:
        assert _takeovers_scraped(server.http_port) == count
        _use(c, root, [4, 5])
        assert _takeovers_scraped(server.http_port) == count + 1
    new = read_marker(root.marker, marker_key(second, create=False))
    assert new is not None and new.authentic and new.data_dir == second and new.adopted == ()
    after = root.listing()
    assert not doomed & set(after)  # every container of the dead owner is gone
    untouched = {k: v for k, v in before.items() if k not in doomed and "kvcm-storage" not in k}
    assert {k: v for k, v in after.items() if k in untouched} == untouched  # nothing else changed
    assert any(_container_of(name, new.storage_id) for name in after)  # the new owner's own


def test_takeover_keeps_the_dead_owners_containers_by_default_and_on_adopt(tmp_path: Path) -> None:
    """The direct open, as ``add_storage`` does it: ``keep`` leaves them, and so does an explicit
    ``adopt`` whatever the policy; ``delete`` removes them."""
    root = _file_root(tmp_path)
    first, old = _owned_root(tmp_path, root)
    shutil.rmtree(first)
    containers = {k: v for k, v in root.listing().items() if _container_of(k, old.storage_id)}
    assert containers
    cases = [("refuse", "keep", containers), ("adopt", "delete", containers), ("refuse", "delete", {})]
    for n, (on_foreign, policy, left) in enumerate(cases):
        data = str(tmp_path / f"data-{n}")
        owner = Owner(f"abcdef0{n}", f"eeeeeee{n}", data, on_foreign, key=marker_key(data), takeover_orphans=policy)
        backend = FileStorage("shared", root.storage["storage_spec"], data, owner)
        backend.open()
        backend.close()
        assert backend.previous_owner is not None and backend.previous_owner.takeover
        assert {k: v for k, v in root.listing().items() if _container_of(k, old.storage_id)} == left
        # the next open must find its root taken over again: its data dir goes too
        shutil.rmtree(data)


def test_delete_policy_never_overrides_a_refusal(tmp_path: Path, root: Root) -> None:
    """A live owner's root, opened directly with ``takeover_orphans="delete"``: refused as is."""
    _owned_root(tmp_path, root)
    before = root.listing()
    data = str(tmp_path / "third")
    owner = Owner("abcdef01", "eeeeeeee", data, key=marker_key(data), takeover_orphans="delete")
    spec = root.storage["storage_spec"]
    backend: FileStorage | ShmStorage
    if root.storage["storage_type"] == "file":
        backend = FileStorage("shared", spec, data, owner)
    else:
        backend = ShmStorage("shared", spec, data, owner)
    with pytest.raises(ForeignDirectory):
        backend.open()
    assert root.listing() == before


@pytest.mark.parametrize("value", ["discard", "", "Delete"])
def test_a_bad_orphans_value_is_a_config_error(value: str) -> None:
    with pytest.raises(ConfigError, match=r"storage\.orphans"):
        load(environ={}, overrides={"storage": {"orphans": value}})
    assert load(environ={}, overrides={"storage": {"orphans": "delete"}}).storage.orphans == "delete"
    assert load(environ={}).storage.orphans == "keep"


def _release(target: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.run([sys.executable, "-m", "kvcm", "storage", "release", target, *extra],
                          capture_output=True, text=True, env=env, timeout=60)


def test_storage_release_removes_only_a_gone_owners_marker(tmp_path: Path, root: Root) -> None:
    first, _ = _owned_root(tmp_path, root)
    before = root.listing()
    live = _release(root.release)  # the data dir still exists: refused
    assert live.returncode == 1 and "may still live" in live.stderr and root.listing() == before
    shutil.rmtree(first)
    done = _release(root.release)
    assert done.returncode == 0 and "no longer exists" in done.stdout, done.stderr
    assert root.listing() == {k: v for k, v in before.items() if "kvcm-storage" not in k}


def test_storage_release_of_an_unproven_marker_needs_force(tmp_path: Path, root: Root) -> None:
    first, old = _owned_root(tmp_path, root)
    shutil.rmtree(first)
    _plant_marker(root, old, data_dir=first)
    before = root.listing()
    refused = _release(root.release)
    assert refused.returncode == 1 and "--force" in refused.stderr and root.listing() == before
    forced = _release(root.release, "--force")
    assert forced.returncode == 0, forced.stderr
    assert root.listing() == {k: v for k, v in before.items() if "kvcm-storage" not in k}
