"""The ROUTER loop with a small method table: envelopes, malformed frames, timers, shutdown."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import msgpack
import msgspec
import pytest
import zmq

from kvcm.backends.metastore import MemoryStore
from kvcm.client import Client
from kvcm.errors import Code, InvalidArgument, KvcmError, NotFound, Unavailable
from kvcm.proto import wire
from kvcm.rpc.dispatch import Dispatcher, Method
from kvcm.rpc.server import Server, Timer
from tests.helpers import TIME_FACTOR, wait_for


class Put(msgspec.Struct):
    key: str
    value: int


def _methods(store):
    def put(req: Put):
        with store.write() as txn:
            if req.value < 0:
                raise InvalidArgument("negative")
            txn.put("meta", req.key.encode(), str(req.value).encode())
        return {"ok": True}

    def get(params):
        with store.read() as view:
            raw = view.get("meta", str(params.get("key", "")).encode())
        if raw is None:
            raise NotFound("no such key")
        return {"value": int(raw)}

    def boom(params):
        raise RuntimeError("handler bug")

    return [
        Method("echo", lambda p: {"echo": p}),
        Method("put", put, request=Put, writes=True, idempotent=False),
        Method("get", get),
        Method("boom", boom),
    ]


@pytest.fixture
def running(tmp_path):
    store = MemoryStore()
    ticks = []
    dispatcher = Dispatcher(_methods(store), group=store.group, atomic=store.write)
    server = Server(f"ipc://{tmp_path}/s", dispatcher.handle_batch,
                    timers=[Timer("tick", 0.01, lambda: ticks.append(1))], poll_ms=20)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    yield server, ticks
    server.stop(timeout=5)
    thread.join(5)


def test_dealer_roundtrip_and_typed_errors(running):
    server, _ = running
    with Client(server.endpoint, timeout=5) as c:
        assert c.call("echo", {"a": [1, 2]}) == {"echo": {"a": [1, 2]}}
        assert c.call("put", {"key": "k", "value": 7}) == {"ok": True}
        assert c.call("get", {"key": "k"}) == {"value": 7}
        with pytest.raises(NotFound):
            c.call("get", {"key": "missing"})
        with pytest.raises(InvalidArgument) as info:
            c.call("put", {"key": "k", "value": "seven"})
        assert "value" in info.value.message and info.value.code == Code.INVALID_ARGUMENT
        with pytest.raises(KvcmError) as info:
            c.call("nope")
        assert info.value.code == Code.METHOD_NOT_FOUND
        with pytest.raises(KvcmError) as info:
            c.call("boom")
        assert info.value.code == Code.INTERNAL_ERROR
        assert c.call("echo") == {"echo": {}}  # still serving


def test_req_socket_envelope(running):
    server, _ = running
    ctx = zmq.Context.instance()
    req = ctx.socket(zmq.REQ)
    req.connect(server.endpoint)
    req.send(wire.pack_request(9, "echo", {"x": 1}))
    assert req.poll(5000)
    assert msgpack.unpackb(req.recv()) == [1, 9, None, {"echo": {"x": 1}}]
    req.send(b"\xc1garbage")  # invalid msgpack still gets an error reply (msgid 0)
    assert req.poll(5000)
    kind, msgid, err, result = msgpack.unpackb(req.recv())
    assert (kind, msgid, err["code"], result) == (1, 0, Code.INVALID_ARGUMENT, None)
    req.close(0)


def test_failed_request_in_batch_rolls_back_alone(running):
    server, _ = running
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(server.endpoint)
    # Queue several writes so they are drained into one batch / one group commit.
    for i, value in enumerate([1, -1, 3]):
        dealer.send(wire.pack_request(i, "put", {"key": f"k{i}", "value": value}))
    replies = {}
    while len(replies) < 3:
        assert dealer.poll(5000)
        msgid, err, result = wire.parse_response(dealer.recv())
        replies[msgid] = (err, result)
    assert replies[0] == (None, {"ok": True}) and replies[2] == (None, {"ok": True})
    assert replies[1][0]["code"] == Code.INVALID_ARGUMENT
    with Client(server.endpoint) as c:
        assert c.call("get", {"key": "k2"}) == {"value": 3}
        with pytest.raises(NotFound):
            c.call("get", {"key": "k1"})
    dealer.close(0)


def test_notifications_get_no_reply_but_run(running):
    server, _ = running
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(server.endpoint)
    dealer.send(wire.pack_notification("put", {"key": "n", "value": 5}))
    dealer.send(wire.pack_request(1, "get", {"key": "n"}))
    assert dealer.poll(5000)
    assert wire.parse_response(dealer.recv()) == (1, None, {"value": 5})
    assert not dealer.poll(200)  # nothing else came back
    dealer.close(0)


def test_oversize_and_bad_frames(tmp_path):
    dispatcher = Dispatcher([Method("echo", lambda p: p)])
    server = Server(f"ipc://{tmp_path}/s", dispatcher.handle_batch, max_message_bytes=2048, poll_ms=20)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        ctx = zmq.Context.instance()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(server.endpoint)
        dealer.send(wire.pack_request(77, "echo", {"blob": b"x" * 4096}))
        assert dealer.poll(5000)
        msgid, err, _ = wire.parse_response(dealer.recv())
        assert msgid == 77 and err["code"] == Code.MESSAGE_TOO_LARGE
        dealer.send_multipart([b"a", b"b", b"c"])  # wrong frame shape: dropped and counted
        dealer.send_multipart([b""])
        dealer.send(wire.pack_request(78, "echo", {}))
        assert dealer.poll(5000)
        assert wire.parse_response(dealer.recv())[0] == 78
        assert server.metrics.bad_messages.labels("frames")._value.get() == 2
        dealer.close(0)
    finally:
        server.stop(5)
        thread.join(5)


def test_vanished_client_does_not_break_loop(running):
    server, _ = running
    ctx = zmq.Context.instance()
    for i in range(20):
        d = ctx.socket(zmq.DEALER)
        d.connect(server.endpoint)
        d.send(wire.pack_request(i, "echo", {"i": i}))
        d.close(0)  # gone before the reply
    with Client(server.endpoint) as c:
        assert c.call("echo", {"z": 1}) == {"echo": {"z": 1}}


def test_client_that_never_reads_loses_replies_not_the_server(tmp_path):
    """A peer that sends and never reads fills its reply queue; the loop never
    blocks on it, its replies over the HWM are dropped and counted, and other clients are served."""
    dispatcher = Dispatcher(_methods(MemoryStore()))
    server = Server(f"ipc://{tmp_path}/s", dispatcher.handle_batch, sndhwm=50, poll_ms=20)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    hog = zmq.Context.instance().socket(zmq.DEALER)
    hog.setsockopt(zmq.RCVHWM, 10)
    hog.setsockopt(zmq.SNDHWM, 0)  # queue every request on our side
    hog.connect(server.endpoint)
    try:
        padding = "x" * 20_000  # echoed back: 20 kB replies overflow the kernel buffers quickly
        for i in range(2_000):
            hog.send(wire.pack_request(i, "echo", {"pad": padding}))
        dropped = server.metrics.replies_dropped.labels("hwm")
        with Client(server.endpoint, timeout=10) as c:
            deadline = time.monotonic() + 30
            while dropped._value.get() == 0 and time.monotonic() < deadline:
                assert c.call("echo", {"z": 1}) == {"echo": {"z": 1}}  # served all along
                time.sleep(0.05)  # pacing: the echo answered all along, while the hog fills buffers
            assert dropped._value.get() > 0
            assert c.call("echo", {"z": 2}) == {"echo": {"z": 2}}
    finally:
        hog.close(0)
        server.stop(timeout=5)
        thread.join(5)


def test_timers_run_between_polls(running):
    _, ticks = running
    wait_for(lambda: len(ticks) >= 5, timeout=5, interval=0.01)
    assert len(ticks) >= 5


def test_each_timer_keeps_its_own_interval_and_the_poll_waits_for_the_earliest(tmp_path):
    """The loop remembers the earliest due time instead of rescanning the timers every turn:
    a slow timer must still wait out its interval while a fast one runs, and the poll's
    timeout must shrink to the next due timer."""
    fast, slow = [], []
    server = Server(f"ipc://{tmp_path}/t", lambda payloads, senders: [None] * len(payloads),
                    timers=[Timer("fast", 0.05, lambda: fast.append(1)), Timer("slow", 30.0, lambda: slow.append(1))],
                    poll_ms=1000)
    try:
        server._run_timers()  # both are due at first
        assert (len(fast), len(slow)) == (1, 1)
        assert 0 < server._next_timeout() <= 51  # the fast timer's, not the 1 s poll
        server._run_timers()  # too early for either
        assert (len(fast), len(slow)) == (1, 1)
        time.sleep(0.06 * TIME_FACTOR)  # the server's timers run on the real monotonic clock
        assert server._next_timeout() == 0  # overdue: no sleeping in poll
        server._run_timers()
        assert (len(fast), len(slow)) == (2, 1)  # the slow one waits its 30 s
        assert 0 < server._next_timeout() <= 51
    finally:
        server.close_unserved()


def test_client_timeout_and_closed_state(tmp_path):
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)  # accepts, never answers
    silent.bind(f"ipc://{tmp_path}/silent")
    c = Client(f"ipc://{tmp_path}/silent", timeout=0.2, retries=2)
    with pytest.raises(Unavailable) as info:
        c.call("check_health")  # idempotent: retried
    assert info.value.code == Code.TIMEOUT and "3 attempt" in info.value.message
    with pytest.raises(Unavailable) as info:
        c.call("start_write_cache")  # not idempotent: never resent
    assert "1 attempt" in info.value.message
    c.close()
    with pytest.raises(RuntimeError):
        c.call("check_health")
    silent.close(0)


def test_stop_answers_queued_requests(tmp_path):
    gate = threading.Event()

    def slow(params):
        gate.wait(5)
        return {"done": True}

    dispatcher = Dispatcher([Method("slow", slow)])
    server = Server(f"ipc://{tmp_path}/s", dispatcher.handle_batch, poll_ms=20)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(server.endpoint)
    dealer.send(wire.pack_request(1, "slow", {}))
    time.sleep(0.2 * TIME_FACTOR)  # the first request runs alone, the second arrives while it does
    dealer.send(wire.pack_request(2, "slow", {}))
    time.sleep(0.1 * TIME_FACTOR)
    server.stop()
    gate.set()
    got = set()
    while len(got) < 2 and dealer.poll(5000):
        got.add(wire.parse_response(dealer.recv())[0])
    thread.join(5)
    assert got == {1, 2}
    dealer.close(0)


def test_rpc_stats_are_exact_cumulative_and_thread_safe():
    from kvcm.metrics import Metrics

    metrics = Metrics()
    rpc = metrics.rpc
    # 0.0001 sits exactly on a bound: "le" is inclusive, as in prometheus_client's Histogram.
    for seconds in (0.00004, 0.0001, 0.0003, 2.0):
        rpc.request("get_cache_location", seconds)
    rpc.batch(1)
    rpc.batch(300)

    def hammer() -> None:
        for _ in range(5000):
            rpc.request("check_health", 0.001)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = metrics.snapshot()
    by = {(s["labels"].get("method"), s["labels"].get("le")): s["value"]
          for s in snap["kvcm_rpc_latency_seconds_bucket"]}
    assert by[("get_cache_location", "5e-05")] == 1
    assert by[("get_cache_location", "0.0001")] == 2
    assert by[("get_cache_location", "0.00025")] == 2
    assert by[("get_cache_location", "0.0005")] == 3
    assert by[("get_cache_location", "1.0")] == 3
    assert by[("get_cache_location", "+Inf")] == 4
    assert by[("check_health", "0.001")] == 20000  # no increment lost across threads
    counts = {s["labels"]["method"]: s["value"] for s in snap["kvcm_rpc_requests_total"]}
    assert counts == {"get_cache_location": 4, "check_health": 20000}
    sums = {s["labels"]["method"]: s["value"] for s in snap["kvcm_rpc_latency_seconds_sum"]}
    assert sums["get_cache_location"] == pytest.approx(2.00044)
    batches = {s["labels"]["le"]: s["value"] for s in snap["kvcm_rpc_batch_size_bucket"]}
    assert batches["1.0"] == 1 and batches["256.0"] == 1 and batches["+Inf"] == 2
    assert snap["kvcm_rpc_batch_size_sum"][0]["value"] == 301
    assert b'kvcm_rpc_requests_total{method="check_health"} 20000.0' in metrics.exposition()


def _note_and_echo(note: Method) -> Callable[..., list[tuple]]:
    """One dispatcher turn of requests to ``note`` (or to ``echo``, for params with an
    ``echo`` field); their parsed replies."""
    dispatcher = Dispatcher([note, Method("echo", lambda p: p)])

    def turn(*params: dict) -> list[tuple]:
        payloads = [wire.pack_request(i, "note" if "echo" not in p else "echo", p) for i, p in enumerate(params)]
        return [wire.parse_response(r) for r in dispatcher.handle_batch(payloads)]

    return turn


def test_a_settling_method_settles_once_per_turn_before_its_replies():
    """``Method.settle`` runs once at the end of a turn in which its method ran, before the
    replies are built; if it fails, the turn's successful requests of it answer that error."""
    calls: list[str] = []
    failing = {"on": False}

    def note(params: dict) -> dict:
        if params.get("fail"):
            raise InvalidArgument("this one failed itself")
        calls.append("run")
        return {"ok": True}

    def settle() -> None:
        calls.append("settle")
        if failing["on"]:
            raise OSError("disk gone")

    turn = _note_and_echo(Method("note", note, settle=settle))

    assert [err for _, err, _ in turn({}, {}, {"echo": 1})] == [None, None, None]
    assert calls == ["run", "run", "settle"]
    calls.clear()
    turn({"echo": 1})
    assert calls == []  # the method did not run: nothing to settle
    failing["on"] = True
    replies = turn({}, {"fail": True}, {"echo": 2})
    assert calls == ["run", "settle"]
    assert replies[0][1]["name"] == "INTERNAL_ERROR" and "in note: OSError" in replies[0][1]["message"]
    assert replies[1][1]["message"] == "this one failed itself"  # its own error, not the settle's
    assert replies[2][1] is None and replies[2][2] == {"echo": 2}


def test_an_admitting_method_is_told_its_requests_of_the_turn_before_they_run():
    """``Method.admitted`` gets the params of the method's requests that run in the turn, once,
    before the first runs; if it fails they answer its error and do not run, others do."""
    calls: list[object] = []
    failing = {"on": False}

    def note(params: dict) -> dict:
        calls.append(("run", params["n"]))
        return {"ok": True}

    def admitted(params: list) -> None:
        calls.append(("admitted", [p["n"] for p in params]))
        if failing["on"]:
            raise OSError("pool gone")

    turn = _note_and_echo(Method("note", note, admitted=admitted))

    assert [err for _, err, _ in turn({"n": 1}, {"echo": 1}, {"n": 2})] == [None, None, None]
    assert calls == [("admitted", [1, 2]), ("run", 1), ("run", 2)]
    calls.clear()
    turn({"echo": 1})
    assert calls == []  # none of its requests in the turn: not told
    failing["on"] = True
    replies = turn({"n": 3}, {"echo": 2})
    assert calls == [("admitted", [3])]  # told, failed: not run
    assert replies[0][1]["name"] == "INTERNAL_ERROR" and "in note: OSError" in replies[0][1]["message"]
    assert replies[1][1] is None and replies[1][2] == {"echo": 2}
