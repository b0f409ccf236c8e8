"""The chained block hash compiled with numba: ``server.hash_kernel = "numba"`` (``pip install 'kvcm[fast]'``).

Token ids become kvcm keys by a chained mix (:mod:`kvcm.cache.keys`): for every query and write
that sends ``token_ids``, and for every block an engine reports, which the engine tier re-hashes
(about half the CPU of applying a KV-event batch). In pure Python that is at its floor: the mix
is sequential per chain, so the fastest form runs every chain of a drain in the lanes of one big
int (:mod:`kvcm.engines.hashing`), and even then each token costs hundreds of interpreter and
big-int instructions. numba compiles the same recurrence on plain 64-bit words. Token ids
reach it as msgpack arrays (an engine's stores as they came off the wire,
:class:`kvcm.proto.kv_events.PackedTokens`; lists encoded by msgspec, C-level), which a second kernel
unpacks into one ``uint32`` buffer: a token id never has to exist as a Python int. The states
come back as Python ints (``tolist``).

Importing this module imports numba (about half a second) and :func:`load` compiles the kernel,
cached on disk by numba where the package directory is writable, so only a server configured for
it pays that, once, at start-up. Loading is process-wide: from then on every hash of whole
blocks of a long enough token list takes the kernel (:func:`kvcm.cache.keys.set_native`). The
kernel gives the same bits as the Python forms (``tests/cache/test_hash_kernel.py`` compares them on
random and edge inputs); token ids outside ``0 .. 2**32 - 1`` (no vocabulary has them), or
anything but ints, make it decline, and Python hashes that list.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numba
import numpy as np

from kvcm.cache import keys
from kvcm.proto.kv_events import PackedTokens

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


def _unpack_py(buf: Any, out: Any, widths: Any) -> int:
    """The ids of consecutive msgpack arrays of unsigned ints below 2**32 (``buf``, bytes) into
    ``out``; returns how many, or -1 if ``buf`` holds anything else (another type, a negative
    or larger int, a cut array, more ids than ``out`` takes). msgpack writes an int in the
    fewest bytes (fixint, then 1, 2, 4 or 8 big-endian bytes after a marker, signed or not);
    ``widths``: per first byte, the bytes after it of the usual forms (5 for the others)."""
    size = buf.shape[0]
    i = 0
    k = 0
    while i < size:
        b = int(buf[i])
        if 0x90 <= b <= 0x9F:
            n = b & 0x0F
            i += 1
        elif (b == 0xDC or b == 0xDD) and i + (3 if b == 0xDC else 5) <= size:
            width = 2 if b == 0xDC else 4
            n = 0
            for j in range(width):
                n = (n << 8) | int(buf[i + 1 + j])
            i += 1 + width
        else:
            return -1
        if k + n > out.shape[0]:
            return -1
        for _ in range(n):
            if i >= size:
                return -1
            b = int(buf[i])
            w = int(widths[b])
            if w <= 4 and i + 5 <= size:  # fixint, uint 8/16/32: the usual ids, without a branch on which
                x = (int(buf[i + 1]) << 24) | (int(buf[i + 2]) << 16) | (int(buf[i + 3]) << 8) | int(buf[i + 4])
                v = (x >> (32 - 8 * w)) if w else b
                i += 1 + w
            elif b <= 0x7F:  # positive fixint
                v = b
                i += 1
            elif 0xCC <= b <= 0xD3:  # uint 8/16/32/64, int 8/16/32/64
                width = 1 << ((b - 0xCC) & 3)
                if i + 1 + width > size or (b >= 0xD0 and buf[i + 1] >= 0x80):  # cut, or negative
                    return -1
                v = 0
                for j in range(width):
                    byte = int(buf[i + 1 + j])
                    if j < width - 4 and byte:  # 8 bytes: the high half must be zero
                        return -1
                    v = (v << 8) | byte
                i += 1 + width
            else:
                return -1
            out[k] = v
            k += 1
    return k


try:  # compiled code cached beside this file; a read-only install compiles at each start instead
    _run = numba.njit(cache=True, nogil=True)(_run_py)
    _unpack = numba.njit(cache=True, nogil=True)(_unpack_py)
except RuntimeError:
    _run = numba.njit(nogil=True)(_run_py)
    _unpack = numba.njit(nogil=True)(_unpack_py)

_ENCODE_IDS = msgspec.msgpack.Encoder().encode
_WIDTHS = np.full(256, 5, dtype=np.uint8)
_WIDTHS[:0x80] = 0  # positive fixint
_WIDTHS[0xCC], _WIDTHS[0xCD], _WIDTHS[0xCE] = 1, 2, 4  # uint 8/16/32


def states_many(seeds: Sequence[int], token_lists: Sequence[Sequence[int]], step: int) -> list[list[int]] | None:
    """:data:`kvcm.cache.keys.NativeStates`: per list, the states after every ``step`` tokens
    from its seed; None if a token id is outside ``0 .. 2**32 - 1`` or not an int (Python
    hashes it then). :class:`~kvcm.proto.kv_events.PackedTokens` are read as they came."""
    arrays: list[Any] = []
    lengths = []
    try:
        for t in token_lists:
            if type(t) is PackedTokens:
                arrays += t.raws
            else:
                arrays.append(_ENCODE_IDS(t if type(t) is list else list(t)))
            lengths.append(len(t))
    except (OverflowError, TypeError):  # beyond 64 bits, or not ints
        return None
    tokens = np.empty(sum(lengths), dtype=np.uint32)
    if _unpack(np.frombuffer(b"".join(arrays), dtype=np.uint8), tokens, _WIDTHS) != len(tokens):
        return None
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    counts = [n // step for n in lengths]
    out = np.empty(sum(counts), dtype=np.uint64)
    _run(np.array([s & _M64 for s in seeds], dtype=np.uint64), tokens, offsets, step, out)
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
