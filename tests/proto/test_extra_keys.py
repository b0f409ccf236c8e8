"""Extra keys are part of a block's identity (kvcm.proto.extra_keys, docs/engines.md "Keys"): vLLM's
derivation rule by hand-made golden vectors, the canonical form and its refusals, the key mixing
(plain prompts keep their keys), and through a real server with the fake vLLM publisher: pods
storing equal token ids with other images, salts or adapters are never matched for each other,
nor is a storage-tier write found by a lookup with other extra keys."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from kvcm import Client
from kvcm.cache.keys import ChainHasher, derive_keys, mix, token_ids_to_block_keys
from kvcm.engines.hashing import chain_states_mixed
from kvcm.errors import Code, InvalidArgument, KvcmError
from kvcm.proto.extra_keys import (
    MAX_BLOCK_BYTES,
    MAX_BLOCK_ITEMS,
    ExtraKeysError,
    MmFeature,
    canonical,
    derive,
    entry_digest,
    event_digests,
    request_extras,
)
from kvcm.proto.kv_events import BlockStored, encode_batch
from kvcm.testing import FakeEnginePublisher, RunningServer, serve_in_thread
from tests.helpers import wait_for

# --- vLLM's rule: golden vectors derived by hand ----------------------------------------------------
#
# generate_block_hash_extra_keys: for block [start, end) the extra keys are the LoRA name (every
# block), then (identifier, offset - start) for each multimodal input overlapping the block, then
# the salt (block 0 only, when not empty); None when there are none.


def test_an_image_across_a_block_boundary_two_images_in_one_block_salt_and_lora() -> None:
    # block size 16: A covers tokens 10..29 (blocks 0 and 1), B 33..36 and C 40..42 (both block 2)
    features = [MmFeature("A", 10, 20), MmFeature("B", 33, 4), MmFeature("C", 40, 3)]
    assert derive(4, 16, features) == [(("A", 10),), (("A", -6),), (("B", 1), ("C", 8)), None]
    assert derive(4, 16, features, lora_name="ad", cache_salt="s") == [
        ("ad", ("A", 10), "s"),  # lora first, then the image, the salt last
        ("ad", ("A", -6)),  # the image began 6 tokens before this block
        ("ad", ("B", 1), ("C", 8)),
        ("ad",),  # the adapter is on every block
    ]


def test_salt_on_block_zero_only_and_an_empty_salt_is_none() -> None:
    assert derive(3, 4, cache_salt="tenant-a") == [("tenant-a",), None, None]
    assert derive(3, 4, cache_salt="") == [None, None, None]
    assert derive(2, 4, lora_name="ad") == [("ad",), ("ad",)]


def test_inputs_ending_on_a_boundary_and_one_starting_where_another_ends() -> None:
    # X ends exactly at 32 (block 1 ends there): the next block starts with Y at its offset 0
    assert derive(6, 16, [MmFeature("X", 16, 16), MmFeature("Y", 32, 40)]) == [
        None, (("X", 0),), (("Y", 0),), (("Y", -16),), (("Y", -32),), None,
    ]  # fmt: skip
    # Z ends inside block 1 and W starts in it: both are in block 1, W then goes on to block 3
    assert derive(4, 16, [MmFeature("Z", 0, 20), MmFeature("W", 20, 30)]) == [
        (("Z", 0),), (("Z", -16), ("W", 4)), (("W", -12),), (("W", -28),),
    ]  # fmt: skip


def test_features_vllm_could_not_have_are_refused() -> None:
    for features, words in [
        ([MmFeature("A", 8, 4), MmFeature("B", 2, 2)], "sorted"),
        ([MmFeature("A", 0, 8), MmFeature("B", 4, 2)], "overlapping"),
        ([MmFeature("A", 10, 10)], "past the 16 token_ids"),
    ]:
        with pytest.raises(ExtraKeysError, match=words):
            request_extras(tokens=16, block_size=4, mm_features=features)
    with pytest.raises(msgspec.ValidationError):  # a negative offset never decodes
        msgspec.convert({"identifier": "A", "offset": -1, "length": 2}, MmFeature)


# --- the canonical form and the digest ---------------------------------------------------------------


def test_canonical_form_lists_and_tuples_alike_types_apart() -> None:
    assert canonical(["ad", ("img", -6)]) == canonical(("ad", ["img", -6]))
    assert canonical(None) is None and canonical([]) is None and entry_digest(()) is None
    digests = {entry_digest(v) for v in (["1"], [1], [True], [b"1"], [None], [[1]])}
    assert len(digests) == 6  # "1", 1, True, b"1", null and [1] are six different keys
    # pinned: the canonical bytes and the digest are part of stored keys, they never change
    assert canonical(["ad", ("img", -6)]) == b"\x92\xa2ad\x92\xa3img\xfa"
    assert entry_digest(["lora"]) == 6200689898503781640
    assert entry_digest(["salt", b"x", True, None, 7]) == -6337497174233217398


@pytest.mark.parametrize(("entry", "code", "words"), [
    ([1.5], Code.INVALID_ARGUMENT, "a float"),
    ([{"a": 1}], Code.INVALID_ARGUMENT, "a map"),
    ([[[[[1]]]]], Code.INVALID_ARGUMENT, "lists deep"),
    ([1 << 64], Code.INVALID_ARGUMENT, "64 bits"),
    ("lora", Code.INVALID_ARGUMENT, "are a list"),
    (["\ud800"], Code.INVALID_ARGUMENT, "cannot be encoded"),
    ([0] * MAX_BLOCK_ITEMS, Code.TOO_LARGE, "values"),
    (["x" * MAX_BLOCK_BYTES], Code.TOO_LARGE, "bytes"),
])  # fmt: skip
def test_what_has_no_canonical_form_or_is_too_big_is_refused(entry: Any, code: Code, words: str) -> None:
    with pytest.raises(ExtraKeysError, match=words) as exc:
        canonical(entry)
    assert exc.value.code == code


def test_request_forms_are_checked() -> None:
    with pytest.raises(ExtraKeysError, match="one form"):
        request_extras(tokens=8, block_size=4, extra_keys=[None, None], cache_salt="s")
    with pytest.raises(ExtraKeysError, match="make 2 blocks"):
        request_extras(tokens=8, block_size=4, extra_keys=[["a"]])
    assert request_extras(tokens=8, block_size=4, extra_keys=[None, None]) is None  # no block has any
    empty = request_extras(tokens=8, block_size=4, extra_keys=[None, []])  # an empty list is none either
    assert derive_keys(None, list(range(8)), 4, empty) == token_ids_to_block_keys(list(range(8)), 4)
    assert request_extras(tokens=8, block_size=4) is None
    assert event_digests([None, None], None, 2) is None and event_digests(None, None, 2) is None
    with pytest.raises(ExtraKeysError, match="3 entries for 2 blocks"):
        event_digests([None, None, None], None, 2)


def test_a_request_or_event_is_bounded_as_a_whole() -> None:
    wide = [["x" * 2000]] * 600  # each block under its bounds, 1.2 MB together
    with pytest.raises(ExtraKeysError, match="in one request or event") as exc:
        event_digests(wide, None, 600)
    assert exc.value.code == Code.TOO_LARGE
    many = [[0] * (MAX_BLOCK_ITEMS - 1)] * 600  # 76,800 values together
    with pytest.raises(ExtraKeysError, match="in one request or event"):
        event_digests(many, None, 600)
    extras = request_extras(tokens=600, block_size=1, extra_keys=many)
    assert extras is not None
    with pytest.raises(ExtraKeysError, match="in one request or event"):
        derive_keys(None, list(range(600)), 1, extras)


# --- keys ----------------------------------------------------------------------------------------


def _by_hand(tokens: list[int], size: int, digests: list[int | None]) -> list[int]:
    """The chained mix one token at a time, each block's digest mixed into its key."""
    state, keys = 0, []
    for b, d in enumerate(digests):
        for t in tokens[b * size : (b + 1) * size]:
            state = mix(state, t)
        if d is not None:
            state = mix(state, d)
        keys.append(state)
    return keys


