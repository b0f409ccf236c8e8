"""The asyncio client: many calls in flight from one task against a real server, a real server
subprocess killed while calls are pending, the retry rule, late replies, close()."""

from __future__ import annotations

import asyncio
import importlib.machinery
import importlib.util
import pathlib
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq

import kvcm.aio
from kvcm.client import Client
from kvcm.errors import Code, InvalidArgument, NotFound, Unavailable
from kvcm.proto.results import CacheLocations, Health, Mask, Removed
from kvcm.rpc.curve import create_certificates
from kvcm.testing import serve_in_thread, start_subprocess, stop_subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
SPECS = [{"name": "tp0", "size": 1024}]


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    with serve_in_thread() as srv:
        with srv.client() as kv:
            kv.register_instance(instance_group="default", instance_id="ai", block_size=4, location_spec_infos=SPECS)
            for base in range(0, 256, 8):
                session = kv.start_write_cache(instance_id="ai", block_keys=list(range(base, base + 8)))
                kv.finish_write_cache(instance_id="ai", write_session_id=session.write_session_id,
                                      success_blocks=Mask(offset=8))
        yield srv


def load_generator() -> Any:
    """scripts/gen_client as a module."""
    loader = importlib.machinery.SourceFileLoader("gen_client", str(ROOT / "scripts" / "gen_client"))
    spec = importlib.util.spec_from_loader("gen_client", loader)
    assert spec is not None
    gen = importlib.util.module_from_spec(spec)
    loader.exec_module(gen)
    return gen


def test_committed_typed_methods_are_the_generated_ones() -> None:
    """Both clients' typed methods are what scripts/gen_client writes from the protocol."""
    for path, text in load_generator().generated().items():
        assert path.read_text() == text, f"{path.name} is stale: run scripts/gen_client"
    sync_methods = {n for n in dir(Client) if n in kvcm.aio.METHODS}
    assert sync_methods == {n for n in dir(kvcm.aio.Client) if n in kvcm.aio.METHODS}
    for name in sync_methods:
        assert asyncio.iscoroutinefunction(getattr(kvcm.aio.Client, name)), name


def test_many_calls_in_flight_from_one_task(server: Any) -> None:
    async def main() -> None:
        async with kvcm.aio.Client(server.endpoint, timeout=20) as kv:
            n = 300
            calls = [asyncio.ensure_future(kv.get_cache_location(
                instance_id="ai", query_type="prefix_match", block_keys=list(range(i % 256, i % 256 + 1 + i % 7))))
                for i in range(n)]  # fmt: skip
            await asyncio.sleep(0)  # every call has sent its request; none is answered yet
            assert kv.in_flight >= 64
            replies = await asyncio.gather(*calls)
            assert kv.in_flight == 0
            for i, got in enumerate(replies):
                start, length = i % 256, 1 + i % 7
                assert isinstance(got, CacheLocations)
                assert len(got.locations) == min(length, 256 - start), i  # keys past 255 were never written
                first = got.locations[0].location_specs[0].uri
                assert first == expected_uris[start], i
            plain = await kv.call("get_cache_location", {"instance_id": "ai", "query_type": "batch_get",
                                                         "block_keys": [0, 999]})
            assert [x["type"] for x in plain["locations"]] == ["file", "unspecified"]
            assert isinstance(await kv.check_health(), Health)

    with server.client() as sync:
        expected_uris = [sync.get_cache_location(instance_id="ai", query_type="prefix_match", block_keys=[k])
                         .locations[0].location_specs[0].uri for k in range(256)]
    asyncio.run(main())


def test_typed_errors_and_results_match_the_sync_client(server: Any) -> None:
    async def main() -> None:
        async with kvcm.aio.Client(server.endpoint, timeout=10) as kv:
            with pytest.raises(NotFound) as exc:
                await kv.get_instance_info(instance_id="nobody")
            assert exc.value.code is Code.INSTANCE_NOT_EXIST
            with pytest.raises(InvalidArgument, match="ttl_seconds"):
                await kv.pin_cache(instance_id="ai", block_keys=[1], ttl_seconds=0)
            return await kv.get_cache_meta(instance_id="ai", block_keys=[1, 2, 999], detail_level=1)

    meta = asyncio.run(main())
    with server.client() as sync:
        assert meta == sync.get_cache_meta(instance_id="ai", block_keys=[1, 2, 999], detail_level=1)


