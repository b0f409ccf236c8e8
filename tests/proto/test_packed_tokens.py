"""Token ids kept packed (``decode_batch(..., packed_tokens=True)``, used when the compiled hash is
loaded): the kernel's msgpack reader, the same events and keys as the list form, and stores whose
token ids are not ids refused as broken events without touching the rest of their drain."""

from __future__ import annotations

import random
import struct
import threading
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcm.backends.metastore import MemoryStore
from kvcm.cache import hash_kernel as kernel
from kvcm.cache import keys
from kvcm.cache.keys import token_ids_to_block_keys
from kvcm.engines.service import EngineService
from kvcm.engines.sources import SourceSpec
from kvcm.proto.kv_events import (
    BAD_EVENT,
    ENCODINGS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    PackedTokens,
    decode_batch,
    encode_batch,
)
from kvcm.testing import FakeEnginePublisher, serve_in_thread
from tests.helpers import register


@pytest.fixture
def python_only() -> Iterator[None]:
    """The Python forms while the test runs, and after it (the kernel is process-wide)."""
    keys.set_native(None)
    yield
    keys.set_native(None)


def unpack(data: bytes, room: int = 64) -> list[int] | None:
    out = np.zeros(room, dtype=np.uint32)
    n = kernel._unpack(np.frombuffer(data, dtype=np.uint8), out, kernel._WIDTHS)
    return None if n < 0 else out[:n].tolist()


# --- the kernel's msgpack reader --------------------------------------------------------------

# every form msgpack has for an int: what the reader gives (None: it declines the buffer)
INT_FORMS = [
    (b"\x00", 0), (b"\x7f", 127),
    (b"\xcc\xff", 255), (b"\xcd\x01\x00", 256), (b"\xcd\xff\xff", 65535),
    (b"\xce\x00\x01\x00\x00", 65536), (b"\xce\xff\xff\xff\xff", (1 << 32) - 1),
    (b"\xcf" + struct.pack(">Q", 7), 7), (b"\xcf" + struct.pack(">Q", (1 << 32) - 1), (1 << 32) - 1),
    (b"\xcf" + struct.pack(">Q", 1 << 32), None), (b"\xcf" + struct.pack(">Q", (1 << 64) - 1), None),
    (b"\xd0\x05", 5), (b"\xd0\xff", None), (b"\xd1\x7f\xff", 32767), (b"\xd1\x80\x00", None),
    (b"\xd2\x7f\xff\xff\xff", (1 << 31) - 1), (b"\xd2\xff\xff\xff\xff", None),
    (b"\xd3" + struct.pack(">q", 9), 9), (b"\xd3" + struct.pack(">q", (1 << 32) - 1), (1 << 32) - 1),
    (b"\xd3" + struct.pack(">q", 1 << 32), None), (b"\xd3" + struct.pack(">q", -1), None),
    (b"\xff", None), (b"\xe0", None),  # negative fixints
    (b"\xca" + struct.pack(">f", 1.0), None), (b"\xa1x", None), (b"\xc0", None), (b"\xc3", None),  # float, str, nil, bool
    (b"\x91\x01", None),  # an array inside
]  # fmt: skip


@pytest.mark.parametrize(("form", "value"), INT_FORMS)
def test_every_int_form_is_read_or_declined(form: bytes, value: int | None) -> None:
    # alone (the array's end is the buffer's: the careful path), and followed by more ids (the fast one)
    assert unpack(b"\x91" + form) == (None if value is None else [value])
    assert unpack(b"\x93" + form + b"\x01\xce\x00\x00\x01\x00") == (None if value is None else [value, 1, 256])


@pytest.mark.parametrize("form", [form for form, value in INT_FORMS if value is not None and len(form) > 1])
def test_a_cut_id_is_declined(form: bytes) -> None:
    assert unpack(b"\x91" + form[:-1]) is None


def test_array_headers_and_consecutive_arrays() -> None:
    ids = list(range(300))
    assert unpack(msgspec.msgpack.encode(ids), 300) == ids  # array16
    assert unpack(b"\xdd\x00\x00\x00\x02\x05\x06") == [5, 6]  # array32
    assert unpack(b"\x92\x01\x02\x90\x91\x03") == [1, 2, 3]  # arrays one after another, one empty
    assert unpack(b"") == []
    assert unpack(b"\x92\x01") is None  # fewer ids than the header says
    assert unpack(b"\x91\x01\x05") is None  # bytes after the last array that are no array
    assert unpack(b"\xdc\x00") is None and unpack(b"\xdd\x00\x00") is None  # cut headers
    assert unpack(b"\x01") is None and unpack(b"\x80") is None  # an int, a map: no array at all
    assert unpack(b"\x93\x01\x02\x03", room=2) is None  # more ids than the buffer takes


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, (1 << 32) - 1), max_size=200))
def test_the_reader_gives_the_ids_msgspec_wrote(ids: list[int]) -> None:
    assert unpack(msgspec.msgpack.encode(ids), len(ids)) == ids


