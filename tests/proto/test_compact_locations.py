"""Compact location replies (``reply_format: "compact"``): expanded by a decoder written here from
docs/rpc.md alone, every reply equals the classic one (same blocks, URIs, order), for random mixes
of storages, spec layouts, containers, gaps, unusable storages, masks, spec filters and query
types against a real server; the typed clients read them lazily and give the same locations."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import urllib.request
from collections.abc import Iterator
from typing import Any

import msgpack
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcm.aio import Client as AsyncClient
from kvcm.cache import locations as addresses
from kvcm.cache.lookup import compact_reply
from kvcm.proto import locations as compact
from kvcm.proto.results import CacheLocations, decoder
from kvcm.testing import serve_in_thread
from tests.helpers import add_file_storage, add_group, add_shm_storage, register, remove_shm, shm_prefix

GROUPS = {"cl-one": ["default-file"], "cl-two": ["cl-file-b", "default-file"], "cl-shm": ["cl-shm"]}
MOD = 1 << 64


def expand(reply: dict[str, Any]) -> list[dict[str, Any]]:
    """The independent decoder: a compact reply as the classic list of locations."""
    version, count, rows, entries, names = reply["compact"]
    assert version == 1
    by_id = {row[0]: row for row in rows}
    out, i = [], 0
    while i < len(entries):
        if isinstance(entries[i], dict):
            loc, i = entries[i], i + 1
        else:
            _, kind, spec_names, fmts, counts, ref = by_id[entries[i]]
            ints = [(r + d) % MOD for r, d in zip(ref, entries[i + 1], strict=True)]
            starts = list(itertools.accumulate(counts, initial=0))
            uris = [fmt % tuple(ints[a:b]) for fmt, a, b in zip(fmts, starts, starts[1:])]
            loc = {"type": kind, "spec_size": len(uris),
                   "location_specs": [{"name": n, "uri": u} for n, u in zip(spec_names, uris, strict=True)]}
            i += 2
        if names:
            kept = [s for s in loc["location_specs"] if s["name"] in names]
            loc = {"type": loc["type"], "spec_size": len(kept), "location_specs": kept}
        out.append(loc)
    assert len(out) == count
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    prefix = shm_prefix()
    with serve_in_thread() as srv, srv.client() as c:
        add_file_storage(c, "cl-file-b", tmp_path_factory.mktemp("file-b"))
        add_shm_storage(c, "cl-shm", prefix)
        for name, candidates in GROUPS.items():
            add_group(c, name, candidates)
        yield srv
    remove_shm(prefix)


_instances = itertools.count()
SPEC_LAYOUTS = st.lists(st.sampled_from([256, 1024, 4096]), min_size=1, max_size=3)


@st.composite
def scenario(draw: st.DrawFn) -> dict[str, Any]:
    writes = draw(st.lists(st.tuples(st.lists(st.integers(1, 30), min_size=1, max_size=12, unique=True),
                                     st.integers(0, 12)), min_size=1, max_size=5))
    queries = draw(st.lists(st.tuples(
        st.sampled_from(["prefix_match", "batch_get", "reverse_roll_sw_match"]),
        st.lists(st.integers(1, 32), min_size=1, max_size=20),
        st.integers(0, 3),  # 0: no mask; else a mask drawn below
        st.integers(1, 4),  # sw_size
        st.booleans(),  # filter spec names
    ), min_size=1, max_size=6))
    return {"group": draw(st.sampled_from(sorted(GROUPS))), "sizes": draw(SPEC_LAYOUTS), "writes": writes,
            "removed": draw(st.lists(st.integers(1, 30), max_size=4)), "queries": queries,
            "disable": draw(st.booleans()), "seed": draw(st.integers(0, 2**31))}


def _params(instance: str, query: tuple[str, list[int], int, int, bool], names: list[str],
            rng: random.Random) -> dict[str, Any]:
    kind, keys, mask, sw, filtered = query
    params: dict[str, Any] = {"instance_id": instance, "query_type": kind, "block_keys": keys}
    if mask == 1:
        params["block_mask"] = {"offset": rng.randrange(len(keys))}
    elif mask == 2:
        params["block_mask"] = {"bool_masks": [rng.random() < 0.3 for _ in keys]}
    if kind == "reverse_roll_sw_match":
        params["sw_size"] = min(sw, len(keys))
    if filtered:
        params["location_spec_names"] = rng.sample(names, rng.randint(1, len(names)))
    return params


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=scenario())
def test_expanding_the_compact_reply_gives_the_classic_one(server: Any, case: dict[str, Any]) -> None:
    rng = random.Random(case["seed"])
    instance = f"cl-{next(_instances)}"
    names = [f"tp{i}" for i in range(len(case["sizes"]))]
    with server.client() as c:
        register(c, instance, group=case["group"],
                 specs=[{"name": n, "size": size} for n, size in zip(names, case["sizes"])])
        for keys, ok in case["writes"]:  # partial successes leave gaps inside a container
            session = c.call("start_write_cache", {"instance_id": instance, "block_keys": keys})
            n = len(session["locations"])
            if n:
                c.call("finish_write_cache", {"instance_id": instance, "write_session_id": session["write_session_id"],
                                              "success_blocks": {"offset": min(ok, n)}})
        if case["removed"]:
            c.call("remove_cache", {"instance_id": instance, "block_keys": case["removed"]})
        disabled = GROUPS[case["group"]][0] if case["disable"] and len(GROUPS[case["group"]]) > 1 else None
        if disabled:
            c.call("disable_storage", {"storage_unique_name": disabled})
        try:
            for query in case["queries"]:
                params = _params(instance, query, names, rng)
                classic = c.call("get_cache_location", params)["locations"]
                reply = c.call("get_cache_location", {**params, "reply_format": "compact"})
                assert expand(reply) == classic, params
                lazy = c.get_cache_location(**params)  # uri() before anything is built: one URI formatted
                for b, loc in enumerate(classic):
                    for spec in loc["location_specs"]:
                        assert lazy.uri(b, spec["name"]) == spec["uri"]
                    for name in set(names) - {s["name"] for s in loc["location_specs"]}:
                        with pytest.raises(KeyError):
                            lazy.uri(b, name)
                typed = c.get_cache_location(**params)
                assert len(typed.locations) == len(classic)
                assert msgspec.to_builtins(typed, enc_hook=compact.builtins)["locations"] == classic
                for b, loc in enumerate(classic):
                    for spec in loc["location_specs"]:
                        assert typed.uri(b, spec["name"]) == spec["uri"]
        finally:
            if disabled:
                c.call("enable_storage", {"storage_unique_name": disabled})


def test_a_compact_reply_is_smaller_and_carries_every_location(server: Any) -> None:
    with server.client() as c:
        register(c, "cl-size", group="cl-one")
        keys = list(range(1, 65))
        c.call("finish_write_cache", {"instance_id": "cl-size", "success_blocks": {"offset": 64}, "write_session_id":
                                      c.call("start_write_cache", {"instance_id": "cl-size",
                                                                   "block_keys": keys})["write_session_id"]})
        params = {"instance_id": "cl-size", "query_type": "prefix_match", "block_keys": keys}
        classic = c.call("get_cache_location", params)
        small = c.call("get_cache_location", {**params, "reply_format": "compact"})
        assert expand(small) == classic["locations"] and len(classic["locations"]) == 64
        classic_bytes, compact_bytes = len(msgpack.packb(classic)), len(msgpack.packb(small))
        assert compact_bytes * 5 < classic_bytes, (compact_bytes, classic_bytes)  # ~12 B a block, not ~200
        assert small["compact"][2] and len(small["compact"][2]) == 1  # one URI shape for the whole reply


def test_http_answers_classic_unless_asked_and_compact_json_when_asked(server: Any) -> None:
    with server.client() as c:
        register(c, "cl-http", group="cl-one")
        session = c.call("start_write_cache", {"instance_id": "cl-http", "block_keys": [1, 2, 3, 4]})
        c.call("finish_write_cache", {"instance_id": "cl-http", "write_session_id": session["write_session_id"],
                                      "success_blocks": {"offset": 4}})
    params = {"instance_id": "cl-http", "query_type": "prefix_match", "block_keys": [1, 2, 3, 4]}

    def post(body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/api/get_cache_location",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            reply: dict[str, Any] = json.loads(resp.read())["result"]
            return reply

    classic = post(params)
    assert set(classic) == {"locations"} and len(classic["locations"]) == 4
    assert expand(post({**params, "reply_format": "compact"})) == classic["locations"]


def test_an_unknown_reply_format_is_refused(server: Any) -> None:
    with server.client() as c:
        register(c, "cl-refuse", group="cl-one")
        with pytest.raises(Exception, match="reply_format"):
            c.call("get_cache_location", {"instance_id": "cl-refuse", "query_type": "prefix_match",
                                          "block_keys": [1], "reply_format": "tiny"})


def test_the_asyncio_client_reads_compact_replies(server: Any) -> None:
    with server.client() as c:
        register(c, "cl-aio", group="cl-two")
        session = c.call("start_write_cache", {"instance_id": "cl-aio", "block_keys": [1, 2, 3]})
        c.call("finish_write_cache", {"instance_id": "cl-aio", "write_session_id": session["write_session_id"],
                                      "success_blocks": {"offset": 3}})
        classic = c.call("get_cache_location", {"instance_id": "cl-aio", "query_type": "prefix_match",
                                                "block_keys": [1, 2, 3]})["locations"]

    async def run() -> Any:
        async with AsyncClient(server.endpoint, timeout=10) as kv:
            return await kv.get_cache_location(instance_id="cl-aio", query_type="prefix_match", block_keys=[1, 2, 3])
    got = asyncio.run(run())
    assert isinstance(got.locations, compact.LazyLocations)
    assert msgspec.to_builtins(list(got.locations)) == classic
    assert got.locations == msgspec.convert(classic, list[compact.Location])


# -- the codec alone: random URIs, verbatim ones, and a reader that refuses what it cannot read ---------------

URI_PARTS = st.lists(st.one_of(st.sampled_from(["file://", "/", "-", ".kv?blkid=", "&size=", "pace://p", "%"]),
                               st.integers(0, 2**70).map(str), st.integers(0, 2**64).map("{:x}".format),
                               st.text("ABCxyz_", max_size=4)), min_size=1, max_size=8).map("".join)


@settings(max_examples=200, deadline=None)
@given(locations=st.lists(st.tuples(st.sampled_from(["file", "shm", "pace"]),
                                    st.lists(URI_PARTS, min_size=1, max_size=3)), max_size=20),
       filtered=st.booleans())
def test_codec_round_trip(locations: list[tuple[str, list[str]]], filtered: bool) -> None:
    addrs, wires = [], []
    for kind, uris in locations:
        specs = [(f"s{i}", u) for i, u in enumerate(uris)]
        addr = addresses.address(kind, "st", 4096, specs)
        addrs.append(addr)
        wires.append(msgpack.unpackb(addresses.pack_wire(kind, specs)))
    names = ["s0"] if filtered else None
    reply = msgpack.unpackb(compact_reply(addrs, names))
    want = [{"type": w["type"], "spec_size": len(k), "location_specs": k}
            for w in wires for k in [[s for s in w["location_specs"] if not names or s["name"] in names]]]
    assert expand(reply) == want
    typed = decoder(CacheLocations).decode(msgpack.packb([1, 0, None, reply]))
    assert typed.result is not None and msgspec.to_builtins(list(typed.result.locations)) == want


def test_a_reply_of_another_version_is_refused_not_misread() -> None:
    raw = msgpack.packb([1, 0, None, {"compact": [2, 0, [], [], None]}])
    with pytest.raises(msgspec.ValidationError, match="version 2"):  # the client: ServerError "malformed reply"
        decoder(CacheLocations).decode(raw)


@pytest.mark.parametrize("entries", [[7], [[1, 2]], [7, [0, 1]], [8, [0]], [7, [0], 7, [1]]])
def test_inconsistent_entries_are_refused(entries: list[Any]) -> None:
    row = [7, "file", ["a"], ["x%d"], [1], [5]]
    raw = msgpack.packb([1, 0, None, {"compact": [1, 1, [row], entries, None]}])
    reply = decoder(CacheLocations).decode(raw).result
    assert reply is not None
    with pytest.raises(compact.CompactFormatError):
        list(reply.locations)


@pytest.mark.parametrize("keep", [["s0"], ["s1"], ["s0", "s1"], ["none"]])
def test_a_spec_filter_drops_the_integers_of_the_specs_it_drops(keep: list[str]) -> None:
    """Entries of one skeleton whose integers vary in every spec, filtered to some of them."""
    addrs, want = [], []
    for i in range(12):
        specs = [(f"s{j}", f"file://st/s4096/{j * 100 + i // 5:08d}.kv?blkid={i % 5}&size=4096") for j in range(2)]
        addrs.append(addresses.address("file", "st", 8192, specs))
        kept = [{"name": n, "uri": u} for n, u in specs if n in keep]
        want.append({"type": "file", "spec_size": len(kept), "location_specs": kept})
    reply = msgpack.unpackb(compact_reply(addrs, keep))
    assert len(reply["compact"][2]) == 1  # one skeleton: the test is about its columns
    assert expand(reply) == want
    typed = decoder(CacheLocations).decode(msgpack.packb([1, 0, None, reply])).result
    assert typed is not None and msgspec.to_builtins(list(typed.locations)) == want
