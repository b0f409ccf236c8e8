"""Re-hashing engine token ids into kvcm's key space, fast.

kvcm's block key is Tair's chained mix (:mod:`kvcm.cache.keys`) carried token by token, so the
running state after *any* token is a valid seed for the rest of the prefix. That lets an engine
block of a different size than the instance's be chained through its parent: the index keeps
each engine block's end state and token position, and emits a kvcm key whenever the position
crosses a multiple of the instance block size.

The loop below is ``blockkeys.mix`` rewritten on the *unsigned* state (``u = h & M``) without a
branch: about 2x faster than calling ``mix``, and checked against it in the tests. For many independent
chains at once :func:`chain_states_many` runs the same recurrence on all of them together, each in
its own lanes of one big int.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from itertools import repeat
from operator import add, itemgetter
from typing import TYPE_CHECKING, Literal, cast

from kvcm.cache.keys import NATIVE_MIN_TOKENS, mix, native_states
from kvcm.proto.kv_events import PackedTokens

if TYPE_CHECKING:
    from kvcm.proto.kv_events import BlockStored

_M64 = (1 << 64) - 1
_M52 = (1 << 52) - 1
_TOP = 1 << 63
_GOLDEN = 0x9E3779B97F4A7C15
_GOLDEN_SHIFTED = _GOLDEN - (1 << 31)
_TWO64 = 1 << 64


def to_signed(u: int) -> int:
    """Unsigned 64-bit state -> the signed int64 kvcm key."""
    return u - _TWO64 if u >= _TOP else u


def chain_states(u: int, tokens: Sequence[int], step: int) -> list[int]:
    """States after every ``step`` tokens, chained from state ``u``, as signed int64: each is
    the kvcm key of the block it ends, and a seed to chain from (taken mod 2**64).

    ``len(tokens)`` must be a multiple of ``step``. With ``u = 0`` and ``step = block_size`` they
    are exactly ``token_ids_to_block_keys(tokens, block_size)``. A long chain takes the compiled
    kernel when one is loaded (:func:`kvcm.cache.keys.set_native`).

    Branch-free form of ``mix``: the sum is taken mod 2**64 at the end, so ``v & M`` needs no
    masking of its own, and the arithmetic shift of the signed state is
    ``((u ^ 2**63) >> 32) - 2**31`` (the ``- 2**31`` is folded into the constant).
    """
    native = native_states()
    if native is not None and len(tokens) >= NATIVE_MIN_TOKENS:
        found = native([u], [tokens], step)
        if found is not None:
            return found[0]
    out: list[int] = []
    append = out.append
    u &= _M64
    for s in range(0, len(tokens), step):
        for v in tokens[s : s + step]:
            u ^= (v + _GOLDEN_SHIFTED + ((u & _M52) << 12) + ((u ^ _TOP) >> 32)) & _M64
        append(u - _TWO64 if u >= _TOP else u)
    return out


def chain_states_mixed(u: int, tokens: Sequence[int], step: int, digests: Sequence[int | None]) -> list[int]:
    """:func:`chain_states` of a store with extra keys: after step *i* the digest ``digests[i]``
    (when not None) is mixed in, and the chain goes on from there (:mod:`kvcm.cache.keys`). The
    runs of steps between digests take :func:`chain_states` (a slice of packed tokens is read as
    ids: a store with extra keys takes this slower path, plain stores never do)."""
    out: list[int] = []
    start = 0
    for i, d in enumerate(digests):
        if d is None:
            continue
        out += chain_states(u, tokens[start * step : (i + 1) * step], step)
        key = out[-1] = mix(out[-1], d)
        u, start = key, i + 1
    if start * step < len(tokens):
        out += chain_states(u, tokens[start * step :], step)
    return out


def chain_states_many(
    seeds: Sequence[int], token_lists: Sequence[Sequence[int]], step: int
) -> list[list[int]]:
    """:func:`chain_states` for many independent chains at once, all advanced together in the
    lanes of one Python int (SWAR, below): from two chains on that beats one chain at a time; or
    all in the compiled kernel, when one is loaded (:func:`kvcm.cache.keys.set_native`)."""
    native = native_states()
    if native is not None:
        found = native(seeds, token_lists, step)
        if found is not None:
            return found
    if len(seeds) < 2:
        return [chain_states(u, t, step) for u, t in zip(seeds, token_lists)]
    n = len(seeds)
    lengths = [len(t) // step * step for t in token_lists]
    out: list[list[int]] = [[] for _ in range(n)]
    states = [u & _M64 for u in seeds]
    active = [i for i in range(n) if lengths[i]]
    pos = 0
    while len(active) > 1:  # a chain leaves the lanes where it ends: the rest are repacked
        end = min(lengths[i] for i in active)
        rows = [t if pos == 0 and end == len(t) else t[pos:end] for t in (token_lists[i] for i in active)]
        lanes = _run_lanes([states[i] for i in active], rows, step)
        for i, lane in zip(active, lanes):
            if out[i]:
                out[i] += lane
            else:
                out[i] = lane
            states[i] = lane[-1] & _M64
        pos = end
        active = [i for i in active if lengths[i] > end]
    for i in active:  # the last one standing
        out[i] += chain_states(states[i], token_lists[i][pos : lengths[i]], step)
    return out


# SWAR ("SIMD within a register"): chain j's 64-bit state lives in bits [72j, 72j + 64) of one
# Python int, so each operation of the mix is one C-level big-int operation for every chain
# (about 1 us per token for 40 chains, against 0.4 us per token and chain in the scalar loop, or
# 5 numpy calls of about 1 us each). Per lane the sum of the mix stays below 2**66 (the token and
# constant are added unreduced): the 8 spare bits take its carries, so no lane spills into the
# next. The mix's ``& M`` is skipped: what it would clear sits in the spare bits, which the
# ``& M52`` and the masked ``>> 32`` of the next step never read, and which are dropped when the
# states are read out (``x`` pad bytes in the struct format).
_LANE_BYTES = 9
_LANES: dict[int, tuple[struct.Struct, struct.Struct, struct.Struct, int, int, int, int]] = {}


def _lane_constants(n: int) -> tuple[struct.Struct, struct.Struct, struct.Struct, int, int, int, int]:
    """The 9-byte-lane codecs of ``n`` lanes (unsigned, to pack seeds and ids; signed, to read
    the states out as kvcm keys), the codec of one position's lanes as bytes, and
    ``M52``, ``M32``, ``2**63`` and the mix's constant repeated in each lane."""
    found = _LANES.get(n)
    if found is None:
        def spread(value: int) -> int:
            return int.from_bytes(value.to_bytes(_LANE_BYTES, "little") * n, "little")

        found = (struct.Struct("<" + "Qx" * n), struct.Struct("<" + "qx" * n), struct.Struct(f"{_LANE_BYTES * n}s"), spread(_M52),
                 spread((1 << 32) - 1), spread(_TOP), spread(_GOLDEN_SHIFTED))  # fmt: skip
        if len(_LANES) >= 256:
            _LANES.clear()
        _LANES[n] = found
    return found


