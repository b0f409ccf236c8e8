"""Push sources through ``report_events`` on a real server (kvcm.Client over ipc://, HTTP on
loopback): register, heartbeat, payload and decoded batches, snapshots, generations, gaps,
silence (stale, expired), ``down``, and the per-source auth rule. ``match_engines`` must see a
push source exactly like a ZeroMQ one (a FakeEnginePublisher next to it).

Liveness intervals are short (stale 1 s, expire 2 s); waits poll with generous deadlines and
never assert on timing.
"""

from __future__ import annotations

import base64
import json
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvcm import Client
from kvcm.errors import Code, KvcmError
from kvcm.proto.kv_events import BlockRemoved, BlockStored, encode_batch
from kvcm.testing import FakeEnginePublisher, RunningServer, serve_in_thread
from tests.helpers import wait_for

BS = 4
TOKENS = list(range(100, 100 + 8 * BS))  # 8 blocks
OTHER = list(range(900, 900 + 8 * BS))
EVENTS = {"probe_interval_s": 0.2, "stale_after_s": 1.0, "expire_after_s": 2.0, "poll_ms": 20}
ADMIN_PW = "push-Admin-pw"


def add(hashes: list[int], tokens: list[int], parent: int | None = None, **kw: Any) -> dict[str, Any]:
    return {"type": "add", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BS, **kw}  # fmt: skip


def register(kv: Client, source_id: str = "push-a", generation: int = 0, **kw: Any) -> Any:
    return kv.report_events(source_id=source_id, op="register", instance_id="llm", generation=generation, **kw)


def matched(kv: Client, tokens: list[int] = TOKENS, **kw: Any) -> dict[str, dict[str, Any]]:
    reply = kv.call("match_engines", {"instance_id": "llm", "token_ids": tokens, **kw})
    return {s["source_id"]: s for s in reply["sources"]}


def source(kv: Client, source_id: str) -> dict[str, Any] | None:
    return next((s for s in kv.call("list_event_sources", {})["sources"] if s["source_id"] == source_id), None)




def refused(fn: Callable[[], Any]) -> KvcmError:
    with pytest.raises(KvcmError) as exc:
        fn()
    return exc.value


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with serve_in_thread(overrides={"events": EVENTS}) as srv, srv.client() as kv:
        kv.call("register_instance", {"instance_group": "default", "instance_id": "llm", "block_size": BS,
                                      "location_spec_infos": [{"name": "tp0", "size": 1024}]})  # fmt: skip
        yield srv


@pytest.fixture
def kv(server: RunningServer) -> Iterator[Client]:
    with server.client() as client:
        yield client
        for s in client.call("list_event_sources", {})["sources"]:
            client.call("remove_event_source", {"source_id": s["source_id"]})


def test_decoded_events_are_matched_like_a_zmq_source(kv: Client) -> None:
    with FakeEnginePublisher().start() as engine:
        kv.call("add_event_source", {"source_id": "zmq-a", "instance_id": "llm", "endpoint": engine.endpoint,
                                     "replay_endpoint": engine.replay_endpoint})  # fmt: skip
        engine.store([11, 12, 13], TOKENS[: 3 * BS], block_size=BS)
        first = register(kv, dp_rank=1, pod="pod-p", medium="cpu")
        assert (first.state, first.resync, first.last_seq) == ("live", False, -1)
        done = kv.report_events(source_id="push-a", op="events", seq=0,
                                events=[add([1, 2, 3, 4], TOKENS[: 4 * BS]), add([5], TOKENS[4 * BS: 5 * BS], 4)])
        assert (done.applied_blocks, done.last_seq, done.resync, done.errors) == (5, 0, False, {})
        both = wait_for(lambda: len(m := matched(kv)) == 2 and m)
        assert both["push-a"] == {"source_id": "push-a", "dp_rank": 1, "matched_blocks": 5, "media": {"CPU": 5},
                                  "pod": "pod-p", "matched_tokens": 20, "media_tokens": {"CPU": 20},
                                  "score": 4.0}  # 5 CPU blocks at the CPU weight, 0.8
        assert both["zmq-a"]["matched_blocks"] == 3 and list(both) == ["push-a", "zmq-a"]  # best first
        listed = source(kv, "push-a")
        assert listed is not None and listed["kind"] == "push" and listed["generation"] == 0
        assert listed["blocks_by_medium"] == {"CPU": 5} and listed["state"] == "live"
        assert source(kv, "zmq-a")["kind"] == "zmq"  # type: ignore[index]
        # a removal, a GPU copy, a clear: the decoded form carries every event kind
        kv.report_events(source_id="push-a", op="events", seq=1,
                         events=[{"type": "remove", "block_hashes": [5]}, add([1], TOKENS[:BS], medium="GPU")])
        assert matched(kv)["push-a"]["media"] == {"CPU": 4, "GPU": 1}
        kv.report_events(source_id="push-a", op="events", seq=2, events=[{"type": "clear"}])
        assert "push-a" not in matched(kv) and "zmq-a" in matched(kv)


