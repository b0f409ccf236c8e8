"""Block keys: how ``token_ids`` become prefix-dependent int64 keys, bit-exact with Tair KVCM.

The hash is RTP-LLM's chained Jenkins-style mix over signed int64, seed 0, carried across
blocks: key *i* depends on every token of blocks ``0..i``. Only full blocks get a key; a trailing
partial block is ignored. ``std::hash<int64_t>`` is the identity in libstdc++, so each token
value enters the mix unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _signed(x: int) -> int:
    return x - (1 << 64) if x >> 63 else x


def mix(h: int, v: int) -> int:
    """One step of the chained hash; ``h`` and ``v`` are signed int64, so is the result."""
    t = ((v & _M64) + _GOLDEN + ((h << 12) & _M64) + ((h >> 32) & _M64)) & _M64
    return _signed((h & _M64) ^ t)


def token_ids_to_block_keys(
    tokens: Sequence[int], block_size: int, seed: int = 0
) -> list[int]:
    """One key per full block of ``block_size`` tokens, chained from ``seed`` (Tair: 0).

    >>> token_ids_to_block_keys(list(range(1, 9)), 4)
    [455111481605203084, 6902853672176602142]
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    h, keys = seed, []
    n_full = len(tokens) // block_size * block_size
    for start in range(0, n_full, block_size):
        for v in tokens[start : start + block_size]:
            h = mix(h, v)
        keys.append(h)
    return keys


def chain_hash_ids(hash_ids: Iterable[int], seed: int = 0) -> list[int]:
    """Tair optimizer's ``ApplyPrefixHash``: the same mix over one value per block."""
    h, keys = seed, []
    for v in hash_ids:
        h = mix(h, v)
        keys.append(h)
    return keys