def _run_lanes(seeds: list[int], rows: list[Sequence[int]], step: int) -> list[list[int]]:
    """States after every ``step`` tokens of equally long token ``rows``, one lane each."""
    lanes, signed, position, m52, m32, top, golden = _lane_constants(len(rows))
    pack, from_bytes = lanes.pack, int.from_bytes
    try:  # one int per token position, every chain's token in its lane
        words = _words32(rows, golden, position)
    except struct.error:  # an id beyond 32 bits: the general form
        try:
            words = _words(pack, rows, golden)
        except struct.error:  # negative ids, or ids >= 2**64: their low 64 bits enter the mix
            words = _words(pack, [[t & _M64 for t in row] for row in rows], golden)
    # Each lane holds ``u ^ 2**63`` (bit 63 flipped), which is what the mix's shift reads: one
    # big-int operation less per token; the flip is undone once per ``step`` tokens, on read-out.
    u = from_bytes(pack(*seeds), "little") ^ top
    size, unpack = lanes.size, signed.unpack
    snaps = []
    for s in range(0, len(words), step):
        for w in words[s : s + step]:
            u ^= ((u & m52) << 12) + ((u >> 32) & m32) + w
        snaps.append(unpack((u ^ top).to_bytes(size, "little")))
    return [list(lane) for lane in zip(*snaps)]