def test_payloads_use_the_subscribers_codec_and_gaps_ask_for_a_snapshot(kv: Client) -> None:
    register(kv)
    stored = encode_batch([BlockStored([1, 2], None, TOKENS[: 2 * BS], BS, None, None, None)], 1.0, 0, "map")
    more = encode_batch([BlockStored([3], 2, TOKENS[2 * BS: 3 * BS], BS, None, None, None)], 2.0, 0, "array")
    done = kv.report_events(source_id="push-a", op="payloads",
                            payloads=[{"seq": 5, "payload": stored}, {"seq": 6, "payload": b"\xc1garbage"},
                                      {"seq": 7, "payload": more}])  # fmt: skip
    assert (done.applied_blocks, done.last_seq, done.resync) == (3, 7, False)
    assert done.errors == {"decode": 1}  # garbage counted, its seq consumed: no gap
    assert matched(kv)["push-a"]["matched_blocks"] == 3
    again = kv.report_events(source_id="push-a", op="payloads", payloads=[{"seq": 7, "payload": more}])
    assert (again.duplicates, again.applied_blocks) == (1, 0)  # a retried report changes nothing
    removed = encode_batch([BlockRemoved([3], None)], 3.0, 0, "mixed")
    gap = kv.report_events(source_id="push-a", op="payloads", payloads=[{"seq": 10, "payload": removed}])
    assert (gap.missed, gap.resync, gap.state, gap.last_seq) == (2, True, "gap", 10)
    assert matched(kv)["push-a"]["matched_blocks"] == 2  # applied all the same
    assert kv.report_events(source_id="push-a", op="heartbeat").resync  # until a snapshot
    snap = kv.report_events(source_id="push-a", op="snapshot", seq=11, events=[add([1], TOKENS[:BS])])
    assert (snap.resync, snap.state, snap.last_seq, snap.applied_blocks) == (False, "live", 11, 1)
    listed = source(kv, "push-a")
    assert listed is not None and listed["missed"] == 2 and listed["duplicates"] == 1
    assert listed["errors_by_kind"] == {"decode": 1}


def test_snapshot_replaces_and_a_new_generation_restarts_the_source(kv: Client) -> None:
    register(kv)
    kv.report_events(source_id="push-a", op="events", seq=0, events=[add([1, 2, 3, 4], TOKENS[: 4 * BS])])
    snap = kv.report_events(source_id="push-a", op="snapshot", events=[add([7, 8], OTHER[: 2 * BS])])
    assert snap.applied_blocks == 2 and snap.last_seq == -1
    assert "push-a" not in matched(kv)  # replaced, not merged
    assert matched(kv, OTHER)["push-a"]["matched_blocks"] == 2
    # the engine restarts: a snapshot at a higher generation replaces the incarnation
    restarted = kv.report_events(source_id="push-a", op="snapshot", generation=2, seq=0,
                                 events=[add([1, 2], TOKENS[: 2 * BS])])
    assert (restarted.generation, restarted.last_seq) == (2, 0)
    assert matched(kv)["push-a"]["matched_blocks"] == 2 and "push-a" not in matched(kv, OTHER)
    late = refused(lambda: kv.report_events(source_id="push-a", op="events", generation=0, seq=1,
                                            events=[add([9], OTHER[:BS])]))
    assert late.code is Code.VERSION_CONFLICT and "generation 0" in late.message
    assert "push-a" not in matched(kv, OTHER)  # the old engine's late batch was not applied
    ahead = refused(lambda: kv.report_events(source_id="push-a", op="heartbeat", generation=3))
    assert ahead.code is Code.VERSION_CONFLICT and "register or snapshot" in ahead.message
    assert refused(lambda: register(kv, generation=1)).code is Code.VERSION_CONFLICT
    # re-registering at a new generation drops the blocks too; the same registration is a no-op
    assert register(kv, generation=2).last_seq == 0 and "push-a" in matched(kv)
    assert refused(lambda: register(kv, generation=2, medium="CPU")).code is Code.DUPLICATE_ENTITY
    assert register(kv, generation=4, medium="CPU").last_seq == -1
    assert "push-a" not in matched(kv)


