"""Costs per kind of query (kvcm/api/costs.py): a long prompt's length-only prefix match and its
engine match are answered, a full-location lookup that large is refused with a key count that is
then answered, and a request by token ids that its keys would make too large is refused before
any hashing. Over a real socket to a real kvcm; the figures themselves are bench_hostile's."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

from kvcm.api.costs import US_PER_KEY
from kvcm.cache.keys import token_ids_to_block_keys
from kvcm.errors import Code, KvcmError
from kvcm.testing import serve_in_subprocess, serve_in_thread
from tests.helpers import add_file_storage, add_group, register

LONG = 100_000
ONE_SPEC = [{"name": "tp0", "size": 1024}]


def refusal(c: Any, method: str, params: dict[str, Any]) -> KvcmError:
    with pytest.raises(KvcmError) as info:
        c.call(method, params, retry=False)
    return info.value


def fits(error: KvcmError) -> int:
    """The key count a TOO_LARGE refusal names."""
    assert error.code is Code.TOO_LARGE, error
    found = re.search(r"send at most (\d+) keys per request", error.message)
    assert found, error.message
    return int(found.group(1))


def write(c: Any, instance: str, keys: list[int]) -> None:
    """``keys`` written and served, in as many sessions as the write estimate needs."""
    done = 0
    while done < len(keys):
        part = keys[done : done + 20_000]
        try:
            session = c.call("start_write_cache", {"instance_id": instance, "block_keys": part}, retry=False)
        except KvcmError as exc:
            part = part[: fits(exc)]
            session = c.call("start_write_cache", {"instance_id": instance, "block_keys": part}, retry=False)
        c.call("finish_write_cache", {"instance_id": instance, "write_session_id": session["write_session_id"],
                                      "success_blocks": {"offset": len(part)}})  # fmt: skip
        done += len(part)


def report(c: Any, source: str, keys: list[int]) -> None:
    """A push source holding ``keys`` (keyed adds), resent when its work budget asks to wait."""
    c.call("report_events", {"source_id": source, "op": "register", "instance_id": "long"})
    for lo in range(0, len(keys), 10_000):
        params = {"source_id": source, "op": "events",
                  "events": [{"type": "add", "keyed": True, "block_hashes": keys[lo : lo + 10_000]}]}  # fmt: skip
        while True:
            try:
                c.call("report_events", params, retry=False)
                break
            except KvcmError as exc:
                if exc.code is not Code.RATE_LIMITED:
                    raise
                time.sleep(int(exc.detail["retry_after_ms"]) / 1000)  # pacing: the server says when


@pytest.fixture(scope="module")
def long_server():
    """A 100,000-block chain in the storage tier (one spec), the first 60,000 blocks in storage;
    one push source holding the whole chain and one holding its first 40,000 blocks."""
    overrides = {"reclaim": {"enabled": False}, "events": {"push_budget_ms_per_s": 1000.0}}
    with serve_in_thread(overrides=overrides) as server, server.client(timeout=60) as c:
        register(c, "long", block_size=16, specs=ONE_SPEC)
        chain = token_ids_to_block_keys(list(range(LONG * 16)), 16)
        write(c, "long", chain[:60_000])
        report(c, "long/a", chain)
        report(c, "long/b", chain[:40_000])
        yield server, chain


def test_a_100k_key_length_only_prefix_match_is_answered(long_server):
    server, chain = long_server
    with server.client(timeout=60) as c:
        reply = c.call("get_cache_location_len", {"instance_id": "long", "query_type": "prefix_match",
                                                  "block_keys": chain}, retry=False)  # fmt: skip
        assert reply == {"cache_location_len": 60_000}
        # a walk that ends at its first key is answered as well (nothing past it is read)
        missing = [chain[0] ^ 1, *chain[1:]]
        assert c.call("get_cache_location_len", {"instance_id": "long", "query_type": "prefix_match",
                                                 "block_keys": missing}) == {"cache_location_len": 0}  # fmt: skip


def test_a_100k_key_match_engines_is_answered(long_server):
    server, chain = long_server
    with server.client(timeout=60) as c:
        reply = c.call("match_engines", {"instance_id": "long", "block_keys": chain}, retry=False)
    matched = {s["source_id"]: s["matched_blocks"] for s in reply["sources"]}
    assert matched == {"long/a": LONG, "long/b": 40_000} and reply["num_blocks"] == LONG


def test_a_full_location_lookup_too_large_is_refused_with_a_count_that_is_answered(long_server):
    server, chain = long_server
    with server.client(timeout=60) as c:
        error = refusal(c, "get_cache_location", {"instance_id": "long", "query_type": "prefix_match",
                                                  "block_keys": chain})  # fmt: skip
        assert "server.turn_budget_ms" in error.message
        n = fits(error)
        assert n == int(50_000 / US_PER_KEY["prefix_match"])  # the default budget at the table's rate
        reply = c.call("get_cache_location", {"instance_id": "long", "query_type": "prefix_match",
                                              "block_keys": chain[:n]}, retry=False)  # fmt: skip
        assert len(reply["locations"]) == n
        # one more key than named is refused again: the count is the most that fits
        assert refusal(c, "get_cache_location", {"instance_id": "long", "query_type": "prefix_match",
                                                 "block_keys": chain[: n + 1]}).code is Code.TOO_LARGE  # fmt: skip


def test_get_host_cache_state_counts_the_storage_prefix_by_its_length(long_server):
    """Tair's host state asks the storage tier for a length: costed as one, and refused past
    what fits with a count that is then answered."""
    server, chain = long_server
    with server.client(timeout=60) as c:
        error = refusal(c, "get_host_cache_state", {"instance_id": "long", "block_keys": chain})
        n = fits(error)
        assert n == int(50_000 / (US_PER_KEY["match_engines"] + US_PER_KEY["prefix_match_len"]))
        reply = c.call("get_host_cache_state", {"instance_id": "long", "block_keys": chain[:n]}, retry=False)
        assert reply["storage"] == n and reply["global"] == n
        alone = c.call("get_host_cache_state", {"instance_id": "long", "block_keys": chain, "include_storage": False})
        assert alone["global"] == LONG and alone["storage"] == 0


def test_estimates_follow_the_kind_of_query(long_server):
    """The same keys cost the length-only walk, the full reply and the engine tier at their own
    rates from the one table."""
    server, chain = long_server
    methods = server.app.dispatcher.methods
    keys = chain[:1000]

    def cost(method: str, **params: Any) -> float:
        import msgspec

        request = msgspec.convert({"instance_id": "long", "block_keys": keys, **params}, methods[method].request)
        return methods[method].cost(request).micros

    assert cost("get_cache_location", query_type="prefix_match") == 1000 * US_PER_KEY["prefix_match"]
    assert cost("get_cache_location_len", query_type="prefix_match") == 1000 * US_PER_KEY["prefix_match_len"]
    assert cost("get_cache_location_len", query_type="batch_get") == 1000 * US_PER_KEY["batch_get"]
    assert cost("match_engines") == pytest.approx(1000 * US_PER_KEY["match_engines"])
    assert cost("match_engines", include_storage=True) == pytest.approx(
        1000 * (US_PER_KEY["match_engines"] + US_PER_KEY["storage_prefix"])
    )
    assert cost("get_host_cache_state") == pytest.approx(
        1000 * (US_PER_KEY["match_engines"] + US_PER_KEY["prefix_match_len"])
    )
    assert cost("get_cache_location", query_type="prefix_match", include_engines=True) == pytest.approx(
        1000 * (US_PER_KEY["prefix_match"] + 2 * US_PER_KEY["engine_location"])
    )  # two sources followed


def test_a_request_by_tokens_too_large_is_refused_before_hashing():
    """524,288 token ids (32,768 keys) for full locations: refused from the key count alone, no
    hashing carried over turns; the token count the refusal names is answered."""
    with serve_in_thread(overrides={"reclaim": {"enabled": False}}) as server, server.client(timeout=60) as c:
        register(c, "tok", block_size=16, specs=ONE_SPEC)
        tokens = list(range(1, 524_289))

        def carried() -> float:
            sample = server.app.metrics.registry.get_sample_value("kvcm_rpc_carried_total", {"reason": "hashing"})
            return sample or 0.0

        before = carried()
        error = refusal(c, "get_cache_location", {"instance_id": "tok", "query_type": "prefix_match",
                                                  "token_ids": tokens})  # fmt: skip
        n = fits(error)
        assert f"({n * 16} token_ids)" in error.message and carried() == before  # nothing was hashed
        keys = token_ids_to_block_keys(tokens[: n * 16], 16)
        write(c, "tok", keys[:10])
        reply = c.call("get_cache_location", {"instance_id": "tok", "query_type": "prefix_match",
                                              "token_ids": tokens[: n * 16]}, retry=False)  # fmt: skip
        assert len(reply["locations"]) == 10
        # the length alone of the whole prompt is cheap enough: hashed over turns, answered
        assert c.call("get_cache_location_len", {"instance_id": "tok", "query_type": "prefix_match",
                                                 "token_ids": tokens}) == {"cache_location_len": 10}  # fmt: skip
        assert carried() > before


def test_a_refusals_count_leaves_room_for_the_requests_fixed_cost():
    """Pins cost per key and per pin already held: the count named leaves room for the held ones
    (a count from the budget alone would be refused again)."""
    overrides = {"cache": {"max_pins_per_instance": 64}, "server": {"turn_budget_ms": 0.1}}
    with serve_in_thread(overrides=overrides) as server, server.client() as c:
        register(c, "i")
        assert (
            c.call("pin_cache", {"instance_id": "i", "block_keys": list(range(20)), "ttl_seconds": 5})["pinned"] == 20
        )
        error = refusal(c, "pin_cache", {"instance_id": "i", "block_keys": list(range(100, 130)), "ttl_seconds": 5})
        n = fits(error)
        assert n < int(100 / US_PER_KEY["pin_cache"])  # fewer than the budget alone allows
        assert c.call("pin_cache", {"instance_id": "i", "block_keys": list(range(100, 100 + n)),
                                    "ttl_seconds": 5})["pinned"] == n  # fmt: skip


def test_a_refusals_count_keeps_the_reply_within_max_reply_bytes():
    """A refusal by the reply's size names the keys whose reply fits, and they are answered."""
    with serve_in_thread(overrides={"server": {"max_reply_bytes": 8192}}) as server, server.client() as c:
        register(c)  # two specs: at least 192 reply bytes a key
        error = refusal(c, "get_cache_location", {"instance_id": "inst", "block_keys": list(range(200)),
                                                  "query_type": "batch_get"})  # fmt: skip
        assert "server.max_reply_bytes" in error.message
        n = fits(error)
        assert 0 < n <= 8192 // 192
        reply = c.call("get_cache_location", {"instance_id": "inst", "block_keys": list(range(n)),
                                              "query_type": "batch_get"})  # fmt: skip
        assert len(reply["locations"]) == n