def test_a_block_with_extra_keys_mixes_their_digest_and_plain_blocks_keep_their_keys() -> None:
    tokens = list(range(1, 13))
    plain = token_ids_to_block_keys(tokens, 4)
    assert derive_keys(None, tokens, 4, request_extras(tokens=12, block_size=4)) == plain
    img = entry_digest([("img", 2)])
    extras = request_extras(tokens=12, block_size=4, mm_features=[MmFeature("img", 6, 1)])
    keys = derive_keys(None, tokens, 4, extras)
    assert keys == _by_hand(tokens, 4, [None, img, None])
    assert keys[0] == plain[0] and keys[1] != plain[1] and keys[2] != plain[2]  # the chain goes on mixed
    lora = derive_keys(None, list(range(1, 9)), 4, request_extras(tokens=8, block_size=4, lora_name="lora"))
    assert lora == [291768609280654868, 4763039903431072391]  # pinned


def test_slices_and_the_engine_path_give_the_same_keys() -> None:
    tokens = [7] * 64 + list(range(200))  # 264 tokens: 33 blocks of 8
    features = [MmFeature("a", 3, 61), MmFeature("b", 100, 9), MmFeature("c", 120, 1)]
    whole = derive_keys(None, tokens, 8, request_extras(tokens=264, block_size=8, mm_features=features, cache_salt="s"))
    hasher = ChainHasher(8, extras=request_extras(tokens=264, block_size=8, mm_features=features, cache_salt="s"))
    for at in range(0, 264, 40):  # slices that end inside blocks
        hasher.feed(tokens[at : at + 40])
    assert hasher.keys == whole
    digests = [entry_digest(e) for e in derive(33, 8, features, cache_salt="s")]
    assert chain_states_mixed(0, tokens, 8, digests) == whole == _by_hand(tokens, 8, digests)