def test_down_drops_the_source_and_ids_are_not_shared_with_zmq_sources(kv: Client, tmp_path: Any) -> None:
    register(kv)
    kv.report_events(source_id="push-a", op="events", seq=0, events=[add([1, 2], TOKENS[: 2 * BS])])
    assert refused(lambda: kv.report_events(source_id="push-a", op="down", generation=1)).code \
        is Code.VERSION_CONFLICT
    assert "push-a" in matched(kv)  # an older incarnation cannot take the source down
    assert kv.report_events(source_id="push-a", op="down").state == "down"
    assert "push-a" not in matched(kv) and source(kv, "push-a") is None
    gone = refused(lambda: kv.report_events(source_id="push-a", op="heartbeat"))
    assert gone.code is Code.NOT_FOUND and "register first" in gone.message
    kv.call("add_event_source", {"source_id": "zmq-b", "instance_id": "llm", "endpoint": f"ipc://{tmp_path}/p"})
    assert refused(lambda: register(kv, "zmq-b")).code is Code.DUPLICATE_ENTITY
    assert refused(lambda: kv.report_events(source_id="zmq-b", op="heartbeat")).code is Code.NOT_FOUND
    unknown = refused(lambda: kv.report_events(source_id="push-x", op="register", instance_id="nope"))
    assert unknown.code is Code.INSTANCE_NOT_EXIST


def test_a_silent_push_source_goes_stale_then_expires_and_heartbeats_keep_it_live(kv: Client) -> None:
    register(kv)
    kv.report_events(source_id="push-a", op="events", seq=0, events=[add([1, 2], TOKENS[: 2 * BS])])
    end = time.monotonic() + 1.6  # longer than stale_after_s, heard all along
    while time.monotonic() < end:
        assert kv.report_events(source_id="push-a", op="heartbeat").state == "live"
        time.sleep(0.2)  # pacing: heartbeats well inside stale_after_s, not a wait for anything
    assert "push-a" in matched(kv)
    assert wait_for(lambda: "push-a" not in matched(kv))  # silent: stale, left out
    reply = kv.call("match_engines", {"instance_id": "llm", "token_ids": TOKENS})
    assert reply["stale_sources"] == 1 and reply["freshness"]["push-a"]["state"] in ("stale", "expired")
    assert wait_for(lambda: (source(kv, "push-a") or {}).get("state") == "expired")
    listed = source(kv, "push-a")
    assert listed is not None and listed["expired_blocks"] == 2 and listed["blocks_held"] == 0
    back = kv.report_events(source_id="push-a", op="heartbeat")
    assert (back.state, back.resync) == ("gap", True)  # its blocks are gone: send a snapshot
    kv.report_events(source_id="push-a", op="snapshot", events=[add([1], TOKENS[:BS])])
    assert matched(kv)["push-a"]["matched_blocks"] == 1 and source(kv, "push-a")["state"] == "live"  # type: ignore[index]


