"""``events.max_sources``: add_event_source past the limit is refused, never accepted and left
unconnected; a limit above ZeroMQ's default socket cap really connects that many sources."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import zmq

from kvcm.config import ConfigError
from kvcm.engines.index import EngineIndex
from kvcm.engines.sourceconn import SOCKETS_PER_SOURCE, size_context
from kvcm.engines.sources import SourceSpec, SubscriberSettings
from kvcm.engines.subscriber import EventSubscriber
from kvcm.errors import CapacityError, Code
from kvcm.node.app import App
from kvcm.proto.kv_events import BlockStored, encode_batch
from kvcm.testing import make_test_config, serve_in_thread

INSTANCE = {"instance_group": "default", "instance_id": "llm", "block_size": 4,
            "location_spec_infos": [{"name": "tp0", "size": 256}]}
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@pytest.fixture
def sockdir():
    path = tempfile.mkdtemp(prefix="kvcm-lim-", dir="/tmp")  # ipc paths must stay short
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _source(sockdir: str, i: int, **extra) -> dict:
    # Nobody binds these endpoints: connecting is asynchronous, so a source is accepted anyway.
    return {"source_id": f"pod-{i}", "instance_id": "llm", "endpoint": f"ipc://{sockdir}/pub{i}", **extra}


def test_past_the_limit_is_refused_and_removing_frees_a_slot(sockdir):
    with serve_in_thread(overrides={"events": {"max_sources": 3}}) as server, server.client() as kv:
        kv.call("register_instance", INSTANCE)
        for i in range(3):
            kv.call("add_event_source", _source(sockdir, i))
        with pytest.raises(CapacityError) as info:
            kv.call("add_event_source", _source(sockdir, 3))
        assert info.value.code is Code.REACH_MAX_ENTITY_CAPACITY
        assert "events.max_sources=3" in info.value.message
        kv.call("add_event_source", _source(sockdir, 2))  # re-adding a followed source is no new one
        assert len(kv.call("list_event_sources", {})["sources"]) == 3
        kv.call("remove_event_source", {"source_id": "pod-0"})
        kv.call("add_event_source", _source(sockdir, 3))
        listed = {s["source_id"] for s in kv.call("list_event_sources", {})["sources"]}
        assert listed == {"pod-1", "pod-2", "pod-3"}


def test_static_sources_count(sockdir):
    statics = [json.dumps(_source(sockdir, i)) for i in (10, 11)]
    with serve_in_thread(overrides={"events": {"max_sources": 3, "sources": statics}}) as server, \
            server.client() as kv:
        kv.call("register_instance", INSTANCE)
        kv.call("add_event_source", _source(sockdir, 0))
        with pytest.raises(CapacityError, match=re.escape("events.max_sources")):
            kv.call("add_event_source", _source(sockdir, 1))


def test_start_up_over_the_limit_is_a_config_error(sockdir):
    statics = [json.dumps(_source(sockdir, i)) for i in range(3)]
    data = os.path.join(sockdir, "data")
    config = make_test_config(data, f"ipc://{sockdir}/rpc", {"events": {"max_sources": 2, "sources": statics}})
    with pytest.raises(ConfigError, match=re.escape("exceed events.max_sources=2")):
        App(config)
    # sources registered under a higher limit: lowering it below their number refuses to start
    with serve_in_thread(data_dir=data, overrides={"events": {"max_sources": 3}}) as server, server.client() as kv:
        kv.call("register_instance", INSTANCE)
        for i in range(3):
            kv.call("add_event_source", _source(sockdir, i))
    lowered = make_test_config(data, f"ipc://{sockdir}/rpc", {"events": {"max_sources": 2}})
    with pytest.raises(ConfigError, match="3 registered"):
        App(lowered)


def test_size_context_raises_the_socket_cap():
    ctx = zmq.Context()
    try:
        default = ctx.get(zmq.MAX_SOCKETS)
        size_context(ctx, 10)
        assert ctx.get(zmq.MAX_SOCKETS) == default  # small limits leave the default alone
        size_context(ctx, 600)
        assert ctx.get(zmq.MAX_SOCKETS) >= 600 * SOCKETS_PER_SOURCE > default
        with pytest.raises(ConfigError, match=re.escape("events.max_sources")):
            size_context(ctx, 20000)  # more sockets than libzmq can ever have
    finally:
        ctx.term()


def _answer_replays(router: zmq.Socket) -> None:
    while router.poll(0):
        ident, _empty, _start = router.recv_multipart()
        router.send_multipart([ident, b"", b"", END_SEQ, b""])


def test_600_sources_really_connect(sockdir):
    """Past ZeroMQ's default of 1,023 sockets (255 sources of 4): every source connects, replays
    and receives live batches."""
    n = 600
    ctx = zmq.Context()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    for sock in (pub, router):
        sock.setsockopt(zmq.LINGER, 0)
    for i in range(n):  # one engine socket serves every source, on an endpoint per source
        pub.bind(f"ipc://{sockdir}/p{i}")
        router.bind(f"ipc://{sockdir}/r{i}")
    sub = EventSubscriber(EngineIndex(None, lambda _instance: 4), SubscriberSettings(max_sources=n, poll_ms=10))
    try:
        for i in range(n):
            spec = SourceSpec(f"s{i}", "llm", f"ipc://{sockdir}/p{i}", f"ipc://{sockdir}/r{i}")
            sub.add(spec, sub.index.add_source(spec).generation)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            sub.poll_once(0.01)
            _answer_replays(router)
            snap = sub.snapshot()
            if sum(s["connected"] and not s["replaying"] and s["replays"] > 0 for s in snap.values()) == n:
                break
        snap = sub.snapshot()
        assert sum(s["connected"] for s in snap.values()) == n
        assert all(s["errors"] == 0 for s in snap.values())
        payload = encode_batch([BlockStored([7], None, [1, 2, 3, 4], 4, None, "GPU", None)], time.time(), 0, "map")
        pub.send_multipart([b"", (0).to_bytes(8, "big"), payload])
        while time.monotonic() < deadline and sub.index.blocks_held(f"s{n - 1}") == {}:
            sub.poll_once(0.01)
        assert sub.index.blocks_held(f"s{n - 1}") == {"GPU": 1}
    finally:
        sub.stop()
        pub.close(0)
        router.close(0)
        ctx.term()


_RLIMIT_PROBE = """
import resource, sys
from kvcm.config import ConfigError
from kvcm.engines.index import EngineIndex
from kvcm.engines.sources import SubscriberSettings
from kvcm.engines.subscriber import EventSubscriber
soft, hard = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
try:
    EventSubscriber(EngineIndex(None, lambda _: 4), SubscriberSettings(max_sources=600)).stop()