# --- through a real server ----------------------------------------------------------------------------

BS = 4
TOKENS = [1, 2] + [999] * 8 + [3, 4, 5, 6]  # an image's 8 placeholder tokens at offset 2: 3 blocks and 2 more tokens


def _image(name: str) -> list[Any]:
    """The extra keys vLLM sends for TOKENS with image ``name`` at offset 2 (by hand)."""
    return [((name, 2),), ((name, -2),), ((name, -6),)]


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with serve_in_thread() as srv, srv.client() as kv:
        kv.call("register_instance", {"instance_group": "default", "instance_id": "llm", "block_size": BS,
                                      "location_spec_infos": [{"name": "tp0", "size": 1024}]})  # fmt: skip
        yield srv


@pytest.fixture
def kv(server: RunningServer) -> Iterator[Client]:
    with server.client() as client:
        yield client
        for s in client.call("list_event_sources", {})["sources"]:
            client.call("remove_event_source", {"source_id": s["source_id"]})


@pytest.fixture
def pods(kv: Client) -> Iterator[tuple[FakeEnginePublisher, FakeEnginePublisher]]:
    with FakeEnginePublisher().start() as a, FakeEnginePublisher().start() as b:
        for name, pub in (("pod-a", a), ("pod-b", b)):
            kv.call("add_event_source", {"source_id": name, "instance_id": "llm", "endpoint": pub.endpoint,
                                         "replay_endpoint": pub.replay_endpoint})  # fmt: skip
        yield a, b


def _matched(kv: Client, tokens: list[int] = TOKENS, **extras: Any) -> dict[str, int]:
    reply = kv.call("match_engines", {"instance_id": "llm", "token_ids": tokens, **extras})
    return {s["source_id"]: s["matched_blocks"] for s in reply["sources"] if s["matched_blocks"]}


def test_two_images_same_tokens(kv: Client, pods: tuple[FakeEnginePublisher, FakeEnginePublisher]) -> None:
    a, b = pods
    a.store([11, 12, 13], TOKENS[:12], block_size=BS, extra_keys=_image("img-x"))
    b.store([21, 22, 23], TOKENS[:12], block_size=BS, extra_keys=_image("img-y"))
    assert wait_for(lambda: _matched(kv, extra_keys=_image("img-x")) == {"pod-a": 3})
    assert wait_for(lambda: _matched(kv, extra_keys=_image("img-y")) == {"pod-b": 3})
    assert _matched(kv) == {}  # the same token ids without the image: neither pod holds that prompt
    # the request-level form a router has at hand gives the same keys (vLLM's rule)
    assert _matched(kv, mm_features=[{"identifier": "img-x", "offset": 2, "length": 8}]) == {"pod-a": 3}
    assert _matched(kv, mm_features=[{"identifier": "img-y", "offset": 2, "length": 8}]) == {"pod-b": 3}
    assert _matched(kv, mm_features=[{"identifier": "img-x", "offset": 3, "length": 7}]) == {}  # another place
    typed = kv.match_engines(instance_id="llm", token_ids=TOKENS, mm_features=[MmFeature("img-x", 2, 8)])
    assert [(s.source_id, s.matched_blocks) for s in typed.sources] == [("pod-a", 3)]


