"""One client cannot make the RPC loop work for it at everyone's expense: a push source's reports
are paid from its owner's work budget, a client told to wait is refused undecoded until then,
and a request a schema refuses by a list's header is never decoded whole."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvcm.errors import Code, KvcmError
from kvcm.proto import wire
from kvcm.rpc.outcome import Outcome
from kvcm.testing import serve_in_thread

INSTANCE = {"instance_group": "default", "instance_id": "llm", "block_size": 16}


def report(kv: Any, source: str, start: int, n: int) -> Any:
    return kv.call("report_events", {"source_id": source, "op": "events", "events": [
        {"type": "add", "keyed": True, "block_hashes": list(range(start, start + n))}]}, retry=False)


@pytest.fixture
def server():
    # 20 ms a second: one report of 2,000 blocks (about 6 ms of work) three times, then a wait.
    with serve_in_thread(overrides={"events": {"push_budget_ms_per_s": 20.0}}) as running, running.client() as kv:
        kv.call("register_instance", INSTANCE)
        kv.call("report_events", {"source_id": "llm/a", "op": "register", "instance_id": "llm"})
        kv.call("report_events", {"source_id": "llm/b", "op": "register", "instance_id": "llm"})
        yield running


def test_a_source_past_its_budget_is_told_when_to_come_back_and_others_are_not(server):
    with server.client() as kv, server.client() as other:
        with pytest.raises(KvcmError) as info:
            for n in range(20):
                report(kv, "llm/a", n * 2000, 2000)
        assert info.value.code is Code.RATE_LIMITED and "events.push_budget_ms_per_s" in info.value.message
        retry_ms = int(info.value.detail["retry_after_ms"])
        assert 0 < retry_ms <= 1000
        server.app.engines.push_budget._buckets["source llm/a"] = (0.0, time.monotonic())  # not a µs left
        assert kv.call("report_events", {"source_id": "llm/a", "op": "heartbeat"})  # liveness is never refused
        assert report(other, "llm/b", 10**9, 2000)["applied_blocks"] == 2000  # another owner's budget is its own
        with pytest.raises(KvcmError) as info:  # the emptied bucket: a fresh wait
            report(kv, "llm/a", 10**8, 2000)
        time.sleep(int(info.value.detail["retry_after_ms"]) / 1000 + 0.05)  # the refill the server named
        assert report(kv, "llm/a", 10**8, 2000)["applied_blocks"] == 2000


def test_a_client_told_to_wait_is_refused_without_its_request_being_read(server, monkeypatch):
    with server.client() as kv:
        with pytest.raises(KvcmError):
            for n in range(20):
                report(kv, "llm/a", n * 2000, 2000)
        decoded: list[str] = []
        real = server.app.dispatcher._parse_fast

        def counting(payload, tag, peer):
            decoded.append("fast")
            return real(payload, tag, peer)

        monkeypatch.setattr(server.app.dispatcher, "_parse_fast", counting)
        with pytest.raises(KvcmError) as info:  # not even a valid report: never looked at
            kv.call("report_events", {"source_id": "llm/a", "op": "events", "nonsense": list(range(20_000))},
                    retry=False)
        assert info.value.code is Code.RATE_LIMITED and "not read" in info.value.message
        assert decoded == []
        assert kv.call("match_engines", {"instance_id": "llm", "block_keys": [1]})  # other methods are read
        assert decoded == ["fast"]


def test_the_side_ports_relay_is_never_told_to_wait_for_one_caller(server):
    refused = {"code": int(Code.RATE_LIMITED), "message": "x", "detail": {"retry_after_ms": "1000"}}
    d = server.app.dispatcher
    method = d.methods["report_events"]
    for peer in (wire.RELAY_ID_PREFIX + b"12345678", b"plain-peer"):
        outcome = Outcome(1, method, None, peer)
        outcome.error = refused
        d._remember_waits([outcome])
    assert (b"plain-peer", "report_events") in d._told_to_wait
    assert not any(peer.startswith(wire.RELAY_ID_PREFIX) for peer, _ in d._told_to_wait)


def test_a_list_over_its_cap_is_refused_from_its_header(server, monkeypatch):
    slow: list[bytes] = []
    monkeypatch.setattr(wire, "parse_request", lambda payload, *a: slow.append(payload))
    payload = wire.pack_request(7, "match_engines", {"instance_id": "llm", "block_keys": [1],
                                                     "media": [f"m{i}" for i in range(300_000)]})
    began = time.perf_counter()
    outcome = server.app.dispatcher._parse(payload)
    took = time.perf_counter() - began
    assert outcome.msgid == 7 and "length <= 64" in outcome.error["message"]
    assert slow == []  # answered from the fast path: the 2 MB request was not decoded whole
    assert took < 1.0  # a generous bound: the decode alone would take tens of milliseconds


@pytest.mark.parametrize("payload", [
    b"\x94\x00\x01",  # cut short
    b"\x94\x01\x01\xa1x\x90",  # a response, not a request
    b"\x94\x00\xcf" + bytes(8) + b"\xa1x\x90",  # a 64-bit msgid
    b"\x94\x00\x01\xa2\xff\xfe\x90",  # a method name that is not UTF-8
])
def test_split_request_leaves_any_other_shape_to_the_full_parser(payload):
    assert wire.split_request(payload) is None


def test_split_request_reads_the_head_of_a_request():
    msgid, method, rest = wire.split_request(wire.pack_request(70000, "check_health", {}))
    assert (msgid, method, bytes(rest)) == (70000, "check_health", b"\x91\x80")