@pytest.mark.parametrize("hole", [5, 255, 256, 700, 3000])
def test_a_prefix_walk_stops_at_the_first_missing_block(hole):
    """The walk reads its keys in slices (256, then twice as many each time): a missing block
    anywhere, at a slice's edge too, ends the prefix there, whatever is stored after it."""
    overrides = {"reclaim": {"enabled": False}, "cache": {"runs": False}}  # block by block: no run record helps
    with serve_in_thread(overrides=overrides) as server, server.client(timeout=30) as c:
        register(c, "w", block_size=16, specs=ONE_SPEC)
        chain = token_ids_to_block_keys(list(range(4000 * 16)), 16)
        write(c, "w", chain[:hole])
        write(c, "w", chain[hole + 1 :])
        query = {"instance_id": "w", "query_type": "prefix_match", "block_keys": chain}
        assert c.call("get_cache_location_len", query) == {"cache_location_len": hole}
        assert len(c.call("get_cache_location", {**query, "block_keys": chain[:5000]})["locations"]) == hole


@pytest.mark.parametrize("runs", [True, False])
def test_the_length_alone_counts_only_copies_a_reader_may_use(tmp_path, runs):
    """Counting without building locations still skips copies on a disabled storage: the length
    is what the full reply holds."""
    overrides = {"reclaim": {"enabled": False}, "cache": {"runs": runs}}
    with serve_in_thread(overrides=overrides) as server, server.client() as c:
        add_file_storage(c, "first", tmp_path / "first")
        add_file_storage(c, "second", tmp_path / "second")
        add_group(c, "tiers", ["first", "second"])
        register(c, "t", group="tiers")
        keys = list(range(1, 11))
        write(c, "t", keys)  # on "first"
        c.call("disable_storage", {"storage_unique_name": "first"})
        write(c, "t", keys[5:])  # second copies of 6..10, on "second"
        query = {"instance_id": "t", "query_type": "prefix_match"}
        for wanted, expected in ((keys, 0), (keys[:5], 0), (keys[5:], 5), ([*keys[5:], 1], 5)):
            full = c.call("get_cache_location", {**query, "block_keys": wanted})["locations"]
            length = c.call("get_cache_location_len", {**query, "block_keys": wanted})["cache_location_len"]
            assert length == len(full) == expected, (wanted, length, len(full))


