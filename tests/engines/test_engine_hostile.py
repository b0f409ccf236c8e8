"""The engine tier under hostile input (tenants with the ``user`` role, unauthenticated callers,
hostile engines), on real servers: the engine index is bounded per source and in total, also
across restarts on the same data dir; a tenant cannot take every source slot, nor another
tenant's push source ids; note_routed neither fails on short prompts nor names another tenant's
instance; every request field that scales work is bounded and costed before decoding; timestamps
are finite and nulls are not read as values. Plus the push sequencing and ownership cases the
suite did not pin before (an older seq, a one-batch gap, an admin re-registering a user's source)
and a stale source kept out of matches whatever note_routed said.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgpack
import msgspec
import pytest
from prometheus_client import generate_latest

from kvcm import Client
from kvcm.errors import Code, KvcmError
from kvcm.proto.kv_events import BlockStored, EventDecodeError, count_events, decode_batch, encode_batch
from kvcm.testing import FakeEnginePublisher, RunningServer, serve_in_thread
from tests.helpers import wait_for

BS = 4
TOKENS = list(range(100, 100 + 8 * BS))  # 8 blocks
ADMIN_PW = "hostile-Admin-pw"
INSTANCE = {"instance_group": "default", "instance_id": "llm", "block_size": BS,
            "location_spec_infos": [{"name": "tp0", "size": 1024}]}  # fmt: skip


@contextmanager
def serving(data_dir: str | None = None, **events: Any) -> Iterator[tuple[RunningServer, Client]]:
    """A server (auth off) with ``events`` settings and the instance ``llm`` registered."""
    with serve_in_thread(data_dir, overrides={"events": events}) as srv, srv.client() as kv:
        kv.call("register_instance", INSTANCE)
        yield srv, kv


def keyed(hashes: list[int]) -> dict[str, Any]:
    """An add of blocks named by their kvcm keys (Tair's reporters): no tokens to hash."""
    return {"type": "add", "keyed": True, "block_hashes": hashes}


def flood(kv: Client, source_id: str, start: int, n: int) -> Any:
    """One report adding the keyed blocks ``start .. start + n - 1``."""
    return kv.report_events(source_id=source_id, op="events", events=[keyed(list(range(start, start + n)))])


def listed(kv: Client, source_id: str) -> dict[str, Any]:
    found = [s for s in kv.call("list_event_sources", {})["sources"] if s["source_id"] == source_id]
    assert found, f"{source_id} is not listed"
    return found[0]


def held_of(kv: Client, keys: list[int], source_id: str) -> int:
    """How many leading ``keys`` the source holds (match_engines)."""
    reply = kv.call("match_engines", {"instance_id": "llm", "block_keys": keys, "include_stale": True})
    return next((s["matched_blocks"] for s in reply["sources"] if s["source_id"] == source_id), 0)


def refused(fn: Callable[[], Any]) -> KvcmError:
    with pytest.raises(KvcmError) as exc:
        fn()
    return exc.value


def problems(srv: RunningServer) -> list[str]:
    found: list[str] = srv.app.engines.index.check()
    return found


# --- the engine index is bounded ----------------------------------------------------------------------


def test_a_flooding_source_keeps_its_newest_blocks_within_its_bound_across_restarts(tmp_path: Any) -> None:
    data = str(tmp_path / "data")
    with serving(data, max_blocks_per_source=64) as (srv, kv):
        kv.report_events(source_id="llm/flood", op="register", instance_id="llm")
        replies = [flood(kv, "llm/flood", 1 + 50 * i, 50) for i in range(5)]  # 250 blocks
        assert replies[0].errors == {} and replies[-1].errors.get("evicted", 0) > 0
        source = listed(kv, "llm/flood")
        held = source["blocks_held"]
        assert 0 < held <= 64 and source["evicted_blocks"] == 250 - held
        assert held_of(kv, list(range(251 - held, 251)), "llm/flood") == held  # the newest are kept
        assert held_of(kv, [1], "llm/flood") == 0  # the oldest went first
        assert problems(srv) == []
    with serving(data, max_blocks_per_source=64) as (srv, kv):  # the same index loads, counted right
        assert listed(kv, "llm/flood")["blocks_held"] == held and problems(srv) == []
    with serving(data, max_blocks_per_source=16) as (srv, kv):  # a lowered bound applies while loading
        assert listed(kv, "llm/flood")["blocks_held"] == 16 and problems(srv) == []
        assert held_of(kv, list(range(235, 251)), "llm/flood") == 16  # still the newest, in stored order
    with serving(data, max_blocks_per_source=64) as (srv, kv):  # what was dropped at start-up stays dropped
        assert listed(kv, "llm/flood")["blocks_held"] == 16 and problems(srv) == []


def test_loading_never_holds_more_than_the_bound_and_one_log_record(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A data dir written under a higher bound (or before bounds) is trimmed record by record as
    it loads, not after the whole index is in memory."""
    from kvcm.engines.index import EngineIndex

    data = str(tmp_path / "data")
    with serving(data, max_blocks_per_source=1000) as (_, kv):
        kv.report_events(source_id="llm/big", op="register", instance_id="llm")
        for i in range(6):  # one log record per report
            flood(kv, "llm/big", 1 + 50 * i, 50)
    seen: list[int] = []
    replay = EngineIndex._replay

    def watching(state: Any, serial: int, raw: bytes) -> None:
        seen.append(len(state.blocks))  # what the records before this one left in memory
        replay(state, serial, raw)

    monkeypatch.setattr(EngineIndex, "_replay", staticmethod(watching))
    with serving(data, max_blocks_per_source=16) as (srv, kv):
        assert len(seen) >= 6 and max(seen) <= 16, seen
        assert listed(kv, "llm/big")["blocks_held"] == 16 and problems(srv) == []


def test_past_the_total_a_source_over_its_fair_share_pays_and_a_small_one_takes_from_the_largest(
    tmp_path: Any,
) -> None:
    data = str(tmp_path / "data")
    with serving(data, max_blocks_per_source=200, max_blocks=200) as (srv, kv):
        for source in ("llm/legit", "llm/flood", "llm/late"):
            kv.report_events(source_id=source, op="register", instance_id="llm")
        flood(kv, "llm/legit", 1, 60)
        for i in range(5):
            flood(kv, "llm/flood", 1000 + 100 * i, 100)
        assert listed(kv, "llm/legit")["blocks_held"] == 60  # below its fair share: untouched
        assert listed(kv, "llm/flood")["blocks_held"] <= 140 and problems(srv) == []
        # a source that holds little may still store: the largest source makes room
        assert flood(kv, "llm/late", 5000, 50).errors == {}
        assert listed(kv, "llm/late")["blocks_held"] == 50 and listed(kv, "llm/legit")["blocks_held"] == 60
        assert problems(srv) == []
    with serving(data, max_blocks_per_source=100, max_blocks=100) as (srv, kv):
        total = sum(s["blocks_held"] for s in kv.call("list_event_sources", {})["sources"])
        assert 0 < total <= 100 and problems(srv) == []


def test_a_block_covering_several_instance_blocks_weighs_as_many(tmp_path: Any) -> None:
    """An engine block of 2 instance blocks is 2 kvcm keys: it counts twice against the bound,
    and the count is the same after a restart (removals, keyed adds and clears included)."""
    data = str(tmp_path / "data")
    wide = [{"type": "add", "block_hashes": [1, 2, 3, 4], "token_ids": TOKENS, "block_size": 2 * BS}]
    with serving(data, max_blocks_per_source=10) as (srv, kv):
        kv.report_events(source_id="llm/wide", op="register", instance_id="llm")
        kv.report_events(source_id="llm/wide", op="events", seq=0, events=wide)  # 4 blocks, 8 keys
        assert listed(kv, "llm/wide")["blocks_held"] == 8 and problems(srv) == []
        kv.report_events(source_id="llm/wide", op="events", seq=1, events=[keyed([900, 901, 902])])
        assert listed(kv, "llm/wide")["blocks_held"] <= 10 and listed(kv, "llm/wide")["evicted_blocks"] >= 1
        kv.report_events(source_id="llm/wide", op="events", seq=2,
                         events=[{"type": "remove", "block_hashes": [902], "keyed": True}])
        before = listed(kv, "llm/wide")["blocks_held"]
        assert problems(srv) == []
    with serving(data, max_blocks_per_source=10) as (srv, kv):
        assert listed(kv, "llm/wide")["blocks_held"] == before and problems(srv) == []
    with serving(data, max_blocks_per_source=3) as (srv, kv):  # loading weighs the blocks too
        assert listed(kv, "llm/wide")["blocks_held"] <= 3 and problems(srv) == []
        kv.report_events(source_id="llm/wide", op="snapshot", events=[keyed([7])])
        assert listed(kv, "llm/wide")["blocks_held"] == 1 and problems(srv) == []


def test_a_hostile_engine_cannot_multiply_slots_groups_or_names() -> None:
    """Each (medium, group) of a source is a bit of every holder mask of its namespace: an
    engine naming ever new media or groups is held to a few, the rest refused and counted."""
    with serving() as (srv, kv), FakeEnginePublisher() as engine, FakeEnginePublisher() as other:
        for source_id, pub in (("zmq-media", engine), ("zmq-groups", other)):
            kv.call("add_event_source", {"source_id": source_id, "instance_id": "llm", "endpoint": pub.endpoint,
                                         "replay_endpoint": pub.replay_endpoint})  # fmt: skip
        for i in range(70):
            engine.store([i + 1], TOKENS[:BS], block_size=BS, medium=f"M{i}")
            other.store([i + 1], TOKENS[:BS], block_size=BS, group_idx=i)
        engine.store([500], TOKENS[:BS], block_size=BS, medium="M" * 300)

        def errors(source_id: str) -> dict[str, int]:
            by_kind: dict[str, int] = listed(kv, source_id)["errors_by_kind"]
            return by_kind

        assert wait_for(lambda: errors("zmq-media") == {"too_many_slots": 6, "bad_label": 1}), errors("zmq-media")
        assert wait_for(lambda: errors("zmq-groups") == {"too_many_groups": 6}), errors("zmq-groups")
        assert len(listed(kv, "zmq-media")["blocks_by_medium"]) == 64
        table = srv.app.engines.index._tables[("llm", "")]
        assert len([s for s in table.slots if s is not None]) == 128  # 64 per source, no more
        assert problems(srv) == []


# --- source slots: per account, and some kept for admins ----------------------------------------------


@contextmanager
def tenants(data_dir: str | None = None, **events: Any) -> Iterator[tuple[RunningServer, dict[str, Client]]]:
    """Auth on: groups ga (instance ia) and gb (ib); alice and bob use ga, carol gb; token clients."""
    overrides = {"auth": {"enabled": True, "admin_user": "admin", "admin_password": ADMIN_PW}, "events": events}
    with serve_in_thread(data_dir, overrides=overrides) as srv, \
            srv.client(auth={"user": "admin", "password": ADMIN_PW}) as admin:
        clients = {"admin": admin}
        made = {a["user_name"] for a in admin.call("list_account")["accounts"]}
        for group, instance in (("ga", "ia"), ("gb", "ib")):
            if instance not in [i["instance_id"] for i in admin.call("list_instance_info")["instance_info"]]:
                admin.call("create_instance_group", {"instance_group": {"name": group,
                                                                        "storage_candidates": ["default-file"]}})
                admin.call("register_instance", {**INSTANCE, "instance_group": group, "instance_id": instance})
        for user, group in (("alice", "ga"), ("bob", "ga"), ("carol", "gb")):
            if user not in made:
                admin.call("add_account", {"user_name": user, "password": f"{user}-Passw0rd", "groups": [group]})
            clients[user] = srv.client(auth={"user": user, "password": f"{user}-Passw0rd"})
        try:
            yield srv, clients
        finally:
            for user in ("alice", "bob", "carol"):
                clients[user].close()


def register(kv: Client, source_id: str, instance_id: str, **kw: Any) -> Any:
    return kv.report_events(source_id=source_id, op="register", instance_id=instance_id, **kw)


def test_no_tenant_takes_every_source_slot_and_the_quota_holds_after_a_restart(tmp_path: Any) -> None:
    data = str(tmp_path / "data")
    limits = {"max_sources": 6, "reserved_admin_sources": 2, "max_sources_per_account": 2}
    with tenants(data, **limits) as (_, kv):
        register(kv["alice"], "ia/a1", "ia")
        register(kv["alice"], "ia/a2", "ia")
        over = refused(lambda: register(kv["alice"], "ia/a3", "ia"))
        assert over.code is Code.REACH_MAX_ENTITY_CAPACITY and "max_sources_per_account=2" in over.message
        register(kv["bob"], "ia/b1", "ia")
        register(kv["bob"], "ia/b2", "ia")  # 4 sources: the 2 slots left are the admins'
        kept = refused(lambda: register(kv["carol"], "ib/c1", "ib"))
        assert kept.code is Code.REACH_MAX_ENTITY_CAPACITY and "reserved_admin_sources" in kept.message
        register(kv["admin"], "ib/admin-1", "ib")  # an admin still gets in
        kv["admin"].call("add_event_source", {"source_id": "zmq-1", "instance_id": "ib", "endpoint": "ipc:///tmp/kvcm-x"})
        full = refused(lambda: register(kv["admin"], "ib/admin-2", "ib"))
        assert full.code is Code.REACH_MAX_ENTITY_CAPACITY and "events.max_sources=6" in full.message
        assert kv["alice"].report_events(source_id="ia/a1", op="down").state == "down"
        for source_id in ("ib/admin-1", "zmq-1"):
            kv["admin"].call("remove_event_source", {"source_id": source_id})
        assert register(kv["alice"], "ia/a3", "ia").state == "live"  # its own slot came free
    with tenants(data, **{**limits, "reserved_admin_sources": 0}) as (_, kv):  # owners persist
        over = refused(lambda: register(kv["alice"], "ia/a4", "ia"))
        assert over.code is Code.REACH_MAX_ENTITY_CAPACITY and "max_sources_per_account=2" in over.message


def test_push_source_ids_are_in_the_namespace_of_their_instance() -> None:
    """A tenant cannot register an id another tenant's engine will use (Tair's reporter ids are
    ``tair/<instance>/<storage>/<host>``, predictable): non-admins register ids of their own
    instance's namespace only, so the id stays free for that instance's tenant."""
    with tenants() as (_, kv):
        carol = kv["carol"]
        for squat in ("tair/ia/L1P5/10.0.0.1:80", "ia/engine-0", "engine-0", "tair/x"):
            err = refused(lambda squat=squat: register(carol, squat, "ib"))  # type: ignore[misc]
            assert err.code is Code.PERMISSION_DENIED and "'ib/'" in err.message, (squat, err.message)
            assert "ia" not in err.message.replace(squat, "")  # says nothing of other instances
        assert register(carol, "ib/engine-0", "ib").state == "live"
        assert register(carol, "tair/ib/L1P5/10.0.0.1:80", "ib").state == "live"
        assert register(kv["alice"], "tair/ia/L1P5/10.0.0.1:80", "ia").state == "live"  # still free for ia's tenant
        assert register(kv["admin"], "anything", "ia").state == "live"  # admins name sources freely
        moved = refused(lambda: register(carol, "ib/engine-0", "ia", generation=1))  # not its instance: missing
        assert moved.code is Code.INSTANCE_NOT_EXIST


# --- note_routed -------------------------------------------------------------------------------------------


def test_note_routed_with_a_prompt_shorter_than_a_block_notes_nothing_and_breaks_nothing() -> None:
    with serving() as (srv, kv):
        kv.report_events(source_id="llm/p", op="register", instance_id="llm")
        short = kv.call("note_routed", {"instance_id": "llm", "source_id": "llm/p", "token_ids": TOKENS[: BS - 1]})
        assert short["num_blocks"] == 0 and len(srv.app.engines.speculative) == 0
        nothing = refused(lambda: kv.call("note_routed", {"instance_id": "llm", "source_id": "llm/p"}, retry=False))
        assert nothing.code is Code.INVALID_ARGUMENT  # no prompt at all is the caller's mistake
        full = kv.call("note_routed", {"instance_id": "llm", "source_id": "llm/p", "token_ids": TOKENS})
        assert full["num_blocks"] == 8 and held_of(kv, srv.app.engines.keys_for("llm", TOKENS, None), "llm/p") == 8
        srv.app.engines.speculative.max_entries = 1  # the next note drops the oldest entry
        kv.call("note_routed", {"instance_id": "llm", "source_id": "llm/p", "token_ids": TOKENS[: 2 * BS]})
        assert kv.call("remove_event_source", {"source_id": "llm/p"}) == {"source_id": "llm/p", "instance_id": "llm"}
        assert 'source="llm/p"' not in generate_latest(srv.app.metrics.registry).decode()
        assert kv.call("list_event_sources", {})["sources"] == []


def test_note_routed_answers_a_source_of_another_tenant_like_a_missing_one() -> None:
    with tenants() as (_, kv):
        kv["admin"].call("add_event_source", {"source_id": "sb", "instance_id": "ib", "endpoint": "ipc:///tmp/kvcm-y"})
        foreign = refused(lambda: kv["alice"].call("note_routed", {"instance_id": "ia", "source_id": "sb",
                                                                   "block_keys": [1]}, retry=False))
        missing = refused(lambda: kv["alice"].call("note_routed", {"instance_id": "ia", "source_id": "nope",
                                                                   "block_keys": [1]}, retry=False))
        assert foreign.code is missing.code is Code.NOT_FOUND
        assert foreign.message == missing.message.replace("nope", "sb") and "ib" not in foreign.message


def test_a_stale_source_stays_out_of_matches_whatever_note_routed_says() -> None:
    events = {"probe_interval_s": 0.2, "stale_after_s": 0.5, "expire_after_s": 0, "poll_ms": 20}
    with serving(**events) as (_, kv):
        kv.report_events(source_id="llm/s", op="register", instance_id="llm")
        kv.report_events(source_id="llm/s", op="events", seq=0, events=[
            {"type": "add", "block_hashes": [1, 2], "token_ids": TOKENS[: 2 * BS], "block_size": BS}])
        assert wait_for(lambda: kv.call("match_engines", {"instance_id": "llm", "token_ids": TOKENS})["stale_sources"])
        kv.call("note_routed", {"instance_id": "llm", "source_id": "llm/s", "token_ids": TOKENS, "ttl_s": 30})
        reply = kv.call("match_engines", {"instance_id": "llm", "token_ids": TOKENS})
        assert reply["sources"] == [] and reply["stale_sources"] == 1
        kept = kv.call("match_engines", {"instance_id": "llm", "token_ids": TOKENS, "include_stale": True})
        assert [(s["source_id"], s["matched_blocks"], s.get("speculative")) for s in kept["sources"]] == \
            [("llm/s", 8, True)]


# --- request fields that scale work: bounded by the schema, costed ------------------------------------------


def test_media_medium_and_loads_are_bounded_before_any_work() -> None:
    with serving() as (_, kv):
        query = {"instance_id": "llm", "block_keys": [1, 2]}
        cases = [
            ("match_engines", {**query, "media": [f"m{i}" for i in range(65)]}, "media"),
            ("match_engines", {**query, "medium": "M" * 257}, "medium"),
            ("match_engines", {**query, "lora_name": "a" * 257}, "lora_name"),
            ("match_engines", {**query, "loads": {f"s{i}": 1.0 for i in range(16001)}}, "loads"),
            ("get_host_cache_state", {**query, "medium": ["GPU"] * 65}, "medium"),
            ("note_routed", {**query, "source_id": "x", "lora_name": "a" * 257}, "lora_name"),
        ]
        for method, params, named in cases:
            err = refused(lambda m=method, p=params: kv.call(m, p, retry=False))  # type: ignore[misc]
            assert err.code in (Code.TOO_MANY_KEYS, Code.INVALID_ARGUMENT) and named in err.message, err.message
        assert kv.call("match_engines", {**query, "media": [f"m{i}" for i in range(64)]})["sources"] == []


def test_the_match_estimate_counts_media_and_loads() -> None:
    from kvcm.api.engines import GetHostCacheStateRequest, MatchEnginesRequest, NoteRoutedRequest, methods
    from kvcm.backends.metastore import MemoryStore
    from kvcm.engines.service import EngineService

    svc = EngineService(MemoryStore(), lambda _: BS)
    try:
        cost = {m.name: m.cost for m in methods(svc)}
        loads = {f"s{i}": 1.0 for i in range(16000)}
        media = [f"m{i}" for i in range(64)]
        match = msgspec.convert({"instance_id": "llm", "block_keys": [1], "media": media, "loads": loads},
                                MatchEnginesRequest)  # fmt: skip
        host = msgspec.convert({"instance_id": "llm", "block_keys": [1], "medium": media, "loads": loads},
                               GetHostCacheStateRequest)  # fmt: skip
        note = msgspec.convert({"instance_id": "llm", "source_id": "s", "block_keys": list(range(65536))},
                               NoteRoutedRequest)  # fmt: skip
        assert cost["match_engines"](match).micros >= 16064 and cost["get_host_cache_state"](host).micros >= 16064
        assert cost["note_routed"](note).micros >= 65536 * 0.05
    finally:
        svc.stop()


def test_distinct_media_filters_do_not_grow_the_index() -> None:
    with serving() as (srv, kv):
        kv.report_events(source_id="llm/p", op="register", instance_id="llm")
        flood(kv, "llm/p", 1, 4)
        for i in range(300):
            kv.call("match_engines", {"instance_id": "llm", "block_keys": [1, 2], "media": ["GPU", f"x{i}"]})
        assert len(srv.app.engines.index._tables[("llm", "")]._allowed) <= 256


def test_count_events_reads_the_header_of_every_shape() -> None:
    stored = BlockStored([1], None, TOKENS[:BS], BS)
    for encoding in ("map", "array", "mixed"):
        for n in (0, 3, 15, 16, 70_000):
            assert count_events(encode_batch([stored] * n, 1.0, 0, encoding)) == n, (encoding, n)
    assert count_events(msgpack.packb({"events": [0] * 20, "ts": 1.0, "pad": "x" * 100})) == 20  # any key order
    assert count_events(msgpack.packb([7, [0] * 3])) == 3 and count_events(msgpack.packb([-300, [0] * 17])) == 17
    claim = b"\x93\xcb" + bytes(8) + b"\xdd\xff\xff\xff\xff"  # a header claiming 2^32 - 1 events, and no events
    assert count_events(claim) == (1 << 32) - 1  # costed as claimed: refused, never decoded
    for garbage in (b"", b"\xc1", msgpack.packb([1.0]), msgpack.packb([1.0, 5]), msgpack.packb({"ts": 1.0})):
        assert count_events(garbage) == 0


def test_a_payload_of_many_tiny_events_is_refused_before_it_is_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    """120,000 three-byte events (360 KB) cost their events, not their bytes: TOO_LARGE from the
    header's count, and not one of them decoded."""
    from kvcm.api.engines import methods
    from kvcm.backends.metastore import MemoryStore
    from kvcm.engines import push
    from kvcm.engines.service import EngineService
    from kvcm.rpc.dispatch import Dispatcher

    decoded: list[int] = []
    real = push.decode_batch

    def counting(payload: bytes, packed_tokens: bool = False) -> Any:
        decoded.append(len(payload))
        return real(payload, packed_tokens)

    monkeypatch.setattr(push, "decode_batch", counting)
    svc = EngineService(MemoryStore(), lambda _: BS)
    try:
        dispatcher = Dispatcher(methods(svc))
        dispatcher.call("report_events", {"source_id": "p", "op": "register", "instance_id": "llm"})
        tiny = msgpack.packb([1.0, [["X"]] * 120_000, 0])
        with pytest.raises(KvcmError) as exc:
            dispatcher.call("report_events", {"source_id": "p", "op": "payloads",
                                              "payloads": [{"seq": 0, "payload": tiny}]})
        assert exc.value.code is Code.TOO_LARGE and decoded == []
        small = encode_batch([BlockStored([1], None, TOKENS[:BS], BS)], 1.0)
        done = dispatcher.call("report_events", {"source_id": "p", "op": "payloads",
                                                 "payloads": [{"seq": 0, "payload": small}]})
        assert done["applied_blocks"] == 1 and decoded == [len(small)]
    finally:
        svc.stop()


# --- lenient inputs -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ts", [math.nan, math.inf, -math.inf, -1.0, 1e13])
def test_a_reported_batch_time_must_be_a_real_time(ts: float) -> None:
    with serving() as (_, kv):
        kv.report_events(source_id="llm/p", op="register", instance_id="llm")
        for op in ("events", "snapshot"):
            err = refused(lambda op=op: kv.call("report_events", {  # type: ignore[misc]
                "source_id": "llm/p", "op": op, "seq": 0, "ts": ts, "events": [keyed([1])]}, retry=False))
            assert err.code is Code.INVALID_ARGUMENT and "`ts`" in err.message, err.message
        assert listed(kv, "llm/p")["blocks_held"] == 0


def test_a_payload_whose_time_is_not_finite_is_not_a_batch() -> None:
    nan = encode_batch([BlockStored([1], None, TOKENS[:BS], BS)], math.nan)
    with pytest.raises(EventDecodeError, match="finite"):
        decode_batch(nan)
    with pytest.raises(EventDecodeError, match="finite"):
        decode_batch(msgpack.packb([math.inf, [["X"]], 0]))  # the per-event path too
    with serving() as (_, kv):
        kv.report_events(source_id="llm/p", op="register", instance_id="llm")
        done = kv.report_events(source_id="llm/p", op="payloads", payloads=[{"seq": 0, "payload": nan}])
        assert (done.errors, done.applied_blocks, done.last_seq) == ({"decode": 1}, 0, 0)  # garbage: seq consumed


@pytest.mark.parametrize(("op", "field"), [
    ("register", "instance_id"), ("register", "dp_rank"), ("register", "pod"), ("register", "medium"),
    ("events", "seq"), ("events", "ts"), ("snapshot", "seq"), ("payloads", "payloads[0].payload"),
])  # fmt: skip
def test_null_is_never_read_as_a_value(op: str, field: str) -> None:
    """A null where the schema wants an int or a string is refused naming it, not read as 0,
    "", "now" or "absent"."""
    base: dict[str, Any] = {
        "register": {"instance_id": "llm"},
        "events": {"seq": 0, "events": [keyed([1])]},
        "snapshot": {"events": [keyed([1])]},
        "payloads": {"payloads": [{"seq": 0, "payload": None, "payload_b64": "AA=="}]},
    }[op]
    params = {"source_id": "llm/p", "op": op, **base}
    if "[" not in field:
        params[field] = None
    with serving() as (_, kv):
        kv.report_events(source_id="llm/p", op="register", instance_id="llm")
        err = refused(lambda: kv.call("report_events", params, retry=False))
        assert err.code is Code.INVALID_ARGUMENT and field in err.message, err.message


# --- push sequencing and ownership ----------------------------------------------------------------------------


def test_a_batch_older_than_the_last_is_a_duplicate_not_a_new_batch() -> None:
    with serving() as (_, kv):
        kv.report_events(source_id="llm/p", op="register", instance_id="llm")
        for seq in range(3):
            kv.report_events(source_id="llm/p", op="events", seq=seq, events=[keyed([seq + 1])])
        old = kv.report_events(source_id="llm/p", op="events", seq=1, events=[keyed([99])])
        assert (old.duplicates, old.applied_blocks, old.last_seq, old.resync) == (1, 0, 2, False)
        assert held_of(kv, [99], "llm/p") == 0 and listed(kv, "llm/p")["last_seq"] == 2
        nxt = kv.report_events(source_id="llm/p", op="events", seq=3, events=[keyed([4])])
        assert (nxt.missed, nxt.resync, nxt.applied_blocks) == (0, False, 1)


def test_a_gap_of_exactly_one_batch_asks_for_a_snapshot() -> None:
    with serving() as (_, kv):
        kv.report_events(source_id="llm/p", op="register", instance_id="llm")
        kv.report_events(source_id="llm/p", op="events", seq=0, events=[keyed([1])])
        gap = kv.report_events(source_id="llm/p", op="events", seq=2, events=[keyed([3])])
        assert (gap.missed, gap.resync, gap.state, gap.applied_blocks) == (1, True, "gap", 1)


def test_an_admin_re_registering_a_users_push_source_does_not_take_it_over() -> None:
    with tenants() as (_, kv):
        alice, bob, admin = kv["alice"], kv["bob"], kv["admin"]
        register(alice, "ia/engine", "ia", pod="pod-1")
        assert register(admin, "ia/engine", "ia", pod="pod-1").state == "live"  # the same registration: no-op
        assert alice.report_events(source_id="ia/engine", op="events", seq=0, events=[keyed([1])]).applied_blocks == 1
        register(admin, "ia/engine", "ia", pod="pod-2", generation=1)  # an admin restarts it elsewhere
        assert alice.report_events(source_id="ia/engine", op="heartbeat", generation=1).state == "live"
        assert refused(lambda: bob.report_events(source_id="ia/engine", op="heartbeat", generation=1)).code \
            is Code.PERMISSION_DENIED


# --- the bookkeeping behind the bounds --------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_sizes_match_a_recount_through_random_histories_and_restarts(tmp_path: Any, seed: int) -> None:
    """Random stores (engine blocks of half, one and two instance blocks, chained or not, on two
    media and two groups, keyed ones too), removals, clears and snapshots over three sources under
    small bounds: after every batch and every restart each source's size is what its blocks weigh
    and every bound holds."""
    import random

    from kvcm.backends.metastore import LmdbStore
    from kvcm.engines.index import EngineIndex
    from kvcm.engines.sources import SourceSpec
    from kvcm.proto.kv_events import AllBlocksCleared, BlockRemoved, DecodedBatch

    rng = random.Random(seed)
    path = str(tmp_path / "engines")
    sources = [SourceSpec(f"s{i}", "llm", f"ipc:///tmp/kvcm-r{i}") for i in range(3)]

    def opened() -> tuple[LmdbStore, EngineIndex]:
        store = LmdbStore(path, map_size=1 << 26, sync=False)
        index = EngineIndex(store, lambda _: BS, max_blocks_per_source=40, max_blocks=90)
        index.load()
        return store, index

    def event(hashes: list[int]) -> Any:
        kind = rng.random()
        if kind < 0.55:
            size = rng.choice((BS // 2, BS, 2 * BS))
            n = rng.randint(1, 6)
            parent = rng.choice([None, *hashes[-5:]]) if hashes else None
            return BlockStored([rng.randint(1, 400) for _ in range(n)], parent,
                               [rng.randint(0, 50) for _ in range(n * size)], size, None,
                               rng.choice(("GPU", "CPU")), None, None, rng.choice((0, 0, 1)))  # fmt: skip
        if kind < 0.7:
            from kvcm.engines.index import KEYED

            return BlockStored([rng.randint(1, 400) for _ in range(rng.randint(1, 5))], None, [], 0,
                               medium="GPU", extra_keys=KEYED)  # fmt: skip
        if kind < 0.95:
            return BlockRemoved([rng.randint(1, 400) for _ in range(rng.randint(1, 6))],
                                rng.choice(("GPU", "CPU")), rng.choice((0, 1)))  # fmt: skip
        return AllBlocksCleared()

    store, index = opened()
    for spec in sources:
        index.add_source(spec)
    seqs = {spec.source_id: 0 for spec in sources}
    try:
        for step in range(150):
            spec = rng.choice(sources)
            state = index.get(spec.source_id)
            assert state is not None
            hashes = [bid & ((1 << 64) - 1) for bid in index.blocks_of(spec.source_id)]
            batch = DecodedBatch(1.0, [event(hashes) for _ in range(rng.randint(1, 4))])
            item = (spec.source_id, state.generation, seqs[spec.source_id], batch)
            if rng.random() < 0.05:
                index.replace_source(item)
            else:
                index.apply_many([item])
            seqs[spec.source_id] += 1
            assert index.check() == [], (step, index.check())
            if rng.random() < 0.2:
                index.flush()
            if step % 50 == 49:
                index.flush()
                held = {s.spec.source_id: index.blocks_of(s.spec.source_id) for s in index.sources()}
                store.close()
                store, index = opened()
                assert index.check() == []
                assert {s.spec.source_id: index.blocks_of(s.spec.source_id) for s in index.sources()} == held
    finally:
        store.close()