def test_two_salts_same_tokens(kv: Client, pods: tuple[FakeEnginePublisher, FakeEnginePublisher]) -> None:
    a, b = pods
    tokens = list(range(40, 56))
    a.store([31, 32, 33, 34], tokens, block_size=BS, extra_keys=[("tenant-a",), None, None, None])
    b.store([41, 42, 43, 44], tokens, block_size=BS, extra_keys=[("tenant-b",), None, None, None])
    assert wait_for(lambda: _matched(kv, tokens, cache_salt="tenant-a") == {"pod-a": 4})
    assert wait_for(lambda: _matched(kv, tokens, cache_salt="tenant-b") == {"pod-b": 4})
    assert _matched(kv, tokens, extra_keys=[["tenant-b"], None, None, None]) == {"pod-b": 4}
    assert _matched(kv, tokens) == {} and _matched(kv, tokens, cache_salt="tenant-c") == {}


def test_two_adapters_and_an_engine_from_before_extra_keys(kv: Client, server: RunningServer) -> None:
    tokens = list(range(60, 72))
    with FakeEnginePublisher().start() as a, FakeEnginePublisher().start() as b, \
            FakeEnginePublisher().start() as old:  # fmt: skip
        for name, pub in (("pod-a", a), ("pod-b", b), ("pod-old", old)):
            kv.call("add_event_source", {"source_id": name, "instance_id": "llm", "endpoint": pub.endpoint,
                                         "replay_endpoint": pub.replay_endpoint})  # fmt: skip
        a.store([1, 2, 3], tokens, block_size=BS, lora_name="ad-a", extra_keys=[("ad-a",)] * 3)
        b.store([4, 5, 6], tokens, block_size=BS, lora_name="ad-b", extra_keys=[("ad-b",)] * 3)
        old.store([7, 8, 9], tokens, block_size=BS, lora_name="ad-a")  # lora_name only: [lora_name] per block
        assert wait_for(lambda: _matched(kv, tokens, lora_name="ad-a") == {"pod-a": 3, "pod-old": 3})
        assert wait_for(lambda: _matched(kv, tokens, lora_name="ad-b") == {"pod-b": 3})
        assert _matched(kv, tokens) == {}
        # per-block extra keys name the blocks; lora_name then only names the adapter's namespace
        assert _matched(kv, tokens, lora_name="ad-b", extra_keys=[["ad-b"]] * 3) == {"pod-b": 3}
        assert _matched(kv, tokens, lora_name="ad-b", extra_keys=[None] * 3) == {}


def test_a_storage_write_is_found_only_with_the_same_extra_keys(kv: Client) -> None:
    image = {"mm_features": [{"identifier": "img-x", "offset": 2, "length": 8}]}
    session = kv.call("start_write_cache", {"instance_id": "llm", "token_ids": TOKENS, **image})
    assert len(session["locations"]) == 3
    kv.call("finish_write_cache", {"instance_id": "llm", "write_session_id": session["write_session_id"],
                                   "success_blocks": {"offset": 3}})  # fmt: skip

    def found(**extras: Any) -> int:
        reply = kv.call("get_cache_location_len", {"instance_id": "llm", "query_type": "prefix_match",
                                                   "token_ids": TOKENS, **extras})  # fmt: skip
        return int(reply["cache_location_len"])

    assert found(**image) == 3
    assert found(extra_keys=_image("img-x")) == 3  # the per-block form of the same image
    assert found() == 0 and found(extra_keys=_image("img-y")) == 0
    assert found(mm_features=[{"identifier": "img-x", "offset": 2, "length": 8}], cache_salt="t") == 0
    located = kv.get_cache_location(instance_id="llm", query_type="prefix_match", token_ids=TOKENS,
                                    mm_features=[MmFeature("img-x", 2, 8)])  # fmt: skip
    assert len(located.locations) == 3
    # the same prompt with the other image is a new write: none of the blocks exists yet
    other = kv.start_write_cache(instance_id="llm", token_ids=TOKENS, extra_keys=_image("img-y"))
    assert len(other.locations) == 3


