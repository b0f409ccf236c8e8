"""Registry state and blocks written with real bytes survive a clean restart and a kill -9 (real
subprocesses), with every storage in agreement with the metadata after it; the data dir is
exclusive to one kvcm."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from kvcm.client import Client
from kvcm.errors import NotFound
from kvcm.testing import (
    TEST_ALLOWED_ROOTS,
    default_overrides,
    make_test_config,
    serve_in_thread,
    start_subprocess,
    stop_subprocess,
)
from tests.block_bytes import read_problems, storage_roots, write_session
from tests.helpers import TIME_FACTOR

pytestmark = pytest.mark.both_stores

KEYS = list(range(1, 101))  # blocks written with real bytes before the restart


@pytest.fixture
def sock_dir():
    path = tempfile.mkdtemp(prefix="kvcm-t-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _populate(endpoint: str) -> None:
    with Client(endpoint) as c:
        c.call("create_instance_group", {"instance_group": {
            "name": "g1", "storage_candidates": ["default-file"],
            "quota": {"capacity": 1 << 30},
        }})
        c.call("register_instance", {
            "instance_group": "g1", "instance_id": "inst-a", "block_size": 64,
            "location_spec_infos": [{"name": "tp0", "size": 4096}, {"name": "tp1", "size": 4096}],
        })
        session = c.call("start_write_cache", {"instance_id": "inst-a", "block_keys": KEYS})
        write_session(session, "inst-a", KEYS, storage_roots(c))
        c.call("finish_write_cache", {"instance_id": "inst-a", "write_session_id": session["write_session_id"],
                                      "success_blocks": {"offset": len(KEYS)}})


def _check(endpoint: str) -> None:
    with Client(endpoint) as c:
        info = c.call("get_instance_info", {"instance_id": "inst-a"})
        assert info["instance_group"] == "g1"
        assert info["instance_info"]["block_size"] == 64
        assert c.call("get_instance_group", {"name": "g1"})["instance_group"]["name"] == "g1"
        with pytest.raises(NotFound):
            c.call("get_instance_info", {"instance_id": "never"})
        assert read_problems(c, "inst-a", KEYS, storage_roots(c)) == []


def _check_offline(data: str) -> None:
    """The storages agree with the metadata after the restart (check() compares them)."""
    with serve_in_thread(data_dir=data, overrides={"reclaim": {"enabled": False}}) as srv:
        srv.app.cache.check()


@pytest.mark.parametrize("kill", [False, True], ids=["sigterm", "kill9"])
def test_registry_survives_restart(sock_dir, kill):
    data = os.path.join(sock_dir, "data")
    endpoint = f"ipc://{sock_dir}/rpc"
    server = start_subprocess(data, endpoint)
    _populate(endpoint)
    code = stop_subprocess(server, kill=kill)
    assert code == (-9 if kill else 0)
    server = start_subprocess(data, endpoint)
    try:
        _check(endpoint)
    finally:
        assert stop_subprocess(server) == 0
    _check_offline(data)


def test_second_kvcm_on_same_dir_refused(sock_dir):
    data = os.path.join(sock_dir, "data")
    server = start_subprocess(data, f"ipc://{sock_dir}/a")
    try:
        second = subprocess.run(
            [sys.executable, "-m", "kvcm", "serve", "--data-dir", data, "--endpoint", f"ipc://{sock_dir}/b",
             "--http-port", "0"],
            capture_output=True, text=True, timeout=60,
        )
        assert second.returncode != 0
        assert "in use by another kvcm" in second.stderr
    finally:
        stop_subprocess(server)


def test_stop_releases_everything_it_opened_under_the_data_dir(sock_dir, tmp_path):
    """An in-process App (the test fixture, an embedding program) closes its storages on stop:
    no lock file, block file or LMDB descriptor stays open, so the dir can be reused or unmounted."""
    from kvcm.testing import serve_in_thread

    data = str(tmp_path / "data")

    def open_under_data() -> list[str]:
        paths = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue  # closed while listing
            if target.startswith(data):
                paths.append(target)
        return paths

    with serve_in_thread(data_dir=data) as srv, srv.client() as c:
        c.call("register_instance", {"instance_group": "default", "instance_id": "i", "block_size": 4,
                                     "location_spec_infos": [{"name": "tp0", "size": 1024}]})
        session = c.call("start_write_cache", {"instance_id": "i", "block_keys": [1, 2]})
        c.call("finish_write_cache", {"instance_id": "i", "write_session_id": session["write_session_id"],
                                      "success_blocks": {"offset": 2}})
        assert open_under_data()  # the store and the default file storage are open
    assert open_under_data() == []


# -- kvcm.testing's default layer, which the [redis] runs of the data-plane suite stand on ---------


@pytest.mark.store_independent
def test_a_default_layer_sits_under_a_tests_own_overrides_and_ends_with_its_block(tmp_path):
    seen: list[str] = []

    def layer(data_dir: str) -> dict[str, dict[str, object]]:
        seen.append(data_dir)
        return {"store": {"backend": "memory"}, "cache": {"max_open_sessions_per_instance": 7}}

    with default_overrides(layer):
        config = make_test_config(str(tmp_path), "ipc://unused", {"cache": {"max_open_sessions_per_instance": 9}})
    assert config.store.backend == "memory" and config.cache.max_open_sessions_per_instance == 9
    assert seen == [str(tmp_path)]
    assert make_test_config(str(tmp_path), "ipc://unused").store.backend == "lmdb"


@pytest.mark.store_independent
def test_a_default_layer_reaches_a_subprocess_as_set_arguments(sock_dir):
    data = os.path.join(sock_dir, "data")
    layer = {"store": {"backend": "memory"}, "reclaim": {"enabled": False},
             "storage": {"allowed_roots": list(TEST_ALLOWED_ROOTS)}}
    with default_overrides(lambda _: layer):
        server = start_subprocess(data, f"ipc://{sock_dir}/rpc")
    try:
        with Client(server.endpoint) as c:
            c.call("register_instance", {"instance_group": "default", "instance_id": "i", "block_size": 4,
                                         "location_spec_infos": [{"name": "tp0", "size": 1024}]})
    finally:
        assert stop_subprocess(server) == 0
    assert not os.path.exists(os.path.join(data, "meta"))  # the memory store: no LMDB was made


ENGINE_BS = 16
ENGINE_TOKENS = [(i * 7919) % 50_000 for i in range(40 * ENGINE_BS)]


def _engine_reports(endpoint: str) -> None:
    """A push source's blocks, logged over several wake-ups: stores, a removal, a store again."""
    from kvcm.proto.kv_events import BlockRemoved, BlockStored, encode_batch

    with Client(endpoint) as c:
        c.call("register_instance", {"instance_group": "default", "instance_id": "llm", "block_size": ENGINE_BS,
                                     "location_spec_infos": [{"name": "tp0", "size": 1024}]})  # fmt: skip
        c.report_events(source_id="push-a", op="register", instance_id="llm")
        batches = [
            [BlockStored(list(range(1, 21)), None, ENGINE_TOKENS[: 20 * ENGINE_BS], ENGINE_BS)],
            [BlockStored(list(range(21, 41)), 20, ENGINE_TOKENS[20 * ENGINE_BS :], ENGINE_BS)],
            [BlockRemoved(list(range(31, 41)))],
            [BlockStored(list(range(31, 36)), 30, ENGINE_TOKENS[30 * ENGINE_BS : 35 * ENGINE_BS], ENGINE_BS)],
        ]
        for seq, events in enumerate(batches):
            payload = encode_batch(events, 1.0 + seq)
            c.report_events(source_id="push-a", op="payloads", payloads=[{"seq": seq, "payload": payload}])
            # past the subscriber's next wake-up (poll_ms 20): persisted; in a subprocess, not observable
            time.sleep(0.3 * TIME_FACTOR)


def _engine_check(endpoint: str) -> None:
    with Client(endpoint) as c:
        reply = c.call("match_engines", {"instance_id": "llm", "token_ids": ENGINE_TOKENS})
        assert [(s["source_id"], s["matched_blocks"]) for s in reply["sources"]] == [("push-a", 35)]
        back = c.report_events(source_id="push-a", op="heartbeat")
        assert back.last_seq == 3 and back.resync  # a push source cannot replay: it asks for a snapshot


@pytest.mark.parametrize("kill", [False, True], ids=["sigterm", "kill9"])
def test_the_engine_index_log_survives_restart(sock_dir, kill):
    """The engine index persisted as a log (engine_log) reloads after a clean stop and after a
    kill -9 with the blocks and position of its last wake-up."""
    data = os.path.join(sock_dir, "data")
    endpoint = f"ipc://{sock_dir}/rpc"
    events = ["--set", "events.poll_ms=20"]
    server = start_subprocess(data, endpoint, events)
    try:
        _engine_reports(endpoint)
    finally:
        code = stop_subprocess(server, kill=kill)
    assert code == (-9 if kill else 0)
    server = start_subprocess(data, endpoint, events)
    try:
        _engine_check(endpoint)
    finally:
        assert stop_subprocess(server) == 0
