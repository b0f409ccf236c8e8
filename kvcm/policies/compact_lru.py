"""Exact ``lru`` with no Python object per block: the reclaimer's online LRU.

:class:`~kvcm.policies.lru.LRU` keeps an ``OrderedDict``: fast (every operation one C-level
dict call) but ~91 bytes of entry plus the key's int object (~36 bytes) per tracked block, at
every block a server serves. :class:`CompactLRU` chooses the very same victims, in the same
order, for every stream of operations, from flat ``array`` buffers (~37-50 bytes per block):

* dense entries, one per tracked key: ``_lo`` (the key's low 64 bits), ``_hi`` (the part above
  bit 64: stored as is below ``2**31``, else a code into ``_big_hi``), ``_size``, and ``_pos``
  (where the entry's live record sits in the access log; -1 for a free entry, reused through
  ``_free``);
* an open-addressing index ``_slots`` (power-of-two length, load at most 1/2, linear probing):
  -1 empty, -2 a tombstone, else an entry number. A key's first slot is the low bits of
  ``hash((key,))``: the tuple hash mixes all the int's bits (an int's own hash does not: keys
  that differ only above the mask would all collide) and is one C call, cheaper than
  multiplicative hashing in Python's big-int arithmetic;
* the access log ``_log``: an entry number appended on every write and access. Entry ``e``'s
  live record is the one at ``_pos[e]``, older ones are stale; the LRU order is the log order of
  the live records. The log is compacted (live records only, same order) when it holds more
  than twice the live entries plus a constant, so stale records cost amortised O(1).

Keys are non-negative ints of any size (the reclaimer's ``GroupState.key_of`` packs the
instance's index above bit 64). ``sizes`` is a read-only mapping view (``in``, ``[]``, ``get``,
``len``, iteration and ``items()`` in recency order, least recent first, like ``LRU.sizes``).
``dump``/``load`` use ``LRU``'s format, so a snapshot taken by one loads into the other.

Python-level probing makes each operation 2-4 times slower than the ``OrderedDict``'s C calls.
Two memories spare probes where the reclaimer looks keys up again: the key found last (by
identity: ``key in sizes`` then ``access_many``; ``[]`` then ``on_remove``), and a bounded memo
key -> entry (a C dict lookup) of the keys read lately and of the last victims. Reads are what
the reclaimer folds most, and they are skewed: the same prompt prefixes are read request after
request, so a few thousand memo entries answer nearly every read without a probe. Each victim's
size, ``in`` and ``on_remove`` follow its choice, so victims are memoised too. The memo is
cleared whole when full (``_MEMO`` entries, well under a megabyte: a constant, not per block).
The offline optimizer keeps ``LRU``: its replay speed depends on the C calls.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

from kvcm.policies.base import BasePolicy

_M64 = (1 << 64) - 1
_DIRECT = 1 << 31  # high parts below this are stored as they are; the rest get a code
_EMPTY, _TOMB = -1, -2
_NARROW = "i"  # 4-byte entry numbers and log positions while they fit ...
_WIDE = "q"  # ... 8-byte ones past _NARROW_MAX live entries (log positions reach 2 * live + slack)
_NARROW_MAX = 1 << 29
_SLACK = 1024  # stale log records allowed beyond 2 * live before a compaction
_COMPACT_SLICE = 1 << 16  # log records turned into a list at a time by _compact
_MEMO = 16384  # keys remembered by value, read lately or chosen as victims (see CompactLRU._memo)


class _Sizes:
    """``CompactLRU.sizes``: the read-only mapping key -> size, in recency order.

    Like a dict, it must not be iterated while the policy changes (a write or an access during
    the iteration raises ``RuntimeError``; a removed key is skipped).
    """

    __slots__ = ("_p",)

    def __init__(self, policy: CompactLRU) -> None:
        self._p = policy

    def __contains__(self, key: object) -> bool:
        return self._p._find(key) >= 0

    def __getitem__(self, key: Hashable) -> int:
        p = self._p
        e = p._find(key)
        if e < 0:
            raise KeyError(key)
        return p._size[e]

    def get(self, key: Hashable, default: int | None = None) -> int | None:
        p = self._p
        e = p._find(key)
        return default if e < 0 else p._size[e]

    def __len__(self) -> int:
        return self._p._live

    def __iter__(self) -> Iterator[Hashable]:
        p = self._p
        return map(p._key, p._order())

    def keys(self) -> Iterator[Hashable]:
        return iter(self)

    def values(self) -> Iterator[int]:
        size = self._p._size
        return (size[e] for e in self._p._order())

    def items(self) -> Iterator[tuple[Hashable, int]]:
        p = self._p
        key, size = p._key, p._size
        return ((key(e), size[e]) for e in p._order())

    def __repr__(self) -> str:
        return f"<CompactLRU.sizes {self._p._live} keys>"


def _probe(key: int, slots: array[int], los: array[int], his: array[int], mask: int) -> int:
    """The entry of ``key`` (a plain int whose high part is stored as is), or -1: the index
    probe of :meth:`CompactLRU._find` without its memories, for reads that missed the memo."""
    lo, hi = key & _M64, key >> 64
    i = hash((key,)) & mask
    while True:
        slot = slots[i]
        if slot >= 0:
            if los[slot] == lo and his[slot] == hi:
                return slot
        elif slot == _EMPTY:
            return -1
        i = (i + 1) & mask


class CompactLRU(BasePolicy):
    """Exact least recently used over non-negative int keys; reads and writes both refresh.

    Same victims as ``LRU()`` (exact mode) for every stream of operations.
    """

    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.sizes = _Sizes(self)  # type: ignore[assignment]  # a view, not a dict: see _Sizes
        self._big: dict[int, int] = {}  # high part >= _DIRECT -> its code (_DIRECT + n)
        self._big_hi: list[int] = []
        self._reset(0)

    def _reset(self, capacity: int) -> None:
        """Empty arrays, the index sized for ``capacity`` live entries."""
        wide = _WIDE if capacity >= _NARROW_MAX else _NARROW
        self._lo = array("Q")
        self._hi = array("I")
        self._size = array("q")
        self._pos = array(wide)
        self._free = array(wide)
        self._log = array(wide)
        self._head = 0  # the log before it holds stale records only
        self._live = 0
        self.size_total = 0
        bits = 3
        while (1 << bits) < 4 * capacity:  # load 1/4 at most: room to grow to 1/2
            bits += 1
        self._slots = array(wide, [_EMPTY]) * (1 << bits)
        self._mask = (1 << bits) - 1
        self._used = 0  # slots not empty: live entries and tombstones
        self._last: object = None  # the key found last (identity), its entry and its slot
        self._last_e = self._last_i = -1
        # Entries by key value (a dict lookup, not a probe) of keys read lately and of the last
        # victims. An entry stays right until its key is removed (on_remove drops it) or the
        # entries are renumbered (_reset, which every renumbering goes through).
        self._memo: dict[int, int] = {}

    # -- keys ------------------------------------------------------------------------------

    def _key(self, e: int) -> int:
        hi = self._hi[e]
        if hi >= _DIRECT:
            hi = self._big_hi[hi - _DIRECT]
        return (hi << 64) | self._lo[e]

    def _new_code(self, hi: int) -> int:
        code = self._big.get(hi)
        if code is None:
            if len(self._big_hi) >= (1 << 32) - _DIRECT:
                raise ValueError("too many distinct key parts above bit 64")
            code = self._big[hi] = _DIRECT + len(self._big_hi)
            self._big_hi.append(hi)
        return code

    def _find(self, key: object) -> int:
        """The entry of ``key``, or -1."""
        if key is self._last:
            return self._last_e
        if type(key) is not int:
            return self._find(int(key)) if isinstance(key, int) else -1  # bools, int subclasses
        if self._memo:
            e = self._memo.get(key)
            if e is not None:
                self._last, self._last_e, self._last_i = key, e, -1  # the slot is looked for if needed
                return e
        lo, hi = key & _M64, key >> 64
        if not 0 <= hi < _DIRECT:
            if hi < 0:
                return -1
            hi = self._big.get(hi, -1)
            if hi < 0:
                return -1
        slots, los, his, mask = self._slots, self._lo, self._hi, self._mask
        i = hash((key,)) & mask  # the first slot: see the module docstring
        while True:
            e = slots[i]
            if e >= 0:
                if los[e] == lo and his[e] == hi:
                    self._last, self._last_e, self._last_i = key, e, i
                    return e
            elif e == _EMPTY:
                return -1
            i = (i + 1) & mask

    # -- the policy interface --------------------------------------------------------------

    def __len__(self) -> int:
        return self._live

    def __contains__(self, key: object) -> bool:
        return self._find(key) >= 0

    def on_write(
        self, key: Hashable, now: float, size: int = 1, parent: Hashable | None = None
    ) -> None:
        if key is self._last:
            e = self._last_e
        else:
            if type(key) is not int:
                if not isinstance(key, int):
                    raise TypeError(f"CompactLRU keys are ints, got {type(key).__name__}")
                key = int(key)  # a bool or an int subclass: the plain int it equals
            if key < 0:
                raise ValueError(f"CompactLRU keys are non-negative, got {key}")
            lo, hi = key & _M64, key >> 64
            if hi >= _DIRECT:
                hi = self._new_code(hi)
            slots, los, his, mask = self._slots, self._lo, self._hi, self._mask
            i = hash((key,)) & mask  # the first slot: see the module docstring
            free = -1  # the first tombstone on the way: where a new key goes
            while True:
                e = slots[i]
                if e >= 0:
                    if los[e] == lo and his[e] == hi:
                        break
                elif e == _EMPTY:
                    self._insert(lo, hi, size, i if free < 0 else free)
                    return
                elif free < 0:
                    free = i
                i = (i + 1) & mask
        self.size_total += size - self._size[e]
        self._size[e] = size
        log = self._log
        self._pos[e] = len(log)
        log.append(e)
        if len(log) > 2 * self._live + _SLACK:
            self._compact()

    def _insert(self, lo: int, hi: int, size: int, i: int) -> None:
        """A new entry (``hi`` coded), the most recent, at index slot ``i`` (empty or a tombstone)."""
        if self._live >= _NARROW_MAX and self._slots.typecode == _NARROW:
            self._rebuild(list(self._order()), 2 * self._live)
            self._add((self._big_hi[hi - _DIRECT] if hi >= _DIRECT else hi) << 64 | lo, size)
            return
        if self._free:
            e = self._free.pop()
            self._lo[e], self._hi[e], self._size[e] = lo, hi, size
        else:
            e = len(self._lo)
            self._lo.append(lo)
            self._hi.append(hi)
            self._size.append(size)
            self._pos.append(-1)
        slots = self._slots
        if slots[i] == _EMPTY:
            self._used += 1
        slots[i] = e
        self._live += 1
        self.size_total += size
        log = self._log
        self._pos[e] = len(log)
        log.append(e)
        if 2 * self._used > len(slots):
            self._rehash()
        elif len(log) > 2 * self._live + _SLACK:
            self._compact()

    def _add(self, key: int, size: int) -> None:
        """``key`` (a valid key, not tracked) as the most recent."""
        hi = key >> 64
        if hi >= _DIRECT:
            hi = self._new_code(hi)
        slots, mask = self._slots, self._mask
        i = hash((key,)) & mask  # the first slot: see the module docstring
        while slots[i] >= 0:
            i = (i + 1) & mask
        self._insert(key & _M64, hi, size, i)

    def on_access(self, key: Hashable, now: float) -> None:
        e = self._find(key)
        if e >= 0:
            log = self._log
            self._pos[e] = len(log)
            log.append(e)
            if len(log) > 2 * self._live + _SLACK:
                self._compact()

    def access_many(self, keys: Iterable[Hashable], now: float) -> None:
        find, pos, log = self._find, self._pos, self._log
        append, limit = log.append, 2 * self._live + _SLACK
        slots, los, his, mask = self._slots, self._lo, self._hi, self._mask
        memo = self._memo
        remembered = memo.get
        for key in keys:
            e = remembered(key)  # type: ignore[call-overload]  # any hashable: ints match
            if e is None:
                e = _probe(key, slots, los, his, mask) if type(key) is int and 0 <= key >> 64 < _DIRECT else find(key)
                if e < 0:
                    continue
                if len(memo) >= _MEMO:
                    memo.clear()
                memo[key] = e  # type: ignore[index]  # found: an int
            pos[e] = len(log)
            append(e)
            if len(log) > limit:
                self._compact()
                log = self._log
                append = log.append

    def on_remove(self, key: Hashable) -> None:
        if key is not self._last and self._find(key) < 0:
            return
        e, i, los, slots = self._last_e, self._last_i, self._lo, self._slots  # from _find
        if i < 0:  # found in _memo: the slot that holds e, on the key's probe path
            mask = self._mask
            i = hash((int(key),)) & mask  # type: ignore[call-overload]  # found: an int
            while slots[i] != e:
                i = (i + 1) & mask
        slots[i] = _TOMB
        if self._memo:
            self._memo.pop(key, None)  # type: ignore[call-overload]  # found: an int
        self._live -= 1
        self.size_total -= self._size[e]
        self._pos[e] = -1
        self._free.append(e)
        self._last, self._last_e, self._last_i = None, -1, -1
        if not self._live:
            self._reset(0)  # everything went: give the memory back
        elif 8 * self._live < len(los) and len(los) > 8 * _SLACK:
            self._rebuild(list(self._order()), self._live)  # mostly free: shrink

    def victims(self, n: int, now: float) -> list[Hashable]:
        out: list[Hashable] = []
        memo = self._memo
        if len(memo) + min(n, _MEMO) > _MEMO:
            memo.clear()
        if n <= 0:
            return out
        log, pos, los, his, key = self._log, self._pos, self._lo, self._hi, self._key
        j, end = self._head, len(log)
        while j < end and pos[log[j]] != j:  # the stale prefix: skipped for good
            j += 1
        self._head = j
        while j < end:
            e = log[j]
            if pos[e] == j:
                hi = his[e]
                k = (hi << 64) | los[e] if hi < _DIRECT else key(e)
                out.append(k)
                if len(out) <= _MEMO:
                    memo[k] = e
                if len(out) == n:
                    break
            j += 1
        return out

    def evict(self, n: int, now: float) -> list[Hashable]:
        chosen = self.victims(n, now)
        for key in chosen:
            self.on_remove(key)
        return chosen

    # -- maintenance -----------------------------------------------------------------------

    def _order(self) -> Iterator[int]:
        """Live entries, least recent first (see :class:`_Sizes` about changes meanwhile)."""
        log, pos = self._log, self._pos
        end = len(log)
        for j in range(self._head, end):
            if self._log is not log or len(log) != end:
                raise RuntimeError("CompactLRU changed during iteration")
            e = log[j]
            if pos[e] == j:
                yield e

    def _compact(self) -> None:
        """The log with live records only, same order, and ``_pos`` renumbered to match.

        It runs every ~``live + _SLACK`` appends over the whole log, so its cost per record is
        part of every read's: a comprehension over plain lists is about twice as fast as the
        ``_order`` generator over the arrays. The lists are made a slice at a time, so the
        transient memory stays bounded whatever the log's length."""
        log, pos = self._log, self._pos
        live = array(log.typecode)
        for start in range(self._head, len(log), _COMPACT_SLICE):
            part = log[start:start + _COMPACT_SLICE].tolist()
            live.extend([e for j, e in enumerate(part, start) if pos[e] == j])
        for j, e in enumerate(live):
            pos[e] = j
        self._log, self._head = live, 0

    def _rehash(self) -> None:
        """A fresh index (tombstones dropped), at load 1/4 at most."""
        size = len(self._slots)
        while size < 4 * self._live:
            size *= 2
        slots = array(self._slots.typecode, [_EMPTY]) * size
        mask = size - 1
        key, pos = self._key, self._pos
        for e in range(len(self._lo)):
            if pos[e] >= 0:
                i = hash((key(e),)) & mask
                while slots[i] != _EMPTY:
                    i = (i + 1) & mask
                slots[i] = e
        self._slots, self._mask, self._used = slots, mask, self._live
        self._last, self._last_e, self._last_i = None, -1, -1  # its slot moved

    def _rebuild(self, order: list[int], capacity: int) -> None:
        """Renumber the live entries ``order`` (recency order) densely, everything sized afresh."""
        rows = [(self._key(e), self._size[e]) for e in order]
        self._reset(capacity)
        for key, size in rows:
            self._add(key, size)

    def dump(self, key: Callable[[Hashable], object] = lambda k: k) -> dict[str, object]:
        """``LRU``'s format (sizes in recency order, no sequence, no candidates)."""
        return {"sizes": [[key(k), v] for k, v in self.sizes.items()], "clock": self._clock,
                "seq": 0, "cand": None}

    def load(self, state: dict[str, Any], key: Callable[[object], Hashable] = lambda k: k) -> None:
        rows = [(key(k), v) for k, v in state["sizes"]]
        self._reset(len(rows))
        self._big.clear()
        self._big_hi.clear()
        for k, size in rows:
            self.on_write(k, 0.0, size)
        self._clock = state["clock"]

    def _dump(self, key: Callable[[Hashable], object]) -> dict[str, object]:
        return {}  # dump() is overridden whole

    def _load(self, state: dict[str, Any], key: Callable[[object], Hashable]) -> None:
        pass  # load() is overridden whole

    def check(self) -> None:
        order = list(self._order())
        assert len(order) == self._live == len(set(order)), (len(order), self._live)
        assert all(self._pos[e] >= 0 for e in order)
        assert sum(p >= 0 for p in self._pos) == self._live, "a live entry is missing from the log"
        assert len(self._free) + self._live == len(self._lo) == len(self._hi) == len(self._size)
        assert all(self._pos[e] < 0 for e in self._free)
        assert self.size_total == sum(self._size[e] for e in order)
        assert all(self._size[e] >= 0 for e in order)
        assert sum(e >= 0 for e in self._slots) == self._live
        assert all(self._pos[e] >= 0 and self._key(e) == k for k, e in self._memo.items())
        assert len(self._memo) <= _MEMO
        assert sum(e != _EMPTY for e in self._slots) == self._used <= len(self._slots) // 2
        self._last, self._last_e, self._last_i = None, -1, -1  # find each key by probing, not from memory
        memo, self._memo = self._memo, {}
        try:
            for e in order:
                assert self._find(self._key(e)) == e
        finally:
            self._memo = memo
            self._last, self._last_e, self._last_i = None, -1, -1


__all__ = ["CompactLRU"]