def test_bad_extra_keys_are_typed_errors_over_rpc(kv: Client) -> None:
    def refused(**params: Any) -> KvcmError:
        with pytest.raises(KvcmError) as exc:
            kv.call("match_engines", {"instance_id": "llm", "token_ids": TOKENS, **params})
        return exc.value

    assert refused(extra_keys=[[1.5], None, None]).code == Code.INVALID_ARGUMENT
    assert refused(extra_keys=[[{"a": 1}], None, None]).code == Code.INVALID_ARGUMENT
    assert refused(extra_keys=[[[[[["deep"]]]]], None, None]).code == Code.INVALID_ARGUMENT
    assert refused(extra_keys=[["x" * MAX_BLOCK_BYTES], None, None]).code == Code.TOO_LARGE
    assert "make 3 blocks" in refused(extra_keys=[None]).message
    assert "one form" in refused(extra_keys=[None] * 3, cache_salt="s").message
    assert "sorted" in refused(mm_features=[{"identifier": "a", "offset": 5, "length": 1},
                                            {"identifier": "b", "offset": 1, "length": 1}]).message  # fmt: skip
    with pytest.raises(InvalidArgument, match="block_keys are used as given"):
        kv.call("match_engines", {"instance_id": "llm", "block_keys": [1, 2], "cache_salt": "s"})
    with pytest.raises(InvalidArgument, match="block_keys are used as given"):
        kv.call("get_cache_location", {"instance_id": "llm", "query_type": "prefix_match", "block_keys": [1],
                                       "extra_keys": [None]})  # fmt: skip
    with pytest.raises(InvalidArgument, match="block_keys are used as given"):
        kv.call("note_routed", {"instance_id": "llm", "source_id": "x", "cache_salt": "s"})


def test_an_event_with_bad_extra_keys_is_counted_and_the_rest_applied(
    kv: Client, pods: tuple[FakeEnginePublisher, FakeEnginePublisher]
) -> None:
    a, _ = pods
    tokens = list(range(80, 88))
    a.publish([
        BlockStored([51, 52], None, tokens, BS, extra_keys=[[1.5], None]),  # a float: no canonical form
        BlockStored([53], None, tokens[:4], BS, extra_keys=[None, None]),  # two entries for one block
        BlockStored([54, 55], None, tokens, BS, extra_keys=[None, ("ok",)]),
    ])  # fmt: skip

    def counted() -> dict[str, int]:
        listed = next(s for s in kv.call("list_event_sources", {})["sources"] if s["source_id"] == "pod-a")
        return dict(listed["errors_by_kind"])

    assert wait_for(lambda: counted().get("bad_extra_keys") == 2)
    assert _matched(kv, tokens, extra_keys=[None, ["ok"]]) == {"pod-a": 2}
    assert _matched(kv, tokens) == {"pod-a": 1}  # its first block has no extra keys: the plain key


def test_extra_keys_need_the_instances_block_size(kv: Client, pods: tuple[FakeEnginePublisher, Any]) -> None:
    a, _ = pods
    tokens = list(range(90, 106))
    a.store([61, 62], tokens, block_size=8, extra_keys=[("img", 3), None])  # a digest kvcm cannot place
    a.store([63, 64], tokens, block_size=8, lora_name="ad", extra_keys=[("ad",), ("ad",)])  # an adapter alone: placed

    def counted() -> int:
        listed = next(s for s in kv.call("list_event_sources", {})["sources"] if s["source_id"] == "pod-a")
        return int(listed["errors_by_kind"].get("extra_keys_block_size", 0))

    assert wait_for(lambda: counted() == 1)
    assert wait_for(lambda: _matched(kv, tokens, lora_name="ad") == {"pod-a": 4})  # 2 engine blocks, 4 kvcm keys
    assert _matched(kv, tokens) == {}


