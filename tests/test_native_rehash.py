"""The compiled re-hash (``events.rehash = "numba"``): the same bits as the Python forms, the
Python form for what it declines, and a server configured for it applying real batches."""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcm.cache.keys import token_ids_to_block_keys
from kvcm.config import ConfigError
from kvcm.engines import hashing
from kvcm.engines.hashing import chain_states, chain_states_many
from kvcm.engines.service import EngineService
from kvcm.engines.sources import SourceSpec, SubscriberSettings
from kvcm.kv_events import BlockStored, DecodedBatch, decode_batch, encode_batch
from kvcm.store import MemoryStore

native = pytest.importorskip("kvcm.engines.native", reason="numba is a test dependency (pip install -e '.[test]')")

M64 = (1 << 64) - 1


@pytest.fixture
def python_only() -> Iterator[None]:
    """The Python forms while the test runs, and after it (the kernel is process-wide)."""
    hashing.set_native(None)
    yield
    hashing.set_native(None)


def python_states(seeds: list[int], lists: list[list[int]], step: int) -> list[list[int]]:
    hashing.set_native(None)
    return chain_states_many(seeds, lists, step)


chains = st.lists(
    st.tuples(st.integers(-(1 << 63), M64), st.lists(st.integers(0, (1 << 32) - 1), max_size=80)), max_size=6
)


