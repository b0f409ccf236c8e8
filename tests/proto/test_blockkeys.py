"""The resumable block-key hasher against the readable definition (``mix`` applied per token)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcm.cache.keys import ChainHasher, mix, token_ids_to_block_keys

INT64 = st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1)


def reference(tokens: list[int], block_size: int, seed: int = 0) -> list[int]:
    h, keys = seed, []
    for start in range(0, len(tokens) // block_size * block_size, block_size):
        for v in tokens[start:start + block_size]:
            h = mix(h, v)
        keys.append(h)
    return keys


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(INT64, st.integers(0, 200_000)), max_size=300), st.integers(1, 20), INT64,
       st.lists(st.integers(1, 40), min_size=1, max_size=50))
def test_hasher_matches_the_definition_whatever_the_slices(tokens, block_size, seed, cuts):
    assert token_ids_to_block_keys(tokens, block_size, seed) == reference(tokens, block_size, seed)
    hasher = ChainHasher(block_size, seed)
    i = 0
    for cut in cuts * (len(tokens) // max(1, sum(cuts)) + 1):
        hasher.feed(tokens[i:i + cut])
        i += cut
        if i >= len(tokens):
            break
    assert hasher.keys == reference(tokens, block_size, seed)


def test_negative_states_are_reached():
    # The sign fill of the inlined shift only matters once the state's top bit is set.
    keys = token_ids_to_block_keys(list(range(1, 65)), 1)
    assert any(k < 0 for k in keys) and keys == reference(list(range(1, 65)), 1)