def test_server_killed_with_calls_pending(tmp_path: Any) -> None:
    """SIGKILL a real server subprocess while >= 64 calls wait on it: each gets a typed TIMEOUT
    error within its own timeout (and its retries, for idempotent methods), plus small slack."""
    data = str(tmp_path / "data")
    endpoint = f"ipc://{tmp_path}/rpc"
    srv = start_subprocess(data, endpoint, ["--set", "reclaim.enabled=false"])
    try:
        with Client(endpoint, timeout=10) as sync:
            sync.register_instance(instance_group="default", instance_id="k", block_size=4,
                                   location_spec_infos=SPECS)
        assert srv.process is not None
        timeout, slack = 1.0, 1.0

        async def timed(coro: Any) -> tuple[BaseException | None, float]:
            t0 = time.monotonic()
            try:
                await coro
            except Exception as exc:  # noqa: BLE001 - the test checks the type below
                return exc, time.monotonic() - t0
            return None, time.monotonic() - t0

        async def main() -> None:
            async with kvcm.aio.Client(endpoint, timeout=timeout, retries=1) as kv:
                assert (await kv.check_health()).status == "ok"
                srv.process.send_signal(signal.SIGSTOP)  # holds every request from here on
                reads = [asyncio.ensure_future(timed(kv.get_cache_location(
                    instance_id="k", query_type="prefix_match", block_keys=[i]))) for i in range(40)]
                writes = [asyncio.ensure_future(timed(kv.start_write_cache(instance_id="k", block_keys=[i])))
                          for i in range(40)]
                await asyncio.sleep(0.1)
                assert kv.in_flight >= 64
                srv.process.send_signal(signal.SIGKILL)
                srv.process.wait(10)
                for outcome, limit in [(await asyncio.gather(*reads), 2 * timeout),
                                       (await asyncio.gather(*writes), timeout)]:
                    for exc, took in outcome:
                        assert isinstance(exc, Unavailable) and exc.code is Code.TIMEOUT, exc
                        assert limit * 0.9 <= took <= limit + slack, took  # reads: both attempts
                assert kv.in_flight == 0

        asyncio.run(main())
    finally:
        stop_subprocess(srv, kill=True)


# -- a stub ROUTER (a real socket) for the retry and late-reply rules ----------------------------------


class Stub:
    def __init__(self, endpoint: str, answer: Any) -> None:
        self.endpoint, self.answer = endpoint, answer
        self.seen: list[tuple[int, str]] = []
        self._stop, self._ready = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Stub:
        self._thread.start()
        self._ready.wait(5)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.bind(self.endpoint)
        self._ready.set()
        try:
            while not self._stop.is_set():
                if not sock.poll(20):
                    continue
                ident, payload = sock.recv_multipart()
                req = msgpack.unpackb(payload)
                self.seen.append((req[1], req[2]))
                for frame in self.answer(self.seen):
                    sock.send_multipart([ident, frame])
        finally:
            sock.close(0)


def reply(msgid: int, result: Any) -> bytes:
    return bytes(msgpack.packb([1, msgid, None, result]))


def test_only_idempotent_methods_are_retried(tmp_path: Any) -> None:
    async def main(endpoint: str) -> None:
        async with kvcm.aio.Client(endpoint, timeout=0.2, retries=2) as kv:
            results = await asyncio.gather(
                kv.get_cache_location(instance_id="i", query_type="prefix_match", block_keys=[1]),
                kv.start_write_cache(instance_id="i", block_keys=[1]),
                kv.remove_cache(instance_id="i", block_keys=[1]),
                kv.call("trim_cache", {"instance_id": "i", "strategy": "remove_all_cache"}, retry=True),
                return_exceptions=True)
            for got in results:
                assert isinstance(got, Unavailable) and got.code is Code.TIMEOUT
            assert "3 attempt(s)" in str(results[0]) and "1 attempt(s)" in str(results[1])

    with Stub(f"ipc://{tmp_path}/s", lambda seen: []) as stub:
        asyncio.run(main(stub.endpoint))
    methods = sorted(m for _, m in stub.seen)
    assert methods == ["get_cache_location"] * 3 + ["remove_cache", "start_write_cache"] + ["trim_cache"] * 3
    ids = [i for i, m in stub.seen if m == "get_cache_location"]
    assert len(set(ids)) == 3  # each attempt under its own msgid


