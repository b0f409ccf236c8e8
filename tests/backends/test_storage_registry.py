"""Storage registry, URI codec and the health prober (availability flips, hung probes)."""

from __future__ import annotations

import glob
import os
import shutil
import threading
import time

import pytest

from kvcm.backends.storage.base import StorageBackend
from kvcm.backends.storage.registry import STORAGE_BACKENDS, StorageHealth, normalize_spec, open_backend, parse_uri
from kvcm.backends.storage.slots import slot_runs
from kvcm.errors import InvalidArgument
from kvcm.proto.uris import format_uri
from tests.helpers import wait_for


def test_registry_and_unknown_type(tmp_path):
    assert sorted(STORAGE_BACKENDS) == ["3fs", "file", "mooncake", "shm", "tairmempool"]
    with pytest.raises(InvalidArgument, match="3fs, file, mooncake, shm, tairmempool"):
        open_backend("nfs", "x", {}, None)
    for bad in ("", "a/b", "a?b", "a b", "x" * 129):
        with pytest.raises(InvalidArgument, match="storage name"):
            open_backend("mooncake", bad, {}, None)
    with pytest.raises(InvalidArgument, match="storage_spec must be a map"):
        open_backend("mooncake", "m", [1], None)
    with pytest.raises(InvalidArgument, match="capacity_bytes"):
        open_backend("mooncake", "m", {"capacity_bytes": True}, None)
    backend = open_backend("file", "f", {"root_path": "r"}, str(tmp_path))
    assert isinstance(backend, StorageBackend)
    assert backend.type_name == "file" and backend.name == "f"


def test_normalize_spec_is_the_backends_spec_and_touches_nothing(tmp_path):
    """normalize_spec validates with the backend's own reader, fills its defaults, and returns
    a spec that opens to the same backend; it creates no directory, file or segment."""
    data_dir = str(tmp_path / "data")
    file_spec = normalize_spec("file", "f", {"root_path": "blocks/"}, data_dir)
    assert file_spec == {
        "root_path": str(tmp_path / "data" / "blocks"), "key_count_per_file": 0, "file_size": 64 << 20, "capacity_bytes": 0,
        "create_root": True,
    }
    shm_spec = normalize_spec("shm", "side", {}, None)
    assert shm_spec == {"segment_size": 64 << 20, "prefix": "kvcm.side.", "shm_dir": "/dev/shm", "capacity_bytes": 0}
    assert not (tmp_path / "data").exists()
    assert not glob.glob("/dev/shm/kvcm.side.*")
    specs = {
        "file": ({"root_path": str(tmp_path / "abs")}, None),
        "shm": ({"prefix": "kvcm.norm-test.", "shm_dir": str(tmp_path)}, None),
        "3fs": ({"mountpoint": "/m", "root_dir": "r", "touch_file_when_create": True}, None),
        "mooncake": ({"protocol": "rdma", "rdma_device": "mlx5_0"}, None),
        "tairmempool": ({"domain": "d"}, None),
    }
    for kind, (spec, ddir) in specs.items():
        normalized = normalize_spec(kind, "n", spec, ddir)
        assert all(isinstance(v, (str, int, bool)) for v in normalized.values()), kind
        assert normalize_spec(kind, "n", normalized, None) == normalized, kind  # idempotent
        assert STORAGE_BACKENDS[kind]("n", spec, ddir).spec == normalized, kind  # what the backend runs with
    assert not (tmp_path / "abs").exists() and os.listdir(tmp_path) == []


def test_normalize_spec_errors_name_the_field():
    with pytest.raises(InvalidArgument, match="3fs, file, mooncake, shm, tairmempool"):
        normalize_spec("nfs", "x", {}, None)
    with pytest.raises(InvalidArgument, match="storage name"):
        normalize_spec("mooncake", "a/b", {}, None)
    for kind, spec, field in [
        ("file", {"root_path": "rel"}, "storage_spec.root_path"),  # relative without a data dir
        ("file", {"root_path": "/x", "bogus": 1}, "storage_spec.bogus"),
        ("shm", {"shm_dir": "rel"}, "storage_spec.shm_dir"),
        ("tairmempool", {"domain": "d", "node_id": -1}, "storage_spec.node_id"),
        ("mooncake", {"key_prefix": "a&b"}, "storage_spec.key_prefix"),
    ]:
        with pytest.raises(InvalidArgument, match=field.replace(".", r"\.")):
            normalize_spec(kind, "x", spec, None)


