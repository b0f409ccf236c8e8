"""Re-hashing engine token ids into kvcm's key space, fast.

kvcm's block key is Tair's chained mix (:mod:`kvcm.blockkeys`) carried token by token, so the
running state after *any* token is a valid seed for the rest of the prefix. That lets an engine
block of a different size than the instance's be chained through its parent: the index keeps
each engine block's end state and token position, and emits a kvcm key whenever the position
crosses a multiple of the instance block size.

The loop below is ``blockkeys.mix`` rewritten on the *unsigned* state (``u = h & M``), with the
arithmetic shift of the signed value expressed as ``(u >> 32) + (HI if u >= 2**63)``: it is
~1.6x faster than calling ``mix`` and is checked against it in the tests. For many independent
chains at once :func:`chain_states_many` runs the same recurrence vectorised in numpy.
"""

from __future__ import annotations

from collections.abc import Sequence

_M64 = (1 << 64) - 1
_M52 = (1 << 52) - 1
_TOP = 1 << 63
_HI = 0xFFFFFFFF00000000
_GOLDEN = 0x9E3779B97F4A7C15
_TWO64 = 1 << 64


def to_signed(u: int) -> int:
    """Unsigned 64-bit state -> the signed int64 kvcm key."""
    return u - _TWO64 if u >= _TOP else u


def to_unsigned(h: int) -> int:
    return h & _M64


def chain_states(u: int, tokens: Sequence[int], step: int) -> list[int]:
    """Unsigned states after every ``step`` tokens, chained from state ``u``.

    ``len(tokens)`` must be a multiple of ``step``. With ``u = 0`` and ``step = block_size`` the
    signed states are exactly ``token_ids_to_block_keys(tokens, block_size)``.
    """
    out: list[int] = []
    append = out.append
    if tokens and (min(tokens) < 0 or max(tokens) > _M64):
        tokens = [t & _M64 for t in tokens]
    for s in range(0, len(tokens), step):
        for v in tokens[s : s + step]:
            u ^= (v + _GOLDEN + ((u & _M52) << 12) + (u >> 32) + (_HI if u >= _TOP else 0)) & _M64
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
    return _chain_numpy(np, seeds, token_lists, step)


def _chain_numpy(np, seeds, token_lists, step):  # type: ignore[no-untyped-def]
    order = sorted(range(len(seeds)), key=lambda i: -len(token_lists[i]))
    lengths = [len(token_lists[i]) for i in order]
    width = lengths[0]
    n = len(order)
    toks = np.zeros((width, n), dtype=np.uint64)  # column j = chain order[j], time-major
    for j, i in enumerate(order):
        if lengths[j]:
            toks[: lengths[j], j] = np.asarray(token_lists[i], dtype=np.int64).astype(np.uint64)
    state = np.array([seeds[i] & _M64 for i in order], dtype=np.uint64)
    golden = np.uint64(_GOLDEN)
    twelve, thirty_two = np.uint64(12), np.int64(32)
    snaps = []
    alive = n
    for t in range(width):
        while alive and lengths[alive - 1] <= t:
            alive -= 1
        u = state[:alive]
        # (h >> 32) on the signed value is an arithmetic shift: do it on an int64 view.
        hi = (u.view(np.int64) >> thirty_two).view(np.uint64)
        u ^= toks[t, :alive] + golden + (u << twelve) + hi
        if (t + 1) % step == 0:
            snaps.append(state.copy())
    out: list[list[int]] = [[] for _ in seeds]
    for j, i in enumerate(order):
        count = lengths[j] // step
        out[i] = [int(snaps[k][j]) for k in range(count)]
    return out
