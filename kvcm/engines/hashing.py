"""Re-hashing engine token ids into kvcm's key space, fast.

kvcm's block key is Tair's chained mix (:mod:`kvcm.cache.keys`) carried token by token, so the
running state after *any* token is a valid seed for the rest of the prefix. That lets an engine
block of a different size than the instance's be chained through its parent: the index keeps
each engine block's end state and token position, and emits a kvcm key whenever the position
crosses a multiple of the instance block size.

The loop below is ``blockkeys.mix`` rewritten on the *unsigned* state (``u = h & M``) without a
branch: about 2x faster than calling ``mix``, and checked against it in the tests. For many independent
chains at once :func:`chain_states_many` runs the same recurrence vectorised in numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvcm.kv_events import BlockStored

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
    """Unsigned states after every ``step`` tokens, chained from state ``u``.

    ``len(tokens)`` must be a multiple of ``step``. With ``u = 0`` and ``step = block_size`` the
    signed states are exactly ``token_ids_to_block_keys(tokens, block_size)``.

    Branch-free form of ``mix``: the sum is taken mod 2**64 at the end, so ``v & M`` needs no
    masking of its own, and the arithmetic shift of the signed state is
    ``((u ^ 2**63) >> 32) - 2**31`` (the ``- 2**31`` is folded into the constant).
    """
    out: list[int] = []
    append = out.append
    for s in range(0, len(tokens), step):
        for v in tokens[s : s + step]:
            u ^= (v + _GOLDEN_SHIFTED + ((u & _M52) << 12) + ((u ^ _TOP) >> 32)) & _M64
        append(u)
    return out


def chain_states_many(
    seeds: Sequence[int], token_lists: Sequence[Sequence[int]], step: int
) -> list[list[int]]:
    """:func:`chain_states` for many independent chains; vectorised across chains with numpy.

    Worth it from about a dozen chains (the per-token numpy overhead is paid once for all of
    them); below that, or without numpy, it falls back to the scalar loop.
    """
    if len(seeds) < 12:
        return [chain_states(u, t, step) for u, t in zip(seeds, token_lists)]
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is optional
        return [chain_states(u, t, step) for u, t in zip(seeds, token_lists)]
    result: list[list[int]] = _chain_numpy(np, seeds, token_lists, step)  # type: ignore[no-untyped-call]
    return result


def _chain_numpy(np, seeds, token_lists, step):  # type: ignore[no-untyped-def]
    """All chains advance together, one token per step, on preallocated uint64 buffers (five
    ufunc calls per token: the numpy overhead is paid once per step for every chain)."""
    n = len(seeds)
    lengths = [len(t) for t in token_lists]
    width = _vector_width(lengths)
    if width == 0:
        return [chain_states(u, t, step) for u, t in zip(seeds, token_lists)]
    tokens = np.zeros((n, width), dtype=np.int64)
    for i, toks in enumerate(token_lists):
        if toks:
            toks = toks[:width]
            try:
                tokens[i, : len(toks)] = toks
            except OverflowError:  # ids >= 2**63: their low 64 bits enter the mix
                tokens[i, : len(toks)] = [(t & _M64) - _TWO64 if t & _M64 >= _TOP else t & _M64 for t in toks]
    # time-major, +GOLDEN folded in once; int64 -> uint64 keeps two's complement (= v & M)
    tg = np.ascontiguousarray(tokens.T).view(np.uint64) + np.uint64(_GOLDEN)
    state = np.array([s & _M64 for s in seeds], dtype=np.uint64)
    signed = state.view(np.int64)
    hi = np.empty(n, dtype=np.int64)
    hi_u = hi.view(np.uint64)
    tmp = np.empty(n, dtype=np.uint64)
    snaps = np.empty((width // step, n), dtype=np.uint64)
    shift_hi, shift_lo = np.int64(32), np.uint64(12)
    rows = list(tg)  # one view per step, made once
    for k in range(width // step):
        for row in rows[k * step : (k + 1) * step]:
            np.right_shift(signed, shift_hi, out=hi)  # arithmetic: (h >> 32) of the signed value
            np.left_shift(state, shift_lo, out=tmp)
            np.add(tmp, row, out=tmp)
            np.add(tmp, hi_u, out=tmp)
            np.bitwise_xor(state, tmp, out=state)
        snaps[k] = state
    columns = snaps.T.tolist()
    out = [columns[i][: lengths[i] // step] for i in range(n)]
    for i, length in enumerate(lengths):
        if length > width:  # the long tail of a few chains: cheaper scalar than padded vectors
            out[i] += chain_states(out[i][-1], token_lists[i][width:], step)
    return out


_VECTOR_STEP_COST = 12  # one vectorised step costs about this many scalar token mixes


def _vector_width(lengths: list[int]) -> int:
    """How many tokens to hash vectorised: beyond it, the few longer chains go scalar."""
    best, best_cost = 0, None
    for width in sorted(set(lengths)):
        tail = sum(length - width for length in lengths if length > width)
        cost = width * _VECTOR_STEP_COST + tail
        if best_cost is None or cost < best_cost:
            best, best_cost = width, cost
    return best


class Chain:
    """Consecutive stores hashed as one chain by :func:`hash_chains`."""

    __slots__ = ("events", "seed", "step", "tokens")

    def __init__(self, seed: int, step: int) -> None:
        self.seed = seed
        self.step = step
        self.events: list[BlockStored] = []
        self.tokens: list[int] = []


def hash_chains(chains: list[Chain]) -> dict[int, list[int]]:
    """Hash every chain (grouped by step, numpy across chains); states per store event."""
    out: dict[int, list[int]] = {}
    by_step: dict[int, list[Chain]] = {}
    for chain in chains:
        by_step.setdefault(chain.step, []).append(chain)
    for step, group in by_step.items():
        results = chain_states_many([c.seed for c in group], [c.tokens for c in group], step)
        for chain, states in zip(group, results):
            offset = 0
            for ev in chain.events:
                n = len(ev.token_ids) // step
                out[id(ev)] = states[offset : offset + n]
                offset += n
    return out