@settings(max_examples=200, deadline=None)
@given(chains, st.integers(1, 20))
def test_kernel_gives_the_python_states(chain_list: list[tuple[int, list[int]]], step: int) -> None:
    seeds = [s for s, _ in chain_list]
    lists = [t[: len(t) // step * step] for _, t in chain_list]  # whole blocks, as every caller passes
    try:
        expected = python_states(seeds, lists, step)
        assert native.states_many(seeds, lists, step) == expected
        native.load()
        assert chain_states_many(seeds, lists, step) == expected  # the hook takes the kernel
    finally:
        hashing.set_native(None)


@pytest.mark.parametrize("token", [0, 1, 127, 128, 65535, 65536, (1 << 31) - 1, 1 << 31, (1 << 32) - 1])
@pytest.mark.parametrize("seed", [0, 1, -1, -(1 << 63), (1 << 63) - 1, M64, 0x9E3779B97F4A7C15])
def test_edge_tokens_and_seeds(python_only: None, token: int, seed: int) -> None:
    lists = [[token] * 32, [token, 5] * 16]
    assert native.states_many([seed, seed ^ 1], lists, 16) == python_states([seed, seed ^ 1], lists, 16)


def test_keys_are_token_ids_to_block_keys(python_only: None) -> None:
    rng = random.Random(3)
    tokens = [rng.randrange(200_000) for _ in range(64 * 16)]
    native.load()
    assert chain_states(0, tokens, 16) == token_ids_to_block_keys(tokens, 16)  # long: the kernel
    assert chain_states_many([0, 0], [tokens, tokens[:48]], 16) == [
        token_ids_to_block_keys(tokens, 16), token_ids_to_block_keys(tokens[:48], 16)
    ]


@pytest.mark.parametrize("bad", [1 << 32, -1, 1 << 64, -(1 << 70)])
def test_ids_outside_32_bits_are_declined_and_hashed_in_python(python_only: None, bad: int) -> None:
    rng = random.Random(4)
    lists = [[rng.randrange(1000) for _ in range(320)] for _ in range(3)]
    lists[1][7] = bad
    assert native.states_many([1, 2, 3], lists, 16) is None
    expected = python_states([1, 2, 3], lists, 16)
    native.load()
    assert chain_states_many([1, 2, 3], lists, 16) == expected
    assert chain_states(2, lists[1], 16) == expected[1]


def test_a_service_configured_for_numba_applies_batches_with_the_same_keys(python_only: None) -> None:
    rng = random.Random(5)
    tokens = [rng.randrange(150_000) for _ in range(40 * 16)]
    payload = encode_batch([BlockStored(list(range(1, 41)), None, tokens, 16, None, "GPU", None)], 1.0, 0, "mixed")
    svc = EngineService(MemoryStore(), lambda _: 16, SubscriberSettings(rehash="numba"))
    try:
        assert hashing._native is native.states_many  # loaded at construction, before any batch
        state = svc.index.add_source(SourceSpec("pod-a", "inst", "tcp://127.0.0.1:1"))
        svc.index.apply_many([("pod-a", state.generation, 0, decode_batch(payload))])
        reply = svc.match("inst", token_ids=tokens)
        assert [(s["source_id"], s["matched_blocks"]) for s in reply["sources"]] == [("pod-a", 40)]
        assert svc.index.ranked("inst", token_ids_to_block_keys(tokens, 16), block_size=16, weight=svc.weights.of)
    finally:
        svc.stop()


def test_numba_missing_is_a_start_up_error(python_only: None, monkeypatch: pytest.MonkeyPatch) -> None:
    import kvcm.engines

    monkeypatch.delattr(kvcm.engines, "native", raising=False)
    monkeypatch.setitem(sys.modules, "kvcm.engines.native", None)  # importing it raises ImportError
    with pytest.raises(ConfigError, match=r"events.rehash = numba needs numba and numpy \(pip install 'kvcm\[fast\]'\)"):
        EngineService(MemoryStore(), lambda _: 16, SubscriberSettings(rehash="numba"))
    assert hashing._native is None


def test_events_rehash_is_validated() -> None:
    from kvcm.config import load

    with pytest.raises(ConfigError, match=r"events\.rehash must be python or numba"):
        load(environ={}, overrides={"events": {"rehash": "cython"}})


def test_index_batches_apply_alike_in_both_forms(python_only: None) -> None:
    """A drain of chained batches from several sources: the same holders either way."""
    rng = random.Random(6)
    items = []
    parents: dict[str, int] = {}
    for i in range(24):
        source = f"pod-{i % 4}"
        hashes = list(range(1 + 32 * i, 33 + 32 * i))
        tokens = [rng.randrange(150_000) for _ in range(32 * 16)]
        items.append((source, BlockStored(hashes, parents.get(source), tokens, 16, None, "GPU", None)))
        parents[source] = hashes[-1]

    def holders(kernel: bool) -> dict[int, int]:
        hashing.set_native(native.states_many if kernel else None)
        svc = EngineService(MemoryStore(), lambda _: 16)
        try:
            gens = {f"pod-{j}": svc.index.add_source(SourceSpec(f"pod-{j}", "inst", f"tcp://127.0.0.1:{j + 1}")).generation
                    for j in range(4)}  # fmt: skip
            svc.index.apply_many([(s, gens[s], seq, DecodedBatch(1.0, [ev])) for seq, (s, ev) in enumerate(items)])
            return dict(svc.index._tables[("inst", "")].holders)
        finally:
            svc.stop()

    python, compiled = holders(False), holders(True)
    assert python == compiled and len(python) == 24 * 32


def test_the_hook_takes_long_chains_and_drains(python_only: None) -> None:
    calls: list[int] = []

    def marked(seeds, lists, step):  # type: ignore[no-untyped-def]
        calls.append(len(seeds))
        return [[7] * (len(t) // step) for t in lists]

    hashing.set_native(marked)
    assert chain_states(0, [1] * 256, 16) == [7] * 16  # a long chain
    assert chain_states(0, [1] * 32, 16) != [7, 7]  # a short one: the Python loop
    assert chain_states_many([0, 1], [[1] * 32, [2] * 16], 16) == [[7, 7], [7]]  # a drain, however short
    assert calls == [1, 2]
    hashing.set_native(lambda seeds, lists, step: None)  # declined: the Python forms answer
    assert chain_states_many([0, 1], [[1] * 32, [2] * 16], 16) == python_states([0, 1], [[1] * 32, [2] * 16], 16)