def test_requests_are_packed_as_msgpack_packs_them():
    """The client packs requests with msgspec (a long prompt's keys in a quarter of the time):
    byte for byte what msgpack's packer made, and the same errors for what cannot be sent."""
    import msgpack

    from kvcm.proto import wire

    params = {"block_keys": [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32, 2**63 - 1, -1, -33, -(2**63), 2**64 - 1],
              "token_ids": list(range(0, 200_000, 997)), "name": "é" * 40, "raw": b"\x00\xff" * 20, "ratio": 0.25,
              "flag": True, "none": None, "nested": {"a": [{"b": 1.5}], "c": []}}  # fmt: skip
    assert wire.pack_request(7, "match_engines", params) == msgpack.packb([0, 7, "match_engines", [params]],
                                                                          use_bin_type=True)  # fmt: skip
    assert wire.pack_notification("n", params) == msgpack.packb([2, "n", [params]], use_bin_type=True)
    for bad, kind in ((2**64, OverflowError), (object(), TypeError)):
        with pytest.raises(kind):
            wire.pack_request(1, "m", {"x": bad})


def test_responses_are_decoded_as_msgpack_decodes_them():
    """The client decodes replies with msgspec: the same values as msgpack's unpacker, and any
    malformed reply is a BadEnvelope."""
    import msgpack

    from kvcm.proto import wire

    result = {"sources": [{"source_id": f"s{i}", "matched_blocks": i, "score": i / 3, "media": {"GPU": i}}
                          for i in range(100)], "raw": b"\x00\x01", "none": None, "neg": -(2**63), "big": 2**64 - 1}  # fmt: skip
    reply = msgpack.packb([1, 9, None, result], use_bin_type=True)
    assert wire.parse_response(reply) == (9, None, msgpack.unpackb(reply)[3])
    bad = [reply[:-3], reply + b"\x00", msgpack.packb([1, 9, None, msgpack.ExtType(5, b"x")]), b"\x91" * 100_000 + b"\xc0",
           msgpack.packb([0, 9, "m", []]), b"\xc1"]  # fmt: skip
    for payload in bad:
        with pytest.raises(wire.BadEnvelope):
            wire.parse_response(payload)


