"""The query side of the engine index: which (source, medium, group) holds which kvcm key.

One :class:`HolderTable` per ``(instance_id, lora_name)`` namespace. Every holder is a *slot*
``(source_id, medium, group_idx)`` with a small integer id, and ``holders[key]`` is an int bit
mask of the slots holding ``key``. A longest-prefix query for all sources at once is then one
walk over the query keys with a shrinking ``active`` mask: a slot's match length is the position
where its bit first drops out. Cost ``O(len(keys) + slots)`` int operations, independent of the
number of blocks held, which is what keeps ``match_engines`` on 100 sources close to a single
storage-tier ``prefix_match``.

Holdings are reference counted per slot and key, because one slot can reach the same kvcm key
through several engine blocks (duplicate stores, re-chunked blocks, multimodal variants). The
slot's bit in ``holders[key]`` is its first holding; only holdings beyond the first are counted
(``extra``), so the common store, of keys the slot does not hold yet, is a single dict update
with no per-slot map of every key held. The table does not know a slot's keys: whoever drops a
slot that still holds keys clears them first (:meth:`forget`), the engine index from its blocks.

Thread ownership: none of its own; :class:`~kvcm.engines.index.EngineIndex` guards it with its lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from kvcm.engines.keytable import KeyTable

#: KV-cache group kinds that carry the prefix (Dynamo's "main attention"). A source that only
#: ever sent one group is matched on it by the walk when its kind is one of these; a source of
#: several groups (a hybrid model) is matched by :mod:`kvcm.engines.hybrid` instead.
MAIN_KINDS = frozenset({None, "full_attention", "mla_attention", "sink_full_attention"})
#: Deferred holds and releases (keys) past which a table applies them without waiting for a
#: read: a batch this large pays the compact table's fixed cost per call a few times over.
SETTLE_AT = 4096
#: Query filters whose allowed-slot mask is kept per table: each filter is a request's media,
#: so without a bound distinct filters would grow the table's memory with every query.
_MAX_FILTERS = 256


@dataclass(frozen=True)
class Slot:
    source_id: str
    medium: str
    group: int
    main: bool  # counted by the default walk (a single-group source's main-kind group)
    dp_rank: int = 0
    hybrid: bool = False  # its source has several groups: matched by kvcm.engines.hybrid


class HolderTable:
    """Key -> bit mask of holder slots, for one ``(instance_id, lora_name)`` namespace."""

    def __init__(self) -> None:
        # numba and numpy load with the first table, not with kvcm: a server that follows no
        # engine never pays for them
        from kvcm.engines.compact import CompactTable

        self._compact = CompactTable()
        # deferred holds and releases: their keys in order, and (slot, keys) runs over them
        self._hold_keys: list[int] = []
        self._hold_runs: list[tuple[int, int]] = []
        self._release_keys: list[int] = []
        self._release_runs: list[tuple[int, int]] = []
        self.slots: list[Slot | None] = []
        self.slot_ids: dict[tuple[str, str, int], int] = {}
        self._free: list[int] = []
        self.hybrid_slots = 0  # slots of hybrid sources: the default walk alone cannot answer for them
        self._hybrid: dict[str, dict[tuple[str, int], int]] | None = None  # hybrid_sources(), kept
        self._allowed: dict[tuple[frozenset[str] | None, int | None], tuple[int, bool]] = {}

    # --- slots ------------------------------------------------------------------------------

    def slot(self, source_id: str, medium: str, group: int, main: bool, dp_rank: int = 0, hybrid: bool = False) -> int:
        """The id of the slot, allocated on first use (ids of freed slots are reused)."""
        key = (source_id, medium, group)
        sid = self.slot_ids.get(key)
        if sid is not None:
            return sid
        sid = self._free.pop() if self._free else len(self.slots)
        if sid == len(self.slots):
            self.slots.append(None)
        self._allowed.clear()
        self._hybrid = None
        self.slots[sid] = Slot(source_id, medium, group, main, dp_rank, hybrid)
        self.hybrid_slots += hybrid
        self.slot_ids[key] = sid
        return sid

    def drop_slot(self, sid: int) -> None:
        """Free the slot's id; it holds no key any more (released, or cleared by :meth:`forget`)."""
        if self._hold_runs or self._release_runs:
            self.settle()
        slot = self.slots[sid]
        if slot is not None:
            del self.slot_ids[(slot.source_id, slot.medium, slot.group)]
            self.hybrid_slots -= slot.hybrid
        self.slots[sid] = None
        self._free.append(sid)
        self._allowed.clear()
        self._hybrid = None

    def forget(self, bits: int, keys: Iterable[int]) -> None:
        """Clear the slots in ``bits`` from ``keys`` (their slots are about to be dropped)."""
        self.settle()
        keys = list(keys)
        while bits:
            low = bits & -bits
            bits ^= low
            self._compact.forget(low.bit_length() - 1, keys)

    def source_slots(self, source_id: str) -> list[int]:
        self.settle()  # a slot a deferred release empties is gone once settled
        return [sid for (src, _, _), sid in self.slot_ids.items() if src == source_id]

    def mark_hybrid(self, source_id: str) -> None:
        """The source turned out to have several groups: none of its slots is counted by the
        default walk any more (:mod:`kvcm.engines.hybrid` answers for it)."""
        for sid in self.source_slots(source_id):
            slot = self.slots[sid]
            if slot is not None and not slot.hybrid:
                self.slots[sid] = replace(slot, main=False, hybrid=True)
                self.hybrid_slots += 1
        self._allowed.clear()
        self._hybrid = None

    def hybrid_sources(self) -> dict[str, dict[tuple[str, int], int]]:
        """Per hybrid source, its slots by ``(medium, group)`` (kept until a slot changes; not to
        be changed by the caller)."""
        self.settle()
        if self._hybrid is not None:
            return self._hybrid
        out: dict[str, dict[tuple[str, int], int]] = {}
        if self.hybrid_slots:
            for (source_id, medium, group), sid in self.slot_ids.items():
                slot = self.slots[sid]
                if slot is not None and slot.hybrid:
                    out.setdefault(source_id, {})[(medium, group)] = sid
        self._hybrid = out
        return out

    @property
    def empty(self) -> bool:
        return not self.slot_ids

    # --- holdings -------------------------------------------------------------------------------
    # Holds and releases are deferred and applied in one batch over every slot (:meth:`settle`):
    # the compact table's fixed cost per call (array conversion, a kernel call) is several µs,
    # which a store of 16 keys would pay for each event. Holds first, then releases, give the
    # counts the events' order gives, because a release always matches a holding that exists
    # before it (the engine index releases only keys a block of the slot holds).

    def hold(self, sid: int, keys: Sequence[int]) -> None:
        self._hold_keys.extend(keys)
        self._hold_runs.append((sid, len(keys)))
        if len(self._hold_keys) + len(self._release_keys) >= SETTLE_AT:
            self.settle()

    def release(self, sid: int, keys: Sequence[int]) -> None:
        self._release_keys.extend(keys)
        self._release_runs.append((sid, len(keys)))
        if len(self._hold_keys) + len(self._release_keys) >= SETTLE_AT:
            self.settle()

    def settle(self) -> None:
        """Apply the deferred holds and releases, each in one compiled batch over every slot
        (every read does, first); a slot a release left holding nothing is dropped."""
        if not self._hold_runs and not self._release_runs:
            return
        if self._hold_runs:
            keys, runs = self._hold_keys, self._hold_runs
            self._hold_keys, self._hold_runs = [], []
            self._compact.hold_many(_run_slots(runs), keys)
        if self._release_runs:
            keys, runs = self._release_keys, self._release_runs
            self._release_keys, self._release_runs = [], []
            self._compact.release_many(_run_slots(runs), keys)
            for sid in {sid for sid, _ in runs}:
                if not self._compact.count(sid) and self.slots[sid] is not None:
                    self.drop_slot(sid)

    def count(self, sid: int) -> int:
        """Distinct keys the slot holds."""
        self.settle()
        return self._compact.count(sid)

    @property
    def holders(self) -> dict[int, int]:
        """Every key and its holder mask (tests and tools: built on each call)."""
        self.settle()
        return self._compact.holders()

    @property
    def key_table(self) -> KeyTable:
        """The namespace's keys (rows, positions): where migrated blocks keep their key."""
        return self._compact.keys

    def masks(self, keys: Sequence[int]) -> list[int]:
        """Each key's holder mask (0: nobody)."""
        self.settle()
        return self._compact.masks(keys)

    # --- queries --------------------------------------------------------------------------------

    def allowed(self, media: frozenset[str] | None, group: int | None) -> int:
        """Mask of the slots a query may count: main-kind groups unless ``group`` is given."""
        self.settle()
        cached = self._allowed.get((media, group))
        if cached is not None:
            return cached[0]
        return self._allowed_entry(media, group)[0]

    def single_slot_sources(self, media: frozenset[str] | None, group: int | None) -> bool:
        """True if no source has two allowed slots (then entries never need merging)."""
        self.settle()
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
        if len(self._allowed) >= _MAX_FILTERS:
            self._allowed.clear()
        self._allowed[(media, group)] = entry
        return entry

    def longest_prefixes(self, keys: Sequence[int], allowed: int) -> list[tuple[int, int]]:
        """``(length, bits)`` pairs, ascending: the slots in ``bits`` hold exactly the first
        ``length`` keys (length > 0). Every allowed slot with a match appears once."""
        return [(n, before & ~after) for n, before, after in self.runs(keys, allowed)]

    def runs(self, keys: Iterable[int], allowed: int) -> list[tuple[int, int, int]]:
        """``(length, before, after)`` triples, ascending: the running AND of the allowed slots'
        holder masks over the first ``length`` keys is ``before``, over one key more ``after``
        (0 past the last key), so the slots in ``before`` and not in ``after`` hold exactly
        ``length`` keys. Only where the running AND changes is there a triple.

        The keys are looked up lazily and grouped (``groupby``: C-level, identity first) into
        stretches of one mask: Python runs once per stretch, about one per slot when engines
        hold contiguous prefixes, and no key past the point where no slot is left is looked up.
        """
        self.settle()
        return self._compact.runs(list(keys), allowed)

    def holders_of(self, key: int, allowed: int) -> list[Slot]:
        mask = self.masks([key])[0] & allowed
        out = []
        while mask:
            low = mask & -mask
            slot = self.slots[low.bit_length() - 1]
            if slot is not None:
                out.append(slot)
            mask ^= low
        return out


def _run_slots(runs: list[tuple[int, int]]) -> npt.NDArray[np.int64]:
    """The slot of each key of ``(slot, keys)`` runs, as the compact table's batches take them."""
    import numpy as np  # loaded with the first table (HolderTable.__init__)

    sids, lens = zip(*runs)
    return np.repeat(np.array(sids, dtype=np.int64), lens)