_ROWS32: dict[int, struct.Struct] = {}
_FIRST = itemgetter(0)


def _words32(rows: Sequence[Sequence[int]], golden: int, position: struct.Struct) -> list[int]:
    """:func:`_words` for token ids below 2**32 (every vocabulary): each row is packed once as
    4-byte ints and its 4 byte columns are copied into its lane of every position by 4 strided
    slice stores, so the transpose costs 4 C-level copies per row instead of an argument tuple
    per position; the lanes' 5 upper bytes stay zero. The table is then cut into one int per
    position by ``position.iter_unpack`` (``position``: one position's lanes as bytes) and
    ``map``: no bytecode per position (a Python loop over the
    positions cost as much as packing the rows). Raises ``struct.error`` for an id outside
    ``0 .. 2**32 - 1``."""
    n, length = len(rows), len(rows[0])
    row32 = _ROWS32.get(length)
    if row32 is None:
        if len(_ROWS32) >= 256:
            _ROWS32.clear()
        row32 = _ROWS32[length] = struct.Struct(f"<{length}I")
    width = _LANE_BYTES * n
    table = bytearray(width * length)  # position p's lanes are bytes p*width .. (p+1)*width
    for j, row in enumerate(rows):
        packed, lane = row32.pack(*row), _LANE_BYTES * j
        table[lane::width] = packed[0::4]
        table[lane + 1 :: width] = packed[1::4]
        table[lane + 2 :: width] = packed[2::4]
        table[lane + 3 :: width] = packed[3::4]
    little: Literal["little"] = "little"
    return list(map(add, map(int.from_bytes, map(_FIRST, position.iter_unpack(table)), repeat(little)),
                    repeat(golden)))


def _words(pack: Callable[..., bytes], rows: Sequence[Sequence[int]], golden: int) -> list[int]:
    """Per token position the int of every row's token in its lane, plus the mix's constant:
    ``map`` over the rows calls ``pack`` with one token of each (the transpose happens in C, no
    tuple per position, no bytecode per position)."""
    little: Literal["little"] = "little"
    return list(map(add, map(int.from_bytes, map(pack, *rows), repeat(little)), repeat(golden)))


class Chain:
    """Consecutive stores hashed as one chain by :func:`hash_chains`."""

    __slots__ = ("events", "seed", "step", "tokens")

    def __init__(self, seed: int, step: int) -> None:
        self.seed = seed
        self.step = step
        self.events: list[BlockStored] = []
        self.tokens: Sequence[int] = []

    def add(self, ev: BlockStored) -> None:
        """Append a store (its token list is shared, not copied, while it is the only one;
        packed tokens stay packed)."""
        self.events.append(ev)
        tokens = ev.token_ids
        if len(self.events) == 1:
            self.tokens = tokens
        elif type(self.tokens) is PackedTokens and type(tokens) is PackedTokens:
            self.tokens = self.tokens.joined(tokens)
        elif len(self.events) == 2 or type(self.tokens) is PackedTokens:
            self.tokens = [*self.tokens, *tokens]  # from here on a list of the chain's own
        else:
            cast("list[int]", self.tokens).extend(tokens)


#: Per store event (by ``id``): the state it was hashed from, and its states.
Precomputed = dict[int, tuple[int, list[int]]]


def hash_chains(chains: list[Chain]) -> Precomputed:
    """Hash every chain (grouped by step, all chains of a step together). Each event's entry
    names the seed it assumed, so a user can check it against the parent it finds when it
    applies the event (an earlier event of the chain may not have been applied after all)."""
    out: Precomputed = {}
    by_step: dict[int, list[Chain]] = {}
    for chain in chains:
        by_step.setdefault(chain.step, []).append(chain)
    for step, group in by_step.items():
        results = chain_states_many([c.seed for c in group], [c.tokens for c in group], step)
        for chain, states in zip(group, results):
            offset, seed = 0, chain.seed & _M64
            if len(chain.events) == 1:
                out[id(chain.events[0])] = (seed, states)
                continue
            for ev in chain.events:
                n = len(ev.token_ids) // step
                out[id(ev)] = (seed, states[offset : offset + n])
                offset += n
                if n:
                    seed = states[offset - 1] & _M64
    return out