@pytest.mark.parametrize(("params", "named"), [
    ({"op": "heartbeat", "sequence": 1}, "sequence"),
    ({"op": "events", "seq": 0, "events": [{"type": "add", "block_hashes": [1], "tokens": []}]}, "events[0].tokens"),
    ({"op": "events", "seq": 0, "events": [{"type": "evict", "block_hashes": [1]}]}, "events[0]"),
    ({"op": "heartbeat", "events": [{"type": "clear"}]}, "the field events"),
    ({"op": "payloads", "pod": "p", "payloads": [{"seq": 0, "payload": b""}]}, "the field pod"),
    ({"op": "register", "instance_id": "llm", "seq": 3}, "seq"),
    ({"op": "events", "events": [{"type": "clear"}]}, "seq"),
    ({"op": "snapshot", "events": [{"type": "clear"}]}, "add events only"),
    ({"op": "payloads", "payloads": [{"seq": 0}]}, "payloads[0]"),
    ({"op": "payloads", "payloads": [{"seq": 0, "payload_b64": "!!"}]}, "payload_b64"),
    ({"op": "payloads", "payloads": [{"seq": -1, "payload": b""}]}, "payloads[0].seq"),
    ({"op": "payloads", "payloads": [{"seq": 0, "payload": b""}] * 1025}, "payloads"),
    ({"op": "poke"}, "op"),
])  # fmt: skip
def test_malformed_reports_are_refused_naming_the_field(kv: Client, params: dict[str, Any], named: str) -> None:
    register(kv)
    err = refused(lambda: kv.call("report_events", {"source_id": "push-a", **params}, retry=False))
    assert err.code in (Code.INVALID_ARGUMENT, Code.TOO_MANY_KEYS) and named in err.message, err.message


def test_over_the_turn_budget_is_too_large_before_any_work(kv: Client) -> None:
    register(kv)
    huge = [add(list(range(1, 4097)), [1] * (4096 * BS))] * 15  # 61,440 blocks: more work than a turn
    err = refused(lambda: kv.report_events(source_id="push-a", op="events", seq=0, events=huge))
    assert err.code is Code.TOO_LARGE
    assert source(kv, "push-a")["blocks_held"] == 0  # type: ignore[index]


