"""The query side of the engine index: which (source, medium, group) holds which kvcm key.

One :class:`HolderTable` per ``(instance_id, lora_name)`` namespace. Every holder is a *slot*
``(source_id, medium, group_idx)`` with a small integer id, and ``holders[key]`` is an int bit
mask of the slots holding ``key``. A longest-prefix query for all sources at once is then one
walk over the query keys with a shrinking ``active`` mask: a slot's match length is the position
where its bit first drops out. Cost ``O(len(keys) + slots)`` int operations, independent of the
number of blocks held, which is what keeps ``match_engines`` on 100 sources close to a single
storage-tier ``prefix_match``.

Holdings are reference counted per slot and key, because one slot can reach the same kvcm key
through several engine blocks (duplicate stores, re-chunked blocks, multimodal variants).

Thread ownership: none of its own; :class:`~kvcm.engines.index.EngineIndex` guards it with its lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate, compress, count, islice, repeat
from operator import and_, ne

#: KV-cache group kinds that carry the prefix (Dynamo's "main attention"); SWA / mamba groups
#: evict differently and are matched only when asked for by ``group_idx``.
MAIN_KINDS = frozenset({None, "full_attention", "mla_attention", "sink_full_attention"})


@dataclass(frozen=True)
class Slot:
    source_id: str
    medium: str
    group: int
    main: bool
    dp_rank: int = 0


class HolderTable:
    """Key -> bit mask of holder slots, for one ``(instance_id, lora_name)`` namespace."""

    def __init__(self) -> None:
        self.holders: dict[int, int] = {}
        self.slots: list[Slot | None] = []
        self.refs: list[dict[int, int]] = []
        self.slot_ids: dict[tuple[str, str, int], int] = {}
        self._free: list[int] = []
        self._allowed: dict[tuple[frozenset[str] | None, int | None], int] = {}

    # --- slots ------------------------------------------------------------------------------

    def slot(self, source_id: str, medium: str, group: int, main: bool, dp_rank: int = 0) -> int:
        """The id of the slot, allocated on first use (ids of freed slots are reused)."""
        key = (source_id, medium, group)
        sid = self.slot_ids.get(key)
        if sid is not None:
            return sid
        sid = self._free.pop() if self._free else len(self.slots)
        if sid == len(self.slots):
            self.slots.append(None)
            self.refs.append({})
        self._allowed.clear()
        self.slots[sid] = Slot(source_id, medium, group, main, dp_rank)
        self.refs[sid] = {}
        self.slot_ids[key] = sid
        return sid

    def drop_slot(self, sid: int) -> None:
        """Forget every holding of the slot and free its id."""
        clear = ~(1 << sid)
        holders = self.holders
        for key in self.refs[sid]:
            mask = holders.get(key, 0) & clear
            if mask:
                holders[key] = mask
            else:
                holders.pop(key, None)
        slot = self.slots[sid]
        if slot is not None:
            del self.slot_ids[(slot.source_id, slot.medium, slot.group)]
        self.slots[sid] = None
        self.refs[sid] = {}
        self._free.append(sid)
        self._allowed.clear()

    def source_slots(self, source_id: str) -> list[int]:
        return [sid for (src, _, _), sid in self.slot_ids.items() if src == source_id]

    @property
    def empty(self) -> bool:
        return not self.slot_ids

    # --- holdings -------------------------------------------------------------------------------

    def hold(self, sid: int, keys: Iterable[int]) -> None:
        refs, holders, bit = self.refs[sid], self.holders, 1 << sid
        for key in keys:
            count = refs.get(key, 0)
            refs[key] = count + 1
            if not count:
                holders[key] = holders.get(key, 0) | bit
        return None

    def release(self, sid: int, keys: Iterable[int]) -> None:
        refs, holders, clear = self.refs[sid], self.holders, ~(1 << sid)
        for key in keys:
            count = refs.get(key, 0)
            if count > 1:
                refs[key] = count - 1
            elif count == 1:
                del refs[key]
                mask = holders.get(key, 0) & clear
                if mask:
                    holders[key] = mask
                else:
                    holders.pop(key, None)

    def count(self, sid: int) -> int:
        """Distinct keys the slot holds."""
        return len(self.refs[sid])

    # --- queries --------------------------------------------------------------------------------

    def allowed(self, media: frozenset[str] | None, group: int | None) -> int:
        """Mask of the slots a query may count: main-kind groups unless ``group`` is given."""
        cached = self._allowed.get((media, group))
        if cached is not None:
            return cached
        mask = 0
        for sid, slot in enumerate(self.slots):
            if slot is None or (media is not None and slot.medium not in media):
                continue
            if slot.main if group is None else slot.group == group:
                mask |= 1 << sid
        self._allowed[(media, group)] = mask
        return mask

    def longest_prefixes(self, keys: Sequence[int], allowed: int) -> list[tuple[int, int]]:
        """``(length, bits)`` pairs, ascending: the slots in ``bits`` hold exactly the first
        ``length`` keys (length > 0). Every allowed slot with a match appears once.

        Only C-level iteration touches every key: the holder masks (``map``), their running AND
        (``accumulate``; it only loses bits, so it is non-increasing) and the positions where it
        changes (``compress``). Python then visits each change, at most one per slot.
        """
        if not keys or not allowed:
            return []
        running = list(accumulate(map(self.holders.get, keys, repeat(0, len(keys))), and_, initial=allowed))
        changes = compress(count(), map(ne, running, islice(running, 1, None)))
        out = []
        for i in changes:  # running[i] -> running[i + 1] lost bits: those slots matched i keys
            if i:
                out.append((i, running[i] & ~running[i + 1]))
            if not running[i + 1]:
                return out
        out.append((len(keys), running[-1]))
        return out

    def holders_of(self, key: int, allowed: int) -> list[Slot]:
        mask = self.holders.get(key, 0) & allowed
        out = []
        while mask:
            low = mask & -mask
            slot = self.slots[low.bit_length() - 1]
            if slot is not None:
                out.append(slot)
            mask ^= low
        return out
