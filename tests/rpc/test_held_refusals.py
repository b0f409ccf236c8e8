"""A big request refused for its sender's fault is answered later (kvcm.rpc.tarpit), so a client
looping it cannot keep the loop busy; everyone else, and the sender's other requests, are answered
meanwhile. Real sockets against a real server."""

from __future__ import annotations

import time
from typing import Any

import pytest
import zmq

from kvcm.errors import Code, KvcmError
from kvcm.proto import wire
from kvcm.rpc.tarpit import MAX_HELD, MIN_BYTES, Tarpit
from kvcm.testing import serve_in_thread
from tests.helpers import Clock, wait_for

INSTANCE = {"instance_group": "default", "instance_id": "llm", "block_size": 16}
BIG_MEDIA = {"instance_id": "llm", "block_keys": [1], "media": [f"m{i}" for i in range(20_000)]}  # ~130 KB
SMALL_MEDIA = {"instance_id": "llm", "block_keys": [1], "media": [f"m{i}" for i in range(65)]}  # one over the cap


def dealer(ctx: zmq.Context[Any], endpoint: str) -> zmq.Socket[Any]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def answer(sock: zmq.Socket[Any], timeout_s: float = 10.0) -> tuple[int, Any, Any]:
    assert sock.poll(int(timeout_s * 1000)), "no reply"
    return wire.parse_response(sock.recv())


@pytest.fixture
def server():
    with serve_in_thread(overrides={"server": {"refusal_hold_ms": 1000.0},
                                    "events": {"push_budget_ms_per_s": 20.0}}) as running, running.client() as kv:
        kv.call("register_instance", INSTANCE)
        yield running


def test_a_big_refused_request_is_answered_after_the_hold_and_others_meanwhile(server):
    ctx = zmq.Context.instance()
    attacker, other = dealer(ctx, server.endpoint), dealer(ctx, server.endpoint)
    try:
        held_before = server.app.metrics.refusals_held._value.get()
        began = time.monotonic()
        attacker.send(wire.pack_request(1, "match_engines", BIG_MEDIA))
        attacker.send(wire.pack_request(2, "check_health", {}))  # the same sender's next request
        msgid, err, _ = answer(attacker)
        assert msgid == 2 and err is None  # not queued behind its refused one
        other.send(wire.pack_request(3, "match_engines", {"instance_id": "llm", "block_keys": [1]}))
        msgid, err, _ = answer(other)
        assert msgid == 3 and err is None
        assert time.monotonic() - began < 0.9  # both answered while the refusal was still held
        msgid, err, _ = answer(attacker)
        assert msgid == 1 and err["code"] == Code.TOO_MANY_KEYS and "media" in err["message"]
        assert time.monotonic() - began >= 0.95
        assert server.app.metrics.refusals_held._value.get() == held_before + 1
    finally:
        attacker.close()
        other.close()


def test_a_small_refused_request_is_answered_at_once(server):
    with server.client() as kv:
        began = time.monotonic()
        with pytest.raises(KvcmError) as info:
            kv.call("match_engines", SMALL_MEDIA)
        assert info.value.code is Code.TOO_MANY_KEYS
        assert time.monotonic() - began < 0.5  # the hold is 1 s: this one was not held


def test_a_report_sent_again_before_its_wait_is_held_until_the_wait_ends(server):
    with server.client() as kv:
        kv.call("report_events", {"source_id": "llm/a", "op": "register", "instance_id": "llm"})
        n = 0
        with pytest.raises(KvcmError) as info:
            for n in range(50):
                kv.call("report_events", {"source_id": "llm/a", "op": "events", "events": [
                    {"type": "add", "keyed": True, "block_hashes": list(range(n * 4000, (n + 1) * 4000))}]},
                    retry=False)
        assert info.value.code is Code.RATE_LIMITED  # the first refusal: at once, naming the wait
        wait_s = int(info.value.detail["retry_after_ms"]) / 1000
        told = time.monotonic()
        with pytest.raises(KvcmError) as again:
            kv.call("report_events", {"source_id": "llm/a", "op": "events", "events": [
                {"type": "add", "keyed": True, "block_hashes": list(range(10**9, 10**9 + 4000))}]}, retry=False)
        assert again.value.code is Code.RATE_LIMITED and "not read" in again.value.message
        assert time.monotonic() - told >= min(wait_s, 1.0) - 0.05  # held until the wait was over
        assert again.value.detail["retry_after_ms"] == "1"  # ... so the client need not wait twice
        assert kv.call("report_events", {"source_id": "llm/a", "op": "events", "events": [
            {"type": "add", "keyed": True, "block_hashes": list(range(10**9, 10**9 + 100))}]},
            retry=False)["applied_blocks"] == 100


def test_stopping_answers_the_held_refusals():
    with serve_in_thread(overrides={"server": {"refusal_hold_ms": 1000.0}}) as running:
        with running.client() as kv:
            kv.call("register_instance", INSTANCE)
        sock = dealer(zmq.Context.instance(), running.endpoint)
        try:
            sock.send(wire.pack_request(9, "match_engines", BIG_MEDIA))
            wait_for(lambda: len(running.app.dispatcher._tarpit), timeout=5, interval=0.01)
            assert len(running.app.dispatcher._tarpit) == 1
            running.app.stop()  # answers what it holds before it closes (stop is idempotent)
            msgid, err, _ = answer(sock, 5.0)
            assert msgid == 9 and err["code"] == Code.TOO_MANY_KEYS
        finally:
            sock.close()


def test_a_zero_hold_answers_at_once():
    with serve_in_thread(overrides={"server": {"refusal_hold_ms": 0.0}}) as running, running.client() as kv:
        kv.call("register_instance", INSTANCE)
        began = time.monotonic()
        for _ in range(5):
            with pytest.raises(KvcmError):
                kv.call("match_engines", BIG_MEDIA)
        assert time.monotonic() - began < 2.0
        assert running.app.metrics.refusals_held._value.get() == 0


def test_the_tarpit_holds_only_big_sender_fault_refusals_and_only_so_many():
    clock = Clock()
    pit = Tarpit(0.1, clock)
    assert pit.hold_for(Code.INVALID_ARGUMENT, MIN_BYTES) == pytest.approx(0.1)
    assert pit.hold_for(Code.INVALID_ARGUMENT, MIN_BYTES - 1) == 0  # small: at once
    assert pit.hold_for(Code.SERVICE_NOT_READY, MIN_BYTES) == 0  # not the sender's fault
    assert pit.hold_for(Code.RATE_LIMITED, MIN_BYTES) == 0  # a first RATE_LIMITED names its wait at once
    assert pit.hold_for(Code.RATE_LIMITED, MIN_BYTES, told_until=100.4) == pytest.approx(0.4)
    assert pit.hold_for(Code.RATE_LIMITED, MIN_BYTES, told_until=109.0) == pytest.approx(1.0)  # capped
    for i in range(MAX_HELD):
        pit.hold(i, b"r%d" % i, 0.125 if i % 2 else 0.25)
    assert pit.hold_for(Code.INVALID_ARGUMENT, 10 * MIN_BYTES) == 0  # full: answered at once
    assert pit.due() == [] and pit.wait_ms() == 125
    clock.now += 0.125
    first = pit.due()
    assert [tag for tag, _ in first] == list(range(1, MAX_HELD, 2))  # due ones, in the order held
    clock.now += 0.125
    assert len(pit.due()) == MAX_HELD // 2 and pit.wait_ms() is None and len(pit) == 0
    assert Tarpit(5.0).hold_s == 1.0 and Tarpit(-1).hold_s == 0.0
