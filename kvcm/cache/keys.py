"""Block keys: how ``token_ids`` become prefix-dependent int64 keys, bit-exact with Tair KVCM.

The hash is RTP-LLM's chained Jenkins-style mix over signed int64, seed 0, carried across
blocks: key *i* depends on every token of blocks ``0..i``. Only full blocks get a key; a trailing
partial block is ignored. ``std::hash<int64_t>`` is the identity in libstdc++, so each token
value enters the mix unchanged. :func:`derive_keys` is the one place a data-plane request's keys
come from (its ``block_keys``, else the hash of its ``token_ids``).

A block with extra keys (:mod:`kvcm.proto.extra_keys`: an image, a LoRA adapter, a cache salt) gets
``mix(state, digest)`` as its key, where ``state`` is the chained hash after its tokens and
``digest`` that of its extra keys, and the chain goes on from that key; a block without extra
keys keeps the plain chained hash, so prompts without any have the keys they always had.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from kvcm.errors import InvalidArgument

if TYPE_CHECKING:
    from kvcm.proto.extra_keys import BlockExtras

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_HIGH = _M64 ^ ((1 << 32) - 1)  # sign fill of an arithmetic 32-bit right shift


#: The chained hash compiled (:mod:`kvcm.cache.hash_kernel`, ``server.hash_kernel = "numba"``):
#: ``(seeds, token lists, step)`` -> per list the states after every ``step`` tokens, as signed
#: int64 (each the key of the block it ends); None for input it declines (ids outside 32 bits).
NativeStates = Callable[[Sequence[int], Sequence[Sequence[int]], int], "list[list[int]] | None"]
_native: NativeStates | None = None

#: Tokens below which a slice is hashed in Python even with the kernel loaded (its call and
#: conversions cost about as much as a short Python loop).
NATIVE_MIN_TOKENS = 256


def set_native(states: NativeStates | None) -> None:
    """Make ``states`` the process's hash of whole blocks of token ids (None: Python only)."""
    global _native
    _native = states


def native_states() -> NativeStates | None:
    """The loaded kernel (:func:`set_native`), if any."""
    return _native


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
    hasher = ChainHasher(block_size, seed)
    hasher.feed(tokens)
    return hasher.keys


class ChainHasher:
    """The chained hash of :func:`token_ids_to_block_keys`, resumable: a long prompt can be hashed
    a slice at a time (the RPC loop spreads one request's hashing over several turns, so other
    clients are not held up behind it). Feed slices in order; only full blocks produce keys.
    ``extras``: the prompt's extra keys (module docstring), digested as the blocks are reached.
    """

    __slots__ = ("_extras", "_pending", "_state", "block_size", "keys")

    def __init__(self, block_size: int, seed: int = 0, extras: BlockExtras | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.keys: list[int] = []
        self._state = seed & _M64  # kept unsigned: the signed view is only taken per key
        self._pending = 0  # tokens of the current, not yet complete block
        self._extras = extras

    def feed(self, tokens: Sequence[int]) -> None:
        """Hash ``tokens`` (the next ones of the prompt); whole blocks of a long slice take the
        compiled kernel when one is loaded (:func:`set_native`). With extra keys, the runs of
        blocks between those that have any are hashed so, and each of those is mixed alone."""
        if self._extras is None:
            self._feed_plain(tokens)
            return
        size, first = self.block_size, len(self.keys)
        fed = first * size + self._pending  # tokens of the prompt hashed before these
        digests = self._extras.digests(first, (fed + len(tokens)) // size)
        at = 0
        for i, d in enumerate(digests):
            if d is None:
                continue
            end = (first + i + 1) * size - fed  # where block first + i ends in ``tokens``
            self._feed_plain(tokens[at:end])
            at = end
            key = mix(self.keys[-1], d)
            self.keys[-1] = key
            self._state = key & _M64
        self._feed_plain(tokens[at:])

    def _feed_plain(self, tokens: Sequence[int]) -> None:
        size = self.block_size
        if _native is not None and len(tokens) >= NATIVE_MIN_TOKENS:
            head = min(len(tokens), (size - self._pending) % size)  # the rest of the current block
            whole = (len(tokens) - head) // size * size
            if whole:
                self._feed(tokens[:head])
                found = _native([self._state], [tokens[head : head + whole]], size)
                tokens = tokens[head + whole :] if found is not None else tokens[head:]
                if found is not None:
                    self.keys += found[0]
                    self._state = found[0][-1] & _M64
        self._feed(tokens)

    def _feed(self, tokens: Sequence[int]) -> None:
        # The loop is mix() inlined over unsigned state (about 1.5x faster than calling it): for
        # signed h, ``(h >> 32) & M64`` is an arithmetic shift, hence the sign fill of the top half.
        u, pending, size, keys = self._state, self._pending, self.block_size, self.keys
        for v in tokens:
            u ^= ((v & _M64) + _GOLDEN + ((u << 12) & _M64) + ((u >> 32) | (_HIGH if u >> 63 else 0))) & _M64
            pending += 1
            if pending == size:
                keys.append(u - (1 << 64) if u >> 63 else u)
                pending = 0
        self._state, self._pending = u, pending


def chain_hash_ids(hash_ids: Iterable[int], seed: int = 0) -> list[int]:
    """Tair optimizer's ``ApplyPrefixHash``: the same mix over one value per block."""
    h, keys = seed, []
    for v in hash_ids:
        h = mix(h, v)
        keys.append(h)
    return keys


def derive_keys(
    block_keys: Sequence[int] | None, token_ids: Sequence[int] | None, block_size: int,
    extras: BlockExtras | None = None,
) -> list[int]:
    """Keys of a request: ``block_keys`` verbatim, else Tair's chained hash of ``token_ids``
    (with the blocks' ``extras`` mixed in, module docstring)."""
    if block_keys:
        return list(block_keys)
    if token_ids:
        hasher = ChainHasher(block_size, extras=extras)
        hasher.feed(token_ids)
        return hasher.keys
    raise InvalidArgument("block_keys or token_ids: one of them must be non-empty")
