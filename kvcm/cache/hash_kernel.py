"""The chained block hash compiled with numba: ``server.hash_kernel = "numba"`` (``pip install 'kvcm[fast]'``).

Token ids become kvcm keys by a chained mix (:mod:`kvcm.cache.keys`): for every query and write
that sends ``token_ids``, and for every block an engine reports, which the engine tier re-hashes
(about half the CPU of applying a KV-event batch). In pure Python that is at its floor: the mix
is sequential per chain, so the fastest form runs every chain of a drain in the lanes of one big
int (:mod:`kvcm.engines.hashing`), and even then each token costs hundreds of interpreter and
big-int instructions. numba compiles the same recurrence on plain 64-bit words; what remains is
turning the token lists into one ``uint32`` buffer (``struct``, C-level) and the states back
into Python ints (``tolist``).

Importing this module imports numba (about half a second) and :func:`load` compiles the kernel,
cached on disk by numba where the package directory is writable, so only a server configured for
it pays that, once, at start-up. Loading is process-wide: from then on every hash of whole
blocks of a long enough token list takes the kernel (:func:`kvcm.cache.keys.set_native`). The
kernel gives the same bits as the Python forms (``tests/test_hash_kernel.py`` compares them on
random and edge inputs); token ids outside ``0 .. 2**32 - 1`` (no vocabulary has them) make it
decline, and Python hashes that list.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numba
import numpy as np

from kvcm.cache import keys

_U64 = np.uint64
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_HIGH = np.uint64(0xFFFFFFFF00000000)
_M64 = (1 << 64) - 1


def _run_py(seeds: Any, tokens: Any, offsets: Any, step: int, out: Any) -> int:
    """States after every ``step`` tokens of each chain ``c`` (``tokens[offsets[c]:offsets[c+1]]``,
    seeded by ``seeds[c]``), into ``out`` in chain order; returns how many. It is
    :func:`kvcm.cache.keys.mix` on unsigned words: the signed state's arithmetic shift is the
    logical one with the sign's ones put back in the top half, and every sum wraps mod 2**64 as
    the mix's does."""
    k = 0
    for c in range(seeds.shape[0]):
        u = seeds[c]
        start = offsets[c]
        for b in range((offsets[c + 1] - start) // step):
            first = start + b * step
            for i in range(first, first + step):
                high = u >> _U64(32)
                if u >> _U64(63):
                    high |= _HIGH
                u ^= _U64(tokens[i]) + _GOLDEN + (u << _U64(12)) + high
            out[k] = u
            k += 1
    return k


try:  # compiled code cached beside this file; a read-only install compiles at each start instead
    _run = numba.njit(cache=True, nogil=True)(_run_py)
except RuntimeError:
    _run = numba.njit(nogil=True)(_run_py)


def states_many(seeds: Sequence[int], token_lists: Sequence[Sequence[int]], step: int) -> list[list[int]] | None:
    """:data:`kvcm.cache.keys.NativeStates`: per list, the states after every ``step`` tokens
    from its seed; None if a token id is outside ``0 .. 2**32 - 1`` (Python hashes it then)."""
    try:
        packed = b"".join([struct.pack(f"<{len(t)}I", *t) for t in token_lists])
    except struct.error:
        return None
    lengths = [len(t) for t in token_lists]
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    counts = [n // step for n in lengths]
    out = np.empty(sum(counts), dtype=np.uint64)
    _run(np.array([s & _M64 for s in seeds], dtype=np.uint64), np.frombuffer(packed, dtype=np.uint32), offsets,
         step, out)  # fmt: skip
    flat: list[int] = out.view(np.int64).tolist()  # the signed states: kvcm keys
    result, at = [], 0
    for n in counts:
        result.append(flat[at : at + n])
        at += n
    return result


def load() -> None:
    """Compile the kernel (or load numba's cached build) and make it the process's hash."""
    states_many([1], [[1, 2]], 2)
    keys.set_native(states_many)