def test_http_post_api_report_events(server: RunningServer, kv: Client) -> None:
    payload = encode_batch([BlockStored([1, 2], None, TOKENS[: 2 * BS], BS, None, "GPU", None)], 1.0)

    def post(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        req = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/api/report_events", method="POST",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    assert post({"source_id": "push-h", "op": "register", "instance_id": "llm"})[0] == 200
    status, body = post({"source_id": "push-h", "op": "payloads",
                         "payloads": [{"seq": 0, "payload_b64": base64.b64encode(payload).decode()}]})
    assert status == 200 and body["result"]["applied_blocks"] == 2
    assert matched(kv)["push-h"]["matched_blocks"] == 2
    status, body = post({"source_id": "push-h", "op": "heartbeat", "bogus": 1})
    assert status == 400 and "bogus" in body["error"]["message"]


def test_auth_a_reporter_reports_only_for_its_own_sources() -> None:
    with serve_in_thread(overrides={"auth": {"enabled": True, "admin_user": "admin", "admin_password": ADMIN_PW}}) \
            as srv, srv.client(auth={"user": "admin", "password": ADMIN_PW}) as admin:
        admin.call("create_instance_group", {"instance_group": {"name": "gb", "storage_candidates": ["default-file"]}})
        for user, group in (("alice", "default"), ("bob", "default"), ("carol", "gb")):
            admin.call("add_account", {"user_name": user, "password": f"{user}-pw", "groups": [group]})
        tokens = {u: admin.call("add_token", {"user_name": u})["token"] for u in ("alice", "bob", "carol")}
        admin.call("register_instance", {"instance_group": "default", "instance_id": "llm", "block_size": BS,
                                         "location_spec_infos": [{"name": "tp0", "size": 1024}]})  # fmt: skip
        alice, bob, carol = (srv.client(auth={"token": tokens[u]}) for u in ("alice", "bob", "carol"))
        with alice, bob, carol:
            mine = "llm/push-a"  # a non-admin's ids are in its instance's namespace
            register(alice, mine)
            assert alice.report_events(source_id=mine, op="events", seq=0,
                                       events=[add([1], TOKENS[:BS])]).applied_blocks == 1
            assert refused(lambda: bob.report_events(source_id=mine, op="heartbeat")).code \
                is Code.PERMISSION_DENIED
            assert refused(lambda: register(bob, mine)).code is Code.PERMISSION_DENIED  # no hijack by re-registering
            assert refused(lambda: bob.report_events(source_id=mine, op="down")).code is Code.PERMISSION_DENIED
            # another tenant's source looks missing, and its instance cannot be registered against
            assert refused(lambda: carol.report_events(source_id=mine, op="heartbeat")).code is Code.NOT_FOUND
            assert refused(lambda: register(carol, "llm/push-c")).code is Code.INSTANCE_NOT_EXIST
            assert admin.report_events(source_id=mine, op="heartbeat").state == "live"  # an admin may
            assert alice.report_events(source_id=mine, op="down").state == "down"


def test_a_turns_pooled_hashing_never_uses_states_of_a_batch_not_applied() -> None:
    """Reports of one dispatcher turn are re-hashed together before any is applied; a chain
    state computed from a batch that then is not applied (here a resent seq with other tokens
    under the same hash, pooled after the real one) must not be used for its child."""
    from kvcm.api.engines import methods
    from kvcm.backends.metastore import MemoryStore
    from kvcm.cache.keys import token_ids_to_block_keys
    from kvcm.engines.service import EngineService
    from kvcm.proto.wire import pack_request
    from kvcm.rpc.dispatch import Dispatcher

    svc = EngineService(MemoryStore(), lambda _: BS)
    try:
        dispatcher = Dispatcher(methods(svc))
        dispatcher.call("report_events", {"source_id": "p", "op": "register", "instance_id": "llm"})

        def batch(seq: int, h: int, tokens: list[int], parent: int | None = None) -> bytes:
            payload = encode_batch([BlockStored([h], parent, tokens, BS, None, None, None)], 1.0 + seq)
            return pack_request(seq, "report_events", {"source_id": "p", "op": "payloads",
                                                       "payloads": [{"seq": seq, "payload": payload}]})

        first, other, child = TOKENS[:BS], OTHER[:BS], TOKENS[BS: 2 * BS]
        dispatcher.handle(batch(0, 1, TOKENS[-BS:]))
        # one turn: seq 1 stores 7, a resent seq 1 (ignored) stores 7 otherwise, seq 2 is 7's child
        dispatcher.handle_batch([batch(1, 7, first), batch(1, 7, other), batch(2, 8, child, parent=7)])
        keys = token_ids_to_block_keys(first + child, BS)
        reply = svc.match("llm", block_keys=keys)
        assert [(s["source_id"], s["matched_blocks"]) for s in reply["sources"]] == [("p", 2)]
    finally:
        svc.stop()


def test_a_turns_pool_is_dropped_once_its_reports_ran_and_the_collector_runs_after_the_turn() -> None:
    """The pooled batches and their states die with the turn (not at the next turn's first
    report), and the collector is off while the turn runs, on again after it."""
    import gc

    from kvcm.api.engines import methods
    from kvcm.backends.metastore import MemoryStore
    from kvcm.engines.service import EngineService
    from kvcm.proto.wire import pack_request
    from kvcm.rpc.dispatch import Dispatcher

    seen: list[bool] = []

    def block_size(_: str) -> int:
        seen.append(gc.isenabled())
        return BS

    svc = EngineService(MemoryStore(), block_size)
    try:
        dispatcher = Dispatcher(methods(svc))
        for source in ("p", "q"):
            dispatcher.call("report_events", {"source_id": source, "op": "register", "instance_id": "llm"})

        def batch(source: str, seq: int, h: int, first: int) -> bytes:
            payload = encode_batch([BlockStored([h], None, TOKENS[first * BS : (first + 1) * BS], BS, None, None, None)],
                                   1.0 + seq)  # fmt: skip
            return pack_request(seq, "report_events", {"source_id": source, "op": "payloads",
                                                       "payloads": [{"seq": seq, "payload": payload}]})

        seen.clear()
        dispatcher.handle_batch([batch("p", 0, 1, 0), batch("q", 0, 2, 1), batch("p", 1, 3, 2)])
        assert seen and not any(seen) and gc.isenabled()
        assert svc.push._pool == [] and svc.push._hashed is None
        assert sorted(svc.index.blocks_of("p")) == [1, 3] and sorted(svc.index.blocks_of("q")) == [2]
        # a report of the next turn that cannot run (unknown source) leaves no pool behind either
        dispatcher.handle_batch([batch("p", 2, 4, 3), batch("nobody", 0, 5, 0)])
        assert svc.push._pool == [] and svc.push._hashed is None and 4 in svc.index.blocks_of("p")
        # a report named twice is pooled once; one outside the pool hashes on its own
        from kvcm.engines.push import Report

        def report(seq: int, h: int, parent: int) -> Report:
            payload = encode_batch([BlockStored([h], parent, TOKENS[(seq + 1) * BS : (seq + 2) * BS], BS)], 9.0 + seq)
            return Report(source_id="p", op="payloads", payloads=[(seq, payload)])

        twice, outside = report(3, 6, 4), report(4, 9, 6)
        svc.push.pool([twice, twice])
        assert len(svc.push._pool) == 1
        svc.report_events(twice)
        assert svc.push._pool == [] and 6 in svc.index.blocks_of("p")
        svc.push.pool([report(5, 10, 9)])  # a pool this report is not in is not hashed for it
        svc.report_events(outside)
        assert len(svc.push._pool) == 1 and svc.push._hashed is None and 9 in svc.index.blocks_of("p")
    finally:
        svc.stop()


def test_a_report_carried_to_a_later_turn_is_hashed_there_once() -> None:
    """The turn budget admits only some heavy reports; the rest wait. Only the admitted ones are
    pooled for the turn's hashing: every batch is hashed exactly once, and all are applied."""
    from kvcm.api.engines import methods
    from kvcm.backends.metastore import MemoryStore
    from kvcm.engines.service import EngineService
    from kvcm.proto.wire import pack_request
    from kvcm.rpc.dispatch import Dispatcher, Limits

    svc = EngineService(MemoryStore(), lambda _: BS)
    hashed: list[int] = []
    precompute = svc.index.precompute

    def counting(items: Any) -> Any:
        hashed.extend(len(item[3].events) for item in items)
        return precompute(items)

    svc.index.precompute = counting  # type: ignore[method-assign]
    try:
        dispatcher = Dispatcher(methods(svc), limits=Limits(turn_budget_ms=0.15))
        sources = [f"s{i}" for i in range(6)]
        for source in sources:
            dispatcher.call("report_events", {"source_id": source, "op": "register", "instance_id": "llm"})
        requests = []
        for n, source in enumerate(sources):  # each about 70 us of estimated work: heavy at a 150 us budget
            payloads = [{"seq": seq, "payload": encode_batch([BlockStored([100 * n + seq], None,
                        TOKENS[seq * BS : (seq + 1) * BS], BS, None, None, None)], 1.0)} for seq in range(4)]  # fmt: skip
            requests.append(pack_request(n, "report_events", {"source_id": source, "op": "payloads",
                                                              "payloads": payloads}))
        turns = 0
        arrivals = [((None, i), b"peer-%d" % i, r) for i, r in enumerate(requests)]
        replies = 0
        while replies < len(requests):
            replies += sum(1 for _, reply in dispatcher.serve(arrivals) if reply is not None)
            arrivals, turns = [], turns + 1
        assert turns > 1  # some reports were carried
        assert sum(hashed) == 4 * len(sources)  # every batch hashed once, none again after a carry
        assert all(len(svc.index.blocks_of(s)) == 4 for s in sources)
    finally:
        svc.stop()


def test_after_a_kvcm_restart_a_push_source_keeps_its_blocks_and_asks_for_a_snapshot(tmp_path: Any) -> None:
    data = str(tmp_path / "data")
    with serve_in_thread(data, overrides={"events": EVENTS}) as srv, srv.client() as kv:
        kv.call("register_instance", {"instance_group": "default", "instance_id": "llm", "block_size": BS,
                                      "location_spec_infos": [{"name": "tp0", "size": 1024}]})  # fmt: skip
        register(kv, generation=5, medium="CPU")
        kv.report_events(source_id="push-a", op="snapshot", generation=5, seq=3, events=[add([1, 2], TOKENS[: 2 * BS])])
        kv.report_events(source_id="push-a", op="events", generation=5, seq=4, events=[add([3], TOKENS[2 * BS: 3 * BS], 2)])
    with serve_in_thread(data, overrides={"events": EVENTS}) as srv, srv.client() as kv:
        got = matched(kv)["push-a"]
        assert {k: got[k] for k in ("source_id", "dp_rank", "matched_blocks", "media", "pod", "matched_tokens")} == \
            {"source_id": "push-a", "dp_rank": 0, "matched_blocks": 3, "media": {"CPU": 3}, "pod": "push-a",
             "matched_tokens": 3 * BS}
        back = kv.report_events(source_id="push-a", op="heartbeat", generation=5)
        assert (back.resync, back.state, back.last_seq) == (True, "gap", 4)  # nothing can replay what was lost
        assert refused(lambda: kv.report_events(source_id="push-a", op="heartbeat", generation=4)).code \
            is Code.VERSION_CONFLICT  # the generation was persisted with the source
        snap = kv.report_events(source_id="push-a", op="snapshot", generation=5, seq=9, events=[add([1], TOKENS[:BS])])
        assert (snap.resync, snap.state) == (False, "live") and matched(kv)["push-a"]["matched_blocks"] == 1


def test_reported_batches_are_persisted_before_the_answer_and_survive_kill_9(tmp_path: Any) -> None:
    from kvcm.testing import start_subprocess, stop_subprocess

    sock_dir = tempfile.mkdtemp(prefix="kvcm-", dir="/tmp")  # Unix socket paths are short
    data, sock = str(tmp_path / "data"), f"ipc://{sock_dir}/rpc"
    # the subscriber's wake-ups are 5 s apart: none persists anything before the kill
    server = start_subprocess(data, sock, ["--set", "events.poll_ms=5000"])
    try:
        with server.client() as kv:
            kv.call("register_instance", {"instance_group": "default", "instance_id": "llm", "block_size": BS,
                                          "location_spec_infos": [{"name": "tp0", "size": 1024}]})  # fmt: skip
            register(kv)
            kv.report_events(source_id="push-a", op="events", seq=0, events=[add([1, 2, 3], TOKENS[: 3 * BS])])
            kv.report_events(source_id="push-a", op="events", seq=1, events=[add([4], TOKENS[3 * BS: 4 * BS], 3)])
    finally:
        stop_subprocess(server, kill=True)
        shutil.rmtree(sock_dir, ignore_errors=True)
    with serve_in_thread(data) as srv, srv.client() as kv:
        assert matched(kv)["push-a"]["matched_blocks"] == 4


def test_the_collector_is_off_for_a_dispatcher_turn_and_back_on_after_it() -> None:
    """Every handler of a turn runs with the collector paused (one collection after the turn);
    a failing handler does not leave it off; one the process turned off stays off."""
    import gc

    from kvcm.rpc.dispatch import Dispatcher, Method

    seen: list[bool] = []

    def probe(params: Any) -> dict[str, Any]:
        seen.append(gc.isenabled())
        if params.get("fail"):
            raise RuntimeError("handler failed")
        return {}

    dispatcher = Dispatcher([Method("probe", probe, None)])
    assert dispatcher.call("probe", {}) == {} and seen == [False] and gc.isenabled()
    with pytest.raises(Exception):  # noqa: B017 - the handler's failure, as a wire error
        dispatcher.call("probe", {"fail": True})
    assert seen == [False, False] and gc.isenabled()
    gc.disable()
    try:
        dispatcher.call("probe", {})
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_report_of_many_tiny_or_unknown_events_is_costed_per_event() -> None:
    """Each event costs its own decode and bookkeeping, broken or unknown ones too: a payload of
    thousands of 3-byte unknown events must not look as cheap as its few kilobytes."""
    import msgpack
    import msgspec

    from kvcm.api.engines import ReportEventsRequest, methods
    from kvcm.backends.metastore import MemoryStore
    from kvcm.engines.service import EngineService

    svc = EngineService(MemoryStore(), lambda _: BS)
    try:
        (report,) = [m for m in methods(svc) if m.name == "report_events"]
        assert report.cost is not None
        payload = msgpack.packb([1.0, [["X"]] * 2000, 0])
        req = msgspec.convert({"source_id": "p", "op": "payloads", "payloads": [{"seq": 0, "payload": payload}]},
                              ReportEventsRequest)  # fmt: skip
        assert len(payload) < 7000
        assert report.cost(req).micros >= 2000 * 1.0  # at least a microsecond per event
    finally:
        svc.stop()