def test_uri_codec():
    uri = format_uri("mooncake", "mc_01", "/", {"size": 1024, "key": "inst/tp0/7b"})
    assert uri == "mooncake://mc_01/?key=inst/tp0/7b&size=1024"  # Tair: params sorted, unescaped
    parsed = parse_uri(uri)
    assert (parsed.scheme, parsed.host, parsed.path) == ("mooncake", "mc_01", "/")
    assert parsed.params == {"key": "inst/tp0/7b", "size": "1024"} and parsed.int_param("size") == 1024
    assert str(parsed) == uri
    assert parse_uri("file://nfs_01/tmp/nfs/a_b?blkid=1&size=8").path == "/tmp/nfs/a_b"
    assert parse_uri("shm://s").path == "" and parse_uri("shm://s").params == {}
    for bad in ("nfs_01/a", "file://", "file:///a", "file://h/a?x", "file://h/a?=1"):
        with pytest.raises(InvalidArgument):
            parse_uri(bad)
    with pytest.raises(InvalidArgument, match="size"):
        parse_uri("file://h/a?size=-1").int_param("size")
    assert slot_runs([5, 1, 2, 3, 7, 6]) == [(1, 3), (5, 3)]


class Fake:
    """A backend whose probe result the test sets (or blocks on an event)."""

    type_name = "fake"

    def __init__(self, name: str) -> None:
        self.name = name
        self.ok = True
        self.gate: threading.Event | None = None
        self.calls = 0

    def health(self) -> bool:
        self.calls += 1
        if self.gate is not None:
            self.gate.wait(10)
        if self.ok is None:
            raise RuntimeError("probe exploded")
        return self.ok


def prober(backends, **kw):
    flips: list[tuple[str, bool]] = []
    health = StorageHealth(lambda: list(backends), lambda n, v: flips.append((n, v)), **kw)
    return health, flips


def test_first_round_reports_then_only_flips():
    a, b = Fake("a"), Fake("b")
    b.ok = False
    health, flips = prober([a, b], fall=2)
    assert health.run_once() == {"a": True, "b": False}
    assert sorted(flips) == [("a", True), ("b", False)]
    flips.clear()
    health.run_once()
    assert flips == []
    a.ok = False
    health.run_once()
    assert flips == []  # one failure is not enough with fall=2
    health.run_once()
    assert flips == [("a", False)]
    a.ok = b.ok = True
    health.run_once()
    assert sorted(flips) == [("a", False), ("a", True), ("b", True)]


def test_raising_probe_is_a_failure_and_removed_storages_are_forgotten():
    a = Fake("a")
    backends = [a]
    health, flips = prober(backends, fall=1)
    health.run_once()
    a.ok = None
    assert health.run_once() == {"a": False}
    backends.clear()
    assert health.run_once() == {}
    backends.append(a)
    a.ok = True
    health.run_once()
    assert flips == [("a", True), ("a", False), ("a", True)]  # re-added: reported afresh


def test_hung_probe_counts_as_failed_and_is_not_stacked():
    a = Fake("a")
    health, flips = prober([a], fall=1, probe_timeout=0.05)
    health.run_once()
    a.gate = threading.Event()
    started = time.monotonic()
    assert health.run_once() == {"a": False}
    assert health.run_once() == {"a": False}
    assert time.monotonic() - started < 2
    assert a.calls == 2  # the second round waited on the stuck probe instead of starting another
    a.gate.set()
    a.gate = None
    wait_for(lambda: not health._inflight["a"].thread.is_alive())  # the released probe ends
    health.run_once()  # collects the old probe's result
    assert flips[-1] == ("a", True)


def test_callback_failure_is_retried_next_round():
    a = Fake("a")
    seen: list[bool] = []

    def flaky(name: str, value: bool) -> None:
        seen.append(value)
        if len(seen) == 1:
            raise RuntimeError("control plane busy")

    health = StorageHealth(lambda: [a], flaky)
    with pytest.raises(RuntimeError):
        health.run_once()
    health.run_once()
    assert seen == [True, True]


def test_thread_flips_a_real_file_storage(tmp_path):
    backend = open_backend("file", "f", {"root_path": "r"}, str(tmp_path))
    state: dict[str, bool] = {}
    changed = threading.Event()

    def set_available(name: str, value: bool) -> None:
        state[name] = value
        changed.set()

    health = StorageHealth(lambda: [backend], set_available, fall=1)
    health.start(0.01)
    try:
        assert changed.wait(5) and state == {"f": True}
        changed.clear()
        shutil.rmtree(tmp_path / "r")
        assert changed.wait(5) and state == {"f": False}
        changed.clear()
        (tmp_path / "r").mkdir()
        assert changed.wait(5) and state == {"f": True}
    finally:
        health.stop()
    health.stop()  # idempotent
