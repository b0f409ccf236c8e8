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

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import compress, count, islice, repeat
from operator import ne, or_

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
        self._allowed: dict[tuple[frozenset[str] | None, int | None], tuple[int, bool]] = {}

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

    def hold(self, sid: int, keys: Sequence[int]) -> None:
        refs, holders, bit = self.refs[sid], self.holders, 1 << sid
        if refs.keys().isdisjoint(keys):
            # The common case (keys the slot does not hold yet): C-level iteration only.
            before = len(refs)
            refs.update(zip(keys, repeat(1)))
            if len(refs) - before != len(keys):  # a key given twice holds twice
                refs.update(Counter(keys))
            holders.update(zip(keys, map(or_, map(holders.get, keys, repeat(0)), repeat(bit))))
            return
        for key in keys:
            count = refs.get(key, 0)
            refs[key] = count + 1
            if not count:
                holders[key] = holders.get(key, 0) | bit

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
            return cached[0]
        return self._allowed_entry(media, group)[0]

    def single_slot_sources(self, media: frozenset[str] | None, group: int | None) -> bool:
        """True if no source has two allowed slots (then entries never need merging)."""
        cached = self._allowed.get((media, group))
        return (cached if cached is not None else self._allowed_entry(media, group))[1]

    def _allowed_entry(self, media: frozenset[str] | None, group: int | None) -> tuple[int, bool]:
        mask = 0
        sources = set()
        for sid, slot in enumerate(self.slots):
            if slot is None or (media is not None and slot.medium not in media):
                continue
            if slot.main if group is None else slot.group == group:
                mask |= 1 << sid
                sources.add(slot.source_id)
        entry = (mask, len(sources) == mask.bit_count())
        self._allowed[(media, group)] = entry
        return entry

    def longest_prefixes(self, keys: Sequence[int], allowed: int) -> list[tuple[int, int]]:
        """``(length, bits)`` pairs, ascending: the slots in ``bits`` hold exactly the first
        ``length`` keys (length > 0). Every allowed slot with a match appears once.

        Only C-level iteration touches every key: the holder masks (``map``) and the positions
        where the mask differs from the previous key's (``compress``). The running AND of the
        masks can only change at those positions, so Python visits just them: about one per
        slot when engines hold contiguous prefixes.
        """
        if not keys or not allowed:
            return []
        masks = list(map(self.holders.get, keys, repeat(0, len(keys))))
        running = masks[0] & allowed
        out: list[tuple[int, int]] = []
        if not running:
            return out
        for i in compress(count(1), map(ne, masks, islice(masks, 1, None))):
            kept = running & masks[i]
            if kept != running:  # these slots hold keys 0..i-1 but not key i
                out.append((i, running & ~kept))
                if not kept:
                    return out
                running = kept
        out.append((len(keys), running))
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