except ConfigError as exc:
    print("refused:", exc)
else:
    print("soft limit:", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


def _probe(soft: int, hard: int) -> str:
    done = subprocess.run([sys.executable, "-c", _RLIMIT_PROBE, str(soft), str(hard)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_open_file_limit_is_raised_or_start_up_refused():
    hard = __import__("resource").getrlimit(__import__("resource").RLIMIT_NOFILE)[1]
    if hard != -1 and hard < 4000:
        pytest.skip(f"the hard open-file limit ({hard}) is too low to raise the soft one here")
    raised = _probe(300, 4000)
    assert raised.startswith("soft limit:") and int(raised.split()[-1]) >= 600 * 6
    refused = _probe(300, 300)
    assert refused.startswith("refused:") and "events.max_sources=600" in refused and "300" in refused


@pytest.mark.parametrize("field,value", [
    ("poll_ms", 2**64 - 1), ("poll_ms", 0), ("replay_timeout_s", 1e300), ("backoff_max_s", -1),
    ("port", 70_000), ("replay_port", 0),
])
def test_source_timings_and_ports_are_bounded(field, value):
    """Found by the structured fuzzer: an unbounded poll_ms was stored until the record could not
    be encoded (INTERNAL_ERROR); each out-of-range value is INVALID_ARGUMENT, and nothing is added."""
    with serve_in_thread() as server, server.client() as c:
        c.call("register_instance", {"instance_group": "default", "instance_id": "inst", "block_size": 16,
                                     "location_spec_infos": [{"name": "tp0", "size": 1024}]})
        with pytest.raises(Exception) as info:
            c.call("add_event_source", {"source_id": "s", "instance_id": "inst", "host": "127.0.0.1", field: value})
        assert getattr(info.value, "code", None) is Code.INVALID_ARGUMENT and field in info.value.message
        assert c.call("list_event_sources", {})["sources"] == []


def test_a_misspelled_static_source_stops_start_up(tmp_path):
    """events.sources is strict too: a typo must not quietly give a source without replay."""
    source = json.dumps({"source_id": "s", "instance_id": "inst", "endpoint": "ipc:///tmp/kvcm-x-pub",
                         "replay_endpiont": "ipc:///tmp/kvcm-x-replay"})
    config = make_test_config(str(tmp_path / "data"), f"ipc://{tmp_path}/rpc", {"events": {"sources": [source]}})
    with pytest.raises(ConfigError) as info:
        App(config)
    assert "events.sources[0]" in str(info.value) and "did you mean replay_endpoint" in str(info.value)