# --- PackedTokens and the packed decode -------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(ENCODINGS), st.lists(st.integers(0, (1 << 64) - 1), max_size=40), st.integers(0, 100))
def test_a_packed_decode_is_the_list_decode(encoding: str, tokens: list[int], group: int) -> None:
    events = [BlockStored([1, 2], 7, tokens, 16, None, "GPU", None, None, group), BlockRemoved([3], "CPU"),
              AllBlocksCleared(), BlockStored([b"\x01" * 32], None, tokens[:3], 1)]  # fmt: skip
    payload = encode_batch(events, 1.5, 2, encoding)
    plain, packed = decode_batch(payload), decode_batch(payload, packed_tokens=True)
    assert type(packed.events[0].token_ids) is PackedTokens  # type: ignore[union-attr]
    assert packed.events == plain.events and packed.errors == plain.errors == []
    assert (packed.ts, packed.data_parallel_rank, packed.shape) == (plain.ts, plain.data_parallel_rank, plain.shape)
    stored = packed.events[0]
    assert isinstance(stored, BlockStored)
    assert len(stored.token_ids) == len(tokens) and list(stored.token_ids) == tokens and stored.token_ids[:2] == tokens[:2]
    assert encode_batch(packed.events, 1.5, 2, encoding) == payload  # re-encoded as they came


def test_packed_tokens_join_compare_and_encode() -> None:
    a = PackedTokens.of(msgspec.msgpack.encode([1, 2]))
    b = PackedTokens.of(msgspec.msgpack.encode(list(range(20))))
    both = a.joined(b)
    assert len(both) == 22 and both == [1, 2, *range(20)] and both != [1, 2] and list(both) == both.ids
    assert both == PackedTokens.of(msgspec.msgpack.encode([1, 2, *range(20)]))
    for tokens in (a, both):  # one array as it came, several as their ids
        again = decode_batch(encode_batch([BlockStored([1], None, tokens, 1)], 1.0)).events[0]
        assert again.token_ids == tokens.ids  # type: ignore[union-attr]
    assert "22 ids" in repr(both)
    with pytest.raises(ValueError):
        PackedTokens.of(b"\x01")
    with pytest.raises(TypeError):
        hash(a)


def test_packed_ids_that_are_not_ids_raise_when_read() -> None:
    payload = encode_batch([BlockStored([1], None, [1, "x"], 2)], 1.0)  # type: ignore[list-item]
    batch = decode_batch(payload, packed_tokens=True)
    tokens = batch.events[0].token_ids  # type: ignore[union-attr]
    assert len(tokens) == 2
    with pytest.raises(EventDecodeError):
        list(tokens)
    assert kernel.states_many([0], [tokens], 2) is None  # the kernel declines them


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_token_ids_that_are_no_array_take_the_per_event_path(encoding: str) -> None:
    good = BlockStored([2], None, [5, 6], 2)
    payload = encode_batch([BlockStored([1], None, "xy", 2), good], 1.0, None, encoding)  # type: ignore[arg-type]
    batch = decode_batch(payload, packed_tokens=True)
    assert batch.events == [good] and batch.errors == [BAD_EVENT]
    assert type(batch.events[0].token_ids) is list  # type: ignore[union-attr]


# --- the engine index -------------------------------------------------------------------------


def _drain(rng: random.Random, n: int = 18, sources: int = 3) -> list[tuple[str, bytes]]:
    """Chained 8-block stores of several sources (each continues its source's last store)."""
    out, parents = [], {}
    for i in range(n):
        source = f"pod-{i % sources}"
        hashes = list(range(1 + 8 * i, 9 + 8 * i))
        tokens = [rng.randrange(150_000) for _ in range(8 * 16)]
        out.append((source, encode_batch([BlockStored(hashes, parents.get(source), tokens, 16, None, "GPU", None)], 1.0)))
        parents[source] = hashes[-1]
    return out


def _holders(payloads: list[tuple[str, bytes]], packed: list[bool], compiled: bool, one_by_one: bool = False
             ) -> tuple[dict[int, int], list[Any]]:  # fmt: skip
    keys.set_native(kernel.states_many if compiled else None)
    svc = EngineService(MemoryStore(), lambda _: 16)
    try:
        gens = {f"pod-{j}": svc.index.add_source(SourceSpec(f"pod-{j}", "inst", f"tcp://127.0.0.1:{j + 1}")).generation
                for j in range(3)}  # fmt: skip
        items = [(s, gens[s], seq, decode_batch(p, packed_tokens=k)) for seq, ((s, p), k) in enumerate(zip(payloads, packed))]
        stats = [svc.index.apply(*item) for item in items] if one_by_one else svc.index.apply_many(items)
        table = svc.index._tables.get(("inst", ""))
        return (dict(table.holders) if table else {}), stats
    finally:
        svc.stop()
        keys.set_native(None)