def test_pushed_events_carry_extra_keys(kv: Client) -> None:
    kv.report_events(source_id="push-a", op="register", instance_id="llm")
    add = {"type": "add", "block_hashes": [1, 2, 3], "token_ids": TOKENS[:12], "block_size": BS,
           "extra_keys": _image("img-x")}  # fmt: skip
    done = kv.report_events(source_id="push-a", op="events", seq=0, events=[add])
    assert done.applied_blocks == 3
    assert _matched(kv, extra_keys=_image("img-x")) == {"push-a": 3} and _matched(kv) == {}
    payload = encode_batch([BlockStored([4, 5, 6], None, TOKENS[:12], BS, extra_keys=[[0.5], None, None])], 1.0)
    bad = kv.report_events(source_id="push-a", op="payloads", payloads=[{"seq": 1, "payload": payload}])
    assert bad.errors == {"bad_extra_keys": 1}
    with pytest.raises(InvalidArgument, match="keyed"):
        kv.report_events(source_id="push-a", op="events", events=[{"type": "add", "block_hashes": [9], "keyed": True,
                                                                    "extra_keys": [["x"]]}])  # fmt: skip


def test_the_http_side_port_takes_extra_keys(server: RunningServer, kv: Client,
                                             pods: tuple[FakeEnginePublisher, Any]) -> None:  # fmt: skip
    import json
    import urllib.request

    a, _ = pods
    a.store([71, 72, 73], TOKENS[:12], block_size=BS, extra_keys=_image("img-h"))
    assert wait_for(lambda: _matched(kv, extra_keys=_image("img-h")) == {"pod-a": 3})

    def post(body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/api/match_engines",
                                         data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=10) as reply:
            return dict(json.load(reply)["result"])

    body = {"instance_id": "llm", "token_ids": TOKENS,
            "mm_features": [{"identifier": "img-h", "offset": 2, "length": 8}]}  # fmt: skip
    assert [s["source_id"] for s in post(body)["sources"]] == ["pod-a"]
    assert post({"instance_id": "llm", "token_ids": TOKENS})["sources"] == []


def test_the_connectors_take_extra_keys(server: RunningServer) -> None:
    import asyncio

    from kvcm.aio_connector import AsyncConnector
    from kvcm.connector import Connector

    salt = {"cache_salt": "tenant-a", "lora_name": "ad"}
    with Connector(server.endpoint, instance_id="conn", block_size=BS, specs={"tp0": 64}) as kv:
        with kv.begin_write(TOKENS, **salt) as session:
            for block in session.new_blocks:
                block.write("tp0", bytes(64))
        assert kv.lookup(TOKENS, **salt).blocks == 3
        assert kv.lookup(TOKENS).blocks == 0 and kv.lookup(TOKENS, cache_salt="tenant-b", lora_name="ad").blocks == 0
        assert len(kv.read(TOKENS, **salt)) == 3 and kv.read(TOKENS, lora_name="ad") == []
        with pytest.raises(TypeError):
            kv.lookup(TOKENS, cache_sault="tenant-a")  # a misspelled field is never dropped silently

    async def lookups() -> tuple[int, int]:
        async with AsyncConnector(server.endpoint, instance_id="conn", block_size=BS) as akv:
            return (await akv.lookup(TOKENS, **salt)).blocks, (await akv.lookup(TOKENS)).blocks

    assert asyncio.run(lookups()) == (3, 0)


def test_pushed_extra_keys_are_paid_for_before_they_are_digested(kv: Client) -> None:
    kv.report_events(source_id="push-c", op="register", instance_id="llm")
    tokens = list(range(1000, 1000 + 1000 * BS))
    # valid extra keys (500 bytes a block, under every bound) whose checking the report must pay
    add = {"type": "add", "block_hashes": list(range(1, 1001)), "token_ids": tokens, "block_size": BS,
           "extra_keys": [["x" * 500]] * 1000}  # fmt: skip
    with pytest.raises(KvcmError, match="estimated") as exc:
        kv.report_events(source_id="push-c", op="events", seq=0, events=[add])
    assert exc.value.code == Code.TOO_LARGE
    small = {**add, "block_hashes": [1, 2], "token_ids": tokens[: 2 * BS], "extra_keys": [["x" * 500]] * 2}
    assert kv.report_events(source_id="push-c", op="events", seq=0, events=[small]).applied_blocks == 2