def test_a_late_reply_to_the_first_attempt_is_ignored(tmp_path: Any) -> None:
    def answer(seen: list[tuple[int, str]]) -> list[bytes]:
        if len(seen) == 1:
            return []  # the first attempt times out...
        first, retry = seen[0][0], seen[-1][0]
        # ...and its reply arrives just before the retry's: it must not be taken for it
        return [reply(first, {"locations": []}), reply(retry, {"locations": [
            {"type": "file", "spec_size": 1, "location_specs": [{"name": "tp0", "uri": "file://x/retry"}]}]})]

    async def main(endpoint: str) -> CacheLocations:
        async with kvcm.aio.Client(endpoint, timeout=0.3, retries=1) as kv:
            return await kv.get_cache_location(instance_id="i", query_type="prefix_match", block_keys=[1])

    with Stub(f"ipc://{tmp_path}/s", answer) as stub:
        got = asyncio.run(main(stub.endpoint))
    assert got.locations[0].location_specs[0].uri == "file://x/retry"


def test_close_fails_every_pending_call(tmp_path: Any) -> None:
    async def main(endpoint: str) -> None:
        kv = kvcm.aio.Client(endpoint, timeout=30)
        calls = [asyncio.ensure_future(kv.remove_cache(instance_id="i", block_keys=[i])) for i in range(70)]
        await asyncio.sleep(0.05)
        assert kv.in_flight == 70
        t0 = time.monotonic()
        await kv.close()
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert time.monotonic() - t0 < 1.0
        for got in results:
            assert isinstance(got, Unavailable) and got.code is Code.SHUTTING_DOWN
        with pytest.raises(RuntimeError, match="closed"):
            await kv.check_health()
        await kv.close()  # idempotent

    with Stub(f"ipc://{tmp_path}/s", lambda seen: []) as stub:
        asyncio.run(main(stub.endpoint))


def test_per_call_timeout_and_replies_in_any_order(tmp_path: Any) -> None:
    def answer(seen: list[tuple[int, str]]) -> list[bytes]:
        if len(seen) != 3:
            return []  # the fourth request (check_health) is never answered
        return [reply(msgid, {"removed": msgid % 1000}) for msgid, _ in reversed(seen)]

    async def main(endpoint: str) -> None:
        async with kvcm.aio.Client(endpoint, timeout=30) as kv:
            calls = [asyncio.ensure_future(kv.remove_cache(instance_id="i", block_keys=[i])) for i in range(3)]
            await asyncio.sleep(0.05)  # the three are sent (and answered, last first) before the fourth
            t0 = time.monotonic()
            with pytest.raises(Unavailable):
                await kv.check_health(timeout=0.2)  # the stub holds it: only the short timeout ends it
            assert time.monotonic() - t0 < 5
            got = await asyncio.gather(*calls)
            assert all(isinstance(r, Removed) for r in got)
            assert [r.removed for r in got] == [msgid % 1000 for msgid, _ in stub.seen[:3]]

    with Stub(f"ipc://{tmp_path}/s", answer) as stub:
        asyncio.run(main(stub.endpoint))


def test_curve_server_key_and_plaintext_refusal(tmp_path: Any) -> None:
    server_public, server_secret, _ = create_certificates(str(tmp_path / "server"), "server")
    overrides = {"server": {"curve_secret_key_file": server_secret}}  # any client key, never plaintext

    async def main(endpoint: str) -> None:
        async with kvcm.aio.Client(endpoint, timeout=10, curve_server_key=server_public) as kv:
            assert (await kv.check_health()).status == "ok"
        async with kvcm.aio.Client(endpoint, timeout=0.5, retries=0) as plain:
            with pytest.raises(Unavailable) as exc:
                await plain.check_health()
            assert exc.value.code is Code.TIMEOUT
    with pytest.raises(InvalidArgument, match="curve_server_key"):
        kvcm.aio.Client("ipc:///nowhere", curve_client_keys=(b"x" * 40, b"y" * 40))
    with serve_in_thread(overrides=overrides) as server:
        asyncio.run(main(server.endpoint))