@pytest.mark.parametrize("one_by_one", [False, True])
def test_packed_stores_index_the_keys_of_list_stores(python_only: None, one_by_one: bool) -> None:
    payloads = _drain(random.Random(3))
    expected, _ = _holders(payloads, [False] * len(payloads), compiled=False)
    assert len(expected) == 18 * 8
    for compiled in (True, False):  # with the kernel, and read as ids by the Python forms
        got, _ = _holders(payloads, [True] * len(payloads), compiled, one_by_one)
        assert got == expected
    mixed = [i % 3 != 1 for i in range(len(payloads))]  # one source's chain turns from lists to packed and back
    assert _holders(payloads, mixed, compiled=True)[0] == expected


@pytest.mark.parametrize("compiled", [True, False])
def test_a_store_with_ids_that_are_not_ids_is_a_broken_event_alone(python_only: None, compiled: bool) -> None:
    payloads = _drain(random.Random(4), n=6)
    bad = ("pod-0", encode_batch([BlockStored(list(range(900, 908)), None, ["x"] * 128, 16)], 1.0))  # type: ignore[list-item]
    got, stats = _holders([bad, *payloads], [True] * 7, compiled)
    assert stats[0].blocks == 0 and stats[0].errors == {"bad_token_ids": 1}
    assert [s.blocks for s in stats[1:]] == [8] * 6  # the rest of the drain is applied
    assert got == _holders(payloads, [False] * 6, compiled=False)[0]


def _register(kv: Any) -> None:
    register(kv, block_size=16, specs=[{"name": "tp0", "size": 64}])


def test_a_subscribed_engine_is_indexed_with_packed_tokens(python_only: None) -> None:
    """Real sockets: a server with the kernel follows a vLLM-format publisher."""
    rng = random.Random(8)
    tokens = [rng.randrange(150_000) for _ in range(24 * 16)]
    with serve_in_thread(overrides={"server": {"hash_kernel": "numba"}}) as server, server.client() as kv:
        assert keys.native_states() is kernel.states_many
        _register(kv)
        with FakeEnginePublisher().start() as engine:
            kv.call("add_event_source", {"source_id": "pod-s", "instance_id": "inst", "endpoint": engine.endpoint,
                                         "replay_endpoint": engine.replay_endpoint})  # fmt: skip
            engine.store(list(range(1, 17)), tokens[: 16 * 16], block_size=16)
            engine.store(list(range(17, 25)), tokens[16 * 16 :], block_size=16, parent=16)
            engine.publish([BlockStored([99], 24, ["x"] * 16, 16, None, "GPU", None)])  # type: ignore[list-item]
            for _ in range(200):
                match = kv.call("match_engines", {"instance_id": "inst", "block_keys": token_ids_to_block_keys(tokens, 16)})
                if match["sources"] and match["sources"][0]["matched_blocks"] == 24:
                    break
                threading.Event().wait(0.05)
            assert [(s["source_id"], s["matched_blocks"]) for s in match["sources"]] == [("pod-s", 24)]
            for _ in range(100):
                errors = kv.call("list_event_sources", {"instance_id": "inst"})["sources"][0]["errors_by_kind"]
                if errors:
                    break
                threading.Event().wait(0.05)
            assert errors == {"bad_token_ids": 1}  # refused when hashed (the list decode calls it bad_event)


def test_a_push_report_refuses_only_the_store_with_ids_that_are_not_ids(python_only: None) -> None:
    good = BlockStored([1], None, list(range(16)), 16, None, "GPU", None)
    payload = encode_batch([good, BlockStored([2], 1, ["x"] * 16, 16, None, "GPU", None)], 1.0)  # type: ignore[list-item]
    with serve_in_thread(overrides={"server": {"hash_kernel": "numba"}}) as server, server.client() as kv:
        _register(kv)
        kv.call("report_events", {"source_id": "pod-a", "op": "register", "instance_id": "inst"})
        reply = kv.call("report_events", {"source_id": "pod-a", "op": "payloads", "payloads": [{"seq": 0, "payload": payload}]})
        assert reply["applied_blocks"] == 1 and reply["errors"] == {"bad_token_ids": 1}
        match = kv.call("match_engines", {"instance_id": "inst", "token_ids": list(range(16))})
        assert [(s["source_id"], s["matched_blocks"]) for s in match["sources"]] == [("pod-a", 1)]