def test_tairs_routes_take_extra_keys(server: RunningServer) -> None:
    import json
    import urllib.request

    def tair(method: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/api/{method}",
                                         data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=10) as reply:
            data = dict(json.load(reply))
        assert data["header"]["status"]["code"] == "OK", data
        return data

    tokens = list(range(500, 512))
    started = tair("startWriteCache", {"instance_id": "llm", "token_ids": tokens, "cache_salt": "tenant-t"})
    tair("finishWriteCache", {"instance_id": "llm", "write_session_id": started["write_session_id"],
                              "success_blocks": {"offset": len(started["locations"])}})  # fmt: skip

    def found(**extras: Any) -> int:
        body = {"instance_id": "llm", "query_type": "QT_PREFIX_MATCH", "token_ids": tokens, **extras}
        return int(tair("getCacheLocationLen", body)["cache_location_len"])

    assert found(cache_salt="tenant-t") == 3
    assert found() == 0 and found(extra_keys=[["tenant-t"], None, None]) == 3


def test_routers_doc_image_example(server: RunningServer, kv: Client) -> None:
    """docs/routers.md's image-and-salt example, run as written against a real server and engines."""
    import pathlib
    import re

    page = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "routers.md").read_text()
    code = re.search(r"<!-- test: by tests/proto/test_extra_keys.py::test_routers_doc_image_example -->\n```python\n(.*?)```",
                     page, re.S)  # fmt: skip
    assert code, "the example block is gone from docs/routers.md"
    with FakeEnginePublisher().start() as a, FakeEnginePublisher().start() as b, \
            FakeEnginePublisher().start() as c:  # fmt: skip
        for name, pub in (("pod-a", a), ("pod-b", b), ("pod-c", c)):
            kv.call("add_event_source", {"source_id": name, "instance_id": "llm", "endpoint": pub.endpoint,
                                         "replay_endpoint": pub.replay_endpoint})  # fmt: skip
        # vLLM's entries for TOKENS with the image at offset 2 and the tenant's salt (by hand)
        a.store(
            [1, 2, 3],
            TOKENS[:12],
            block_size=BS,
            extra_keys=[(("img-x", 2), "tenant-a"), (("img-x", -2),), (("img-x", -6),)],
        )
        b.store(
            [4, 5, 6],
            TOKENS[:12],
            block_size=BS,
            extra_keys=[(("img-y", 2), "tenant-a"), (("img-y", -2),), (("img-y", -6),)],
        )
        c.store(
            [7, 8, 9],
            TOKENS[:12],
            block_size=BS,
            extra_keys=[(("img-x", 2), "tenant-b"), (("img-x", -2),), (("img-x", -6),)],
        )
        assert wait_for(
            lambda: (
                len(kv.call("list_event_sources", {})["sources"]) == 3
                and all(s["blocks_held"] == 3 for s in kv.call("list_event_sources", {})["sources"])
            )
        )
        scope = {"endpoint": server.endpoint, "prompt_token_ids": TOKENS, "image_hash": "img-x", "image_offset": 2,
                 "image_tokens": 8, "tenant_salt": "tenant-a"}  # fmt: skip
        exec(compile(code.group(1), "docs/routers.md", "exec"), scope)
        assert scope["engine"] == "pod-a" and scope["reply"].sources[0].matched_blocks == 3
        assert [s.source_id for s in scope["reply"].sources] == ["pod-a"]  # pod-b: other image, pod-c: other salt