def test_a_long_prompts_hashing_is_sliced_so_other_clients_are_answered_meanwhile():
    """A length-only lookup by 524,288 token ids is hashed a slice per turn (about half a
    millisecond of hashing), not the whole turn budget: a client sending small requests one after another
    meanwhile gets many answers before the long one is answered (each turn's replies go out when
    it ends). Counted in requests, not timed: a machine ten times faster still has room."""
    import msgpack
    import zmq

    # a server of its own process: in this one, the test's client would share its interpreter
    with serve_in_subprocess() as server, server.client() as c:
        c.call("register_instance", {"instance_group": "default", "instance_id": "long", "block_size": 16,
                                     "location_spec_infos": [{"name": "tp0", "size": 4096}]})  # fmt: skip
        ctx = zmq.Context.instance()
        long_client, small_client = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        try:
            for sock in (long_client, small_client):
                sock.connect(server.endpoint)
            tokens = list(range(1, 524_288 + 1))
            long_client.send(msgpack.packb([0, 1, "get_cache_location_len", [
                {"instance_id": "long", "query_type": "prefix_match", "token_ids": tokens}]]))  # fmt: skip
            answered = 0
            while not long_client.poll(0):
                small_client.send(msgpack.packb([0, 2, "check_health", [{}]]))
                assert small_client.poll(30_000), "a small request was never answered"
                assert msgpack.unpackb(small_client.recv())[2] is None
                answered += 1
            reply = msgpack.unpackb(long_client.recv())
            assert reply[2] is None and reply[3]["cache_location_len"] == 0, reply
            assert answered >= 20, answered  # about 130 here; 5 when a turn hashes its whole budget
        finally:
            long_client.close(0)
            small_client.close(0)
