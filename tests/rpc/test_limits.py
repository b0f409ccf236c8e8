"""Bounded work per request: costing before the run, hashing spread over loop turns, heavy work
within a turn's budget, and one request's failure never another's (batch isolation).

The dispatcher tests drive :meth:`Dispatcher.serve` turn by turn with synthetic methods, so the
scheduling decisions are observable; the server tests send the hostile requests over a real
socket to a real kvcm.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgpack
import msgspec
import pytest

from kvcm.api.token_keys import TokenWork, hash_tokens
from kvcm.cache.keys import token_ids_to_block_keys
from kvcm.errors import Code, KvcmError
from kvcm.proto import wire
from kvcm.rpc.dispatch import Deferred, Dispatcher, Estimate, Limits, Method
from kvcm.testing import serve_in_thread
from tests.helpers import TIME_FACTOR, register

# -- synthetic methods ------------------------------------------------------------------------------


class Work(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    micros: float = 0.0  # the estimate the method reports
    tag: str = ""
    block_keys: list[int] = []
    token_ids: list[int] = []
    extra: list[Any] = []  # any value, like finish_write_cache's ignored "locations"


def _methods(ran: list[str], block_size: int = 4) -> list[Method]:
    def run(r: Work) -> dict[str, Any]:
        ran.append(r.tag)
        return {"tag": r.tag, "keys": r.block_keys}

    def cost(r: Work) -> Estimate:
        # a microsecond per key when the request says it costs anything (for the refusal's key
        # count); a request estimated at nothing stays free however many keys its tokens make
        return Estimate(r.micros, 0, 1.0 if r.micros else 0.0)

    def tokens(r: Work) -> TokenWork | None:
        if r.block_keys or not r.token_ids:
            return None
        return TokenWork(r.token_ids, block_size, lambda keys: setattr(r, "block_keys", keys))

    return [Method("work", run, Work, cost=cost, prepare=hash_tokens(tokens))]


def _req(msgid: int, **params: Any) -> bytes:
    return wire.pack_request(msgid, "work", params)


def _results(replies: list[tuple[Any, bytes | None]]) -> dict[Any, tuple[Any, Any]]:
    out = {}
    for tag, reply in replies:
        assert reply is not None
        _, err, result = wire.parse_response(reply)
        out[tag] = (err, result)
    return out


def test_small_requests_run_before_heavy_ones_and_heavy_work_waits_past_the_budget():
    ran: list[str] = []
    d = Dispatcher(_methods(ran), limits=Limits(turn_budget_ms=10))
    arrivals = [
        ("h1", b"A", _req(1, micros=8000, tag="h1")),
        ("h2", b"B", _req(2, micros=8000, tag="h2")),  # would pass the 10 ms budget: next turn
        ("s1", b"C", _req(3, micros=1, tag="s1")),
        ("h3", b"D", _req(4, micros=8000, tag="h3")),
    ]
    first = _results(d.serve(arrivals))
    assert ran == ["s1", "h1"]  # the small one first, then heavy work within the budget
    assert set(first) == {"s1", "h1"}
    assert d.wait_ms() == 0  # carried work: the loop must not sleep
    second = _results(d.serve([("s2", b"E", _req(5, micros=1, tag="s2"))]))
    assert ran == ["s1", "h1", "s2", "h2"]  # a new small request overtakes the carried heavy one
    assert set(second) == {"s2", "h2"}
    _results(d.serve([]))
    assert ran[-1] == "h3" and d.wait_ms() is None


def test_a_peers_requests_never_overtake_each_other():
    ran: list[str] = []
    d = Dispatcher(_methods(ran), limits=Limits(turn_budget_ms=10))
    arrivals = [
        ("a1", b"A", _req(1, micros=8000, tag="a1")),
        ("b1", b"B", _req(2, micros=8000, tag="b1")),  # carried (budget)
        ("b2", b"B", _req(3, micros=1, tag="b2")),  # small, but behind its peer's carried request
        ("a2", b"A", _req(4, micros=1, tag="a2")),  # small, but behind its peer's heavy one
    ]
    d.serve(arrivals)
    assert ran == ["a1", "a2"]
    d.serve([("b3", b"B", _req(5, micros=1, tag="b3"))])
    assert ran == ["a1", "a2", "b1", "b2", "b3"]


class _Store:
    """A write that keeps its tag until the group commits, and a read that answers what is
    committed: a read run before a write of its own peer would miss it."""

    def __init__(self, ran: list[str]) -> None:
        self.ran = ran
        self.committed: list[str] = []
        self.pending: list[str] = []
        self.methods = [Method("put", self.put, Work, writes=True), Method("get", self.get, Work)]

    def put(self, r: Work) -> dict[str, Any]:
        self.ran.append(r.tag)
        self.pending.append(r.tag)
        return {}

    def get(self, r: Work) -> dict[str, Any]:
        self.ran.append(r.tag)
        return {"seen": list(self.committed)}

    @contextmanager
    def group(self) -> Iterator[None]:
        self.pending.clear()
        yield
        self.committed.extend(self.pending)


def _call(method: str, msgid: int, **params: Any) -> bytes:
    return wire.pack_request(msgid, method, params)


def test_small_reads_run_at_once_but_never_before_their_peers_write_or_carried_request():
    ran: list[str] = []
    store = _Store(ran)
    verdicts = {b"A": 1}

    def authorize(method: Method, request: Any, peer: bytes) -> None:
        if verdicts.get(peer):
            verdicts[peer] -= 1
            raise Deferred()

    d = Dispatcher(store.methods, authorize=authorize, group=store.group)
    replies = _results(d.serve([
        ("b-put", b"B", _call("put", 1, tag="b-put")),
        ("b-get", b"B", _call("get", 2, tag="b-get")),  # behind its peer's write: after the commit
        ("c-get", b"C", _call("get", 3, tag="c-get")),  # a read of another peer runs at once
    ]))
    assert ran == ["c-get", "b-put", "b-get"]
    assert replies["b-get"][1] == {"seen": ["b-put"]} and replies["c-get"][1] == {"seen": []}
    # A's first read waits for its verdict (asked once this turn); its second read, small too,
    # waits behind it
    assert d.serve([("a1", b"A", _call("get", 4, tag="a1")), ("a2", b"A", _call("get", 5, tag="a2"))]) == []
    assert verdicts[b"A"] == 0 and ran == ["c-get", "b-put", "b-get"]
    later = _results(d.serve([("c2", b"C", _call("get", 6, tag="c2"))]))
    assert ran[-3:] == ["c2", "a1", "a2"] and set(later) == {"a1", "a2", "c2"}


def test_a_request_estimated_over_the_budget_is_refused_before_it_runs():
    ran: list[str] = []
    d = Dispatcher(_methods(ran), limits=Limits(turn_budget_ms=10))
    (_, reply), = d.serve([("x", b"A", _req(1, micros=20_000, tag="x"))])
    _, err, _ = wire.parse_response(reply)
    assert err["name"] == "TOO_LARGE" and "server.turn_budget_ms" in err["message"]
    assert "at most 10000 keys" in err["message"]
    assert ran == []


def test_token_hashing_is_spread_over_turns_and_gives_the_same_keys():
    ran: list[str] = []
    d = Dispatcher(_methods(ran), limits=Limits(turn_budget_ms=1, max_keys=1 << 20, max_tokens=1 << 20))
    tokens = list(range(200_000))
    replies = d.serve([("big", b"A", _req(1, tag="big", token_ids=tokens)), ("s", b"B", _req(2, tag="s"))])
    assert [t for t, _ in replies] == ["s"]  # the small one is answered while hashing goes on
    turns = 1
    done: dict[Any, Any] = {}
    while not done:
        done = _results(d.serve([]))
        turns += 1
    assert turns > 3  # really spread out
    err, result = done["big"]
    assert err is None and result["keys"] == token_ids_to_block_keys(tokens, 4)
    assert d.metrics.registry.get_sample_value("kvcm_rpc_carried_total", {"reason": "hashing"}) >= 1


def test_keys_derived_from_tokens_are_counted_before_hashing():
    ran: list[str] = []
    d = Dispatcher(_methods(ran, block_size=1), limits=Limits(max_keys=1000, max_tokens=1 << 20))
    started = time.perf_counter()
    reply = d.handle(_req(1, tag="t", token_ids=list(range(5000))))
    _, err, _ = wire.parse_response(reply)
    assert err["name"] == "TOO_MANY_KEYS" and "server.max_keys" in err["message"]
    assert ran == [] and time.perf_counter() - started < 1.0  # refused, not hashed
    reply = d.handle(_req(2, tag="t", token_ids=list(range(2000))))
    assert wire.parse_response(reply)[1]["name"] == "TOO_MANY_KEYS"  # 2000 keys of block size 1
    d2 = Dispatcher(_methods(ran), limits=Limits(max_tokens=100))
    err = wire.parse_response(d2.handle(_req(3, tag="t", token_ids=list(range(101)))))[1]
    assert err["name"] == "TOO_MANY_KEYS" and "server.max_tokens" in err["message"]


def test_each_list_field_has_its_own_limit_in_a_struct_and_in_a_raw_map():
    """``block_keys`` answers to max_keys and ``token_ids`` to max_tokens, each at its exact
    bound, whether the method decodes a Struct or takes the raw map."""
    ran: list[str] = []
    raw = Method("raw", lambda params: {"n": len(params.get("block_keys", []))})
    d = Dispatcher([*_methods(ran), raw], limits=Limits(max_keys=8, max_tokens=64))
    for method in ("work", "raw"):
        ok = wire.parse_response(d.handle(wire.pack_request(1, method, {"block_keys": list(range(8))})))
        assert ok[1] is None
        err = wire.parse_response(d.handle(wire.pack_request(2, method, {"block_keys": list(range(9))})))[1]
        assert err["name"] == "TOO_MANY_KEYS" and "block_keys has 9" in err["message"]
        assert "server.max_keys" in err["message"] and "limit is 8" in err["message"]
        # 40 tokens: over max_keys as a count, within max_tokens (4-token blocks: 10 keys would
        # be derived, so only the raw map, which derives nothing, accepts them)
        reply = wire.parse_response(d.handle(wire.pack_request(3, method, {"token_ids": list(range(40)),
                                                                           "block_keys": [1]})))
        assert reply[1] is None
        err = wire.parse_response(d.handle(wire.pack_request(4, method, {"token_ids": list(range(65))})))[1]
        assert err["name"] == "TOO_MANY_KEYS" and "server.max_tokens" in err["message"] and "limit is 64" in err["message"]


def test_deferred_authorization_is_carried_then_runs():
    ran: list[str] = []
    verdicts = {"pending": 2}

    def authorize(method: Method, request: Any, peer: bytes) -> None:
        if verdicts["pending"]:
            verdicts["pending"] -= 1
            raise Deferred()

    d = Dispatcher(_methods(ran), authorize=authorize)
    assert d.serve([("x", b"A", _req(1, tag="x"))]) == []
    assert d.wait_ms() == 2  # only waiting for a verdict: look again soon, no busy loop
    assert d.serve([]) == []
    (tag, reply), = d.serve([])
    assert tag == "x" and wire.parse_response(reply)[1] is None and ran == ["x"]


def test_a_carried_request_times_out():
    def authorize(method: Method, request: Any, peer: bytes) -> None:
        raise Deferred()

    d = Dispatcher(_methods([]), authorize=authorize, limits=Limits(defer_timeout_s=0.05))
    assert d.serve([("x", b"A", _req(1, tag="x"))]) == []
    time.sleep(0.1 * TIME_FACTOR)  # past defer_timeout_s on the dispatcher's real monotonic clock
    (_, reply), = d.serve([])
    assert wire.parse_response(reply)[1]["name"] == "TIMEOUT"
    assert d.wait_ms() is None


def test_a_reply_over_max_reply_bytes_is_refused():
    def big(r: Work) -> Any:
        return wire.Raw(msgpack.packb({"pad": b"x" * 5000}))

    d = Dispatcher([Method("work", big, Work)], limits=Limits(max_reply_bytes=4096))
    err = wire.parse_response(d.handle(_req(1)))[1]
    assert err["name"] == "TOO_LARGE" and "server.max_reply_bytes" in err["message"]


def test_a_packed_reply_over_max_reply_bytes_is_refused():
    def big(r: Work) -> Any:
        return {"pad": "x" * 5000}

    d = Dispatcher([Method("work", big, Work)], limits=Limits(max_reply_bytes=4096))
    err = wire.parse_response(d.handle(_req(1)))[1]
    assert err["name"] == "TOO_LARGE" and "5" in err["message"]


def test_the_reply_size_estimate_refuses_before_the_work():
    ran: list[str] = []

    def run(r: Work) -> Any:
        ran.append(r.tag)
        return {}

    def cost(r: Work) -> Estimate:
        return Estimate(1.0, reply_bytes=10_000)

    d = Dispatcher([Method("work", run, Work, cost=cost)], limits=Limits(max_reply_bytes=4096))
    err = wire.parse_response(d.handle(_req(1, tag="x")))[1]
    assert err["name"] == "TOO_LARGE" and "at least 10000 bytes" in err["message"]
    assert ran == []


def test_the_loop_turns_at_once_while_work_is_carried(tmp_path):
    """Carried work runs in the next turn, not after a poll timeout (here 60 s)."""
    from kvcm.client import Client
    from kvcm.rpc.server import Server

    ran: list[str] = []
    d = Dispatcher(_methods(ran), limits=Limits(turn_budget_ms=1, max_keys=1 << 20, max_tokens=1 << 20))
    server = Server(f"ipc://{tmp_path}/s", d, poll_ms=60_000)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        with Client(server.endpoint, timeout=10, retries=0) as c:
            result = c.call("work", {"tag": "big", "token_ids": list(range(100_000))})
        assert result["keys"] == token_ids_to_block_keys(list(range(100_000)), 4)
        assert d.metrics.registry.get_sample_value("kvcm_rpc_carried_total", {"reason": "hashing"}) >= 1
    finally:
        server.stop(timeout=5)


def _deep(levels: int) -> bytes:
    return b"\x91" * levels + b"\xc0"


def test_poisoned_requests_fail_alone_in_a_drained_batch():
    ran: list[str] = []
    d = Dispatcher(_methods(ran))
    prefix = b"\x94" + msgpack.packb(0) + msgpack.packb(7) + msgpack.packb("work")
    poisons = [
        prefix + b"\x91\x81" + msgpack.packb("extra") + _deep(200_000),  # fast path: msgspec recursion
        prefix + b"\x91\x81" + msgpack.packb("tag") + _deep(200_000),
        prefix + b"\x91" + _deep(200_000),
        _deep(200_000),
        prefix + b"\x91\x81" + msgpack.packb("block_keys") + b"\xdd\xff\xff\xff\xff",  # claims 4G items
    ]
    goods = [_req(100 + i, tag=f"g{i}") for i in range(len(poisons) + 1)]
    batch = [goods[0]]
    for poison, good in zip(poisons, goods[1:]):
        batch += [poison, good]
    replies = [wire.parse_response(r) for r in d.handle_batch(batch)]
    for i, (msgid, err, result) in enumerate(replies):
        if i % 2 == 0:
            assert err is None and msgid == 100 + i // 2 and result["tag"] == f"g{i // 2}"
        else:
            assert err["name"] == "INVALID_ARGUMENT", err
    assert replies[1][0] == 7  # the poisoned request's own msgid, when readable
    assert ran == [f"g{i}" for i in range(len(goods))]


# -- a real server ------------------------------------------------------------------------------------


def _health_latencies(endpoint: str, stop: threading.Event, out: list[float]) -> None:
    from kvcm.client import Client

    with Client(endpoint, timeout=30) as c:
        while not stop.is_set():
            started = time.perf_counter()
            c.call("check_health")
            out.append(time.perf_counter() - started)


@pytest.fixture(scope="module")
def big_server():
    overrides = {"server": {"max_message_bytes": 48 << 20}, "reclaim": {"enabled": False}}
    with serve_in_thread(overrides=overrides) as server:
        with server.client(timeout=60) as c:
            register(c, block_size=1)
            register(c, instance_id="inst16", block_size=16)
        yield server


def test_the_3_9m_token_request_is_refused_fast_and_others_keep_being_served(big_server):
    latencies: list[float] = []
    stop = threading.Event()
    watcher = threading.Thread(target=_health_latencies, args=(big_server.endpoint, stop, latencies))
    watcher.start()
    try:
        with big_server.client(timeout=60) as c:
            for method in ("start_write_cache", "get_cache_meta", "get_cache_location"):
                params: dict[str, Any] = {"instance_id": "inst", "token_ids": list(range(3_900_000))}
                if method == "get_cache_location":
                    params["query_type"] = "prefix_match"
                with pytest.raises(KvcmError) as info:
                    c.call(method, params)
                assert info.value.code is Code.TOO_MANY_KEYS
            assert c.call("get_cache_meta", {"instance_id": "inst", "block_keys": [1]})  # still fine
    finally:
        stop.set()
        watcher.join()
    assert latencies and max(latencies) < 5.0  # generous: the bound itself lives in bench_hostile


def test_a_long_prompt_by_tokens_is_answered_correctly_while_others_are_served(big_server):
    tokens = list(range(1, 524_289))  # the most token_ids a request may carry by default
    keys = token_ids_to_block_keys(tokens, 16)
    assert len(keys) == 32768
    with big_server.client(timeout=60) as c:
        session = c.call("start_write_cache", {"instance_id": "inst16", "block_keys": keys[:128]})
        c.call("finish_write_cache", {"instance_id": "inst16", "write_session_id": session["write_session_id"],
                                      "success_blocks": {"offset": 128}})
        length = c.call("get_cache_location_len", {"instance_id": "inst16", "token_ids": tokens,
                                                   "query_type": "prefix_match"})
        assert length == {"cache_location_len": 128}
        # the full locations of a prompt by tokens: as many blocks as the estimate lets through
        by_tokens = c.call("get_cache_location", {"instance_id": "inst16", "token_ids": tokens[: 8000 * 16],
                                                  "query_type": "prefix_match"})
        by_keys = c.call("get_cache_location", {"instance_id": "inst16", "block_keys": keys[:8000],
                                                "query_type": "prefix_match"})
        assert len(by_tokens["locations"]) == 128 and by_tokens == by_keys
    carried = big_server.app.metrics.registry.get_sample_value("kvcm_rpc_carried_total", {"reason": "hashing"})
    assert carried and carried >= 1


def test_writes_estimated_over_the_budget_are_refused_and_write_nothing(big_server):
    keys = list(range(10_000, 60_000))
    with big_server.client(timeout=60) as c:
        with pytest.raises(KvcmError) as info:
            c.call("start_write_cache", {"instance_id": "inst16", "block_keys": keys})
        assert info.value.code is Code.TOO_LARGE and "keys per request" in info.value.message
        meta = c.call("get_cache_meta", {"instance_id": "inst16", "block_keys": keys[:100]})
        assert all(not m.get("locations") for m in meta.get("metas", [])), meta


def test_a_3_9_mb_frame_of_3_9m_tokens_is_refused_by_the_schema_with_the_defaults():
    """One-byte token ids: 3.9 M of them fit the default 4 MiB frame. The schema's list ceiling
    refuses them from the list header (nothing decoded, nothing hashed)."""
    with serve_in_thread() as server, server.client(timeout=60) as c:
        register(c, block_size=1)
        tokens = [i % 128 for i in range(3_900_000)]
        for method in ("start_write_cache", "get_cache_meta"):
            with pytest.raises(KvcmError) as info:
                c.call(method, {"instance_id": "inst", "token_ids": tokens})
            assert info.value.code is Code.TOO_MANY_KEYS and "524288" in info.value.message
        with pytest.raises(KvcmError) as info:
            c.call("get_cache_meta", {"instance_id": "inst", "block_keys": [1] * 200_000})
        assert info.value.code is Code.TOO_MANY_KEYS and "block_keys" in info.value.message
        assert c.call("check_health")["status"] == "ok"


def test_max_reply_bytes_is_checked_before_the_lookup():
    with serve_in_thread(overrides={"server": {"max_reply_bytes": 8192}}) as server, server.client() as c:
        register(c)
        with pytest.raises(KvcmError) as info:
            c.call("get_cache_location", {"instance_id": "inst", "block_keys": list(range(200)),
                                          "query_type": "batch_get"})
        assert info.value.code is Code.TOO_LARGE and "server.max_reply_bytes" in info.value.message
        assert c.call("get_cache_location", {"instance_id": "inst", "block_keys": list(range(10)),
                                             "query_type": "batch_get"})


def test_write_estimates_follow_the_storage_packing(tmp_path):
    """One block per file costs a file per spec: a write of 300 blocks to such a storage is over the
    budget; the same write to the default storage (packed files of 64 MiB) is not."""
    with serve_in_thread(overrides={"reclaim": {"enabled": False}}) as server, server.client() as c:
        register(c)  # default storage: packed files, two specs
        session = c.call("start_write_cache", {"instance_id": "inst", "block_keys": list(range(1, 1001))})
        assert len(session["locations"]) == 1000
        c.call("add_storage", {"storage": {"global_unique_name": "one-per-file", "storage_type": "file",
                                           "storage_spec": {"root_path": str(tmp_path / "single"),
                                                            "key_count_per_file": 1}}})
        c.call("create_instance_group", {"instance_group": {"name": "pg", "storage_candidates": ["one-per-file"]}})
        register(c, instance_id="single-inst", group="pg")
        with pytest.raises(KvcmError) as info:
            c.call("start_write_cache", {"instance_id": "single-inst", "block_keys": list(range(1, 301))})
        assert info.value.code is Code.TOO_LARGE and "send at most 153 keys" in info.value.message  # docs/limits.md


def test_the_clients_retry_list_names_only_idempotent_methods():
    with serve_in_thread() as server:
        methods = server.app.dispatcher.methods
    from kvcm.client import IDEMPOTENT_METHODS

    unknown = sorted(m for m in IDEMPOTENT_METHODS if m not in methods)
    unsafe = sorted(m for m in IDEMPOTENT_METHODS if m in methods and not methods[m].idempotent)
    assert not unknown and not unsafe, (unknown, unsafe)


def test_poison_from_one_client_never_fails_another_clients_requests():
    """Over a real socket: one client floods nested and oversized payloads while another's 100
    pipelined requests are drained in the same turns; all 100 are answered correctly."""
    import zmq

    with serve_in_thread() as server:
        ctx = zmq.Context.instance()
        bad, good = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        try:
            for sock in (bad, good):
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(server.endpoint)
            poison = (b"\x94\x00\x08\xb2finish_write_cache\x91\x81\xa9locations" + _deep(200_000),
                      _deep(200_000), b"\xdd\xff\xff\xff\xff")
            for i in range(100):
                if i % 10 == 0:
                    for p in poison:
                        bad.send(p)
                good.send(wire.pack_request(1000 + i, "check_health", {}))
            answers = {}
            while len(answers) < 100 and good.poll(10_000):
                msgid, err, result = wire.parse_response(good.recv())
                answers[msgid] = (err, result)
            assert sorted(answers) == list(range(1000, 1100))
            assert all(err is None and result["status"] == "ok" for err, result in answers.values())
            refused = 0
            while bad.poll(2000) and refused < 30:
                assert wire.parse_response(bad.recv())[1]["name"] == "INVALID_ARGUMENT"
                refused += 1
            assert refused == 30
        finally:
            bad.close(0)
            good.close(0)