class _Work(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    micros: float = 0.0
    tag: str = ""
    block_keys: list[int] = []
    token_ids: list[int] = []
    cache_salt: str | None = None


def test_a_request_carried_after_its_keys_are_derived_is_not_refused_for_them() -> None:
    """The dispatcher asks the tokens hook until the keys are derived, never after: a request
    carried to the next turn for the budget has block_keys then, and its extra keys must not be
    taken for extra keys sent with block_keys."""
    from kvcm.api.token_keys import TokenWork, hash_tokens
    from kvcm.proto import wire
    from kvcm.proto.extra_keys import check_request
    from kvcm.rpc.dispatch import Dispatcher, Estimate, Limits, Method

    def tokens(r: _Work) -> TokenWork | None:
        check_request(bool(r.token_ids) and not r.block_keys, None, None, r.cache_salt)
        if r.block_keys or not r.token_ids:
            return None
        extras = request_extras(tokens=len(r.token_ids), block_size=4, cache_salt=r.cache_salt)
        return TokenWork(r.token_ids, 4, lambda keys: setattr(r, "block_keys", keys), extras)

    method = Method("work", lambda r: {"keys": r.block_keys}, _Work, cost=lambda r: Estimate(r.micros), prepare=hash_tokens(tokens))
    d = Dispatcher([method], limits=Limits(turn_budget_ms=10))
    params = {"micros": 8000, "token_ids": TOKENS[:12], "cache_salt": "s"}
    replies = d.serve([(t, peer, wire.pack_request(i, "work", {**params, "tag": t}))
                       for i, (t, peer) in enumerate((("h1", b"A"), ("h2", b"B")), 1)])  # fmt: skip
    assert [t for t, _ in replies] == ["h1"]  # h2 waits for the next turn, its keys already derived
    ((tag, reply),) = d.serve([])
    _, err, result = wire.parse_response(reply)
    assert tag == "h2" and err is None
    assert result["keys"] == derive_keys(None, TOKENS[:12], 4, request_extras(tokens=12, block_size=4, cache_salt="s"))


def test_the_compiled_hash_mixes_extra_keys_alike() -> None:
    """With the kernel loaded (``server.hash_kernel = "numba"``), the runs between blocks with
    extra keys take it: the keys are the Python ones, wherever the slices fall."""
    import random

    from kvcm.cache import hash_kernel as kernel  # numba is a core dependency
    from kvcm.cache import keys
    rng = random.Random(5)
    tokens = [rng.randrange(1 << 32) for _ in range(4000)]  # 250 blocks of 16
    features = [MmFeature("a", 300, 700), MmFeature("b", 2000, 5), MmFeature("c", 3990, 10)]

    def extras() -> Any:
        return request_extras(tokens=4000, block_size=16, mm_features=features, cache_salt="s")

    keys.set_native(None)
    expected = derive_keys(None, tokens, 16, extras())
    digests = [entry_digest(e) for e in derive(250, 16, features, cache_salt="s")]
    assert expected == _by_hand(tokens, 16, digests)
    try:
        kernel.load()
        assert derive_keys(None, tokens, 16, extras()) == expected
        hasher, at = ChainHasher(16, extras=extras()), 0
        for n in (300, 1, 1500, 999):
            hasher.feed(tokens[at : at + n])
            at += n
        hasher.feed(tokens[at:])
        assert hasher.keys == expected
        assert chain_states_mixed(0, tokens, 16, digests) == expected
    finally:
        keys.set_native(None)


def test_packed_token_ids_with_extra_keys_and_a_drain_of_many_stores() -> None:
    """The subscriber's fast forms: token ids left packed (the kernel's decode) and a drain
    hashed together (SWAR); a store with extra keys is hashed alone, its children continue
    from its mixed key, and plain stores around it keep the vectorised path."""
    from kvcm.engines.index import EngineIndex
    from kvcm.engines.sources import SourceSpec
    from kvcm.proto.kv_events import DecodedBatch, decode_batch

    tokens = list(range(3000, 3048))  # 12 blocks of 4
    image = [None, (("img", 1),), (("img", -3),), None]
    events = [
        BlockStored([1, 2, 3, 4], None, tokens[:16], BS, extra_keys=image),
        BlockStored([5, 6], 4, tokens[16:24], BS),  # a plain child of the store with extra keys
        BlockStored([9, 10], None, tokens[24:32], BS),  # an unrelated plain store
        BlockStored([11, 12], 10, tokens[32:40], BS),
    ]
    payload = encode_batch(events, 1.0)
    expected = derive_keys(
        None, tokens[:24], BS, request_extras(tokens=24, block_size=BS, extra_keys=image + [None] * 2)
    )
    for packed in (False, True):
        index = EngineIndex(None, lambda _: BS)
        gen = index.add_source(SourceSpec("a", "inst", "tcp://h:1")).generation
        other = index.add_source(SourceSpec("b", "inst", "tcp://h:2")).generation
        batch = decode_batch(payload, packed_tokens=packed)
        index.apply_many([("a", gen, 0, batch), ("b", other, 0, DecodedBatch(1.0, events[2:]))])
        (found,) = index.match("inst", expected)
        assert found.source_id == "a" and found.matched_blocks == 6, packed
        # without the image only block 0 (before it) is the same block
        assert [m.matched_blocks for m in index.match("inst", token_ids_to_block_keys(tokens[:24], BS))] == [1]
        plain = token_ids_to_block_keys(tokens[24:40], BS)
        assert {m.source_id: m.matched_blocks for m in index.match("inst", plain)} == {"a": 4, "b": 4}
