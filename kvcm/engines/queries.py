"""Queries of the engine index: ``match_engines`` (the per-source walk and the ranked fast path)
and the engines holding each key for ``get_cache_location``."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from operator import attrgetter

from kvcm.engines.entries import SourceMatch, normalize_medium
from kvcm.engines.hybrid import Holdings, answer
from kvcm.engines.indexstate import IndexState, Run, RunMemo
from kvcm.engines.scoring import ENTRY, POD_ENTRY, Fragment, fragment
from kvcm.engines.table import HolderTable, Slot
from kvcm.errors import KvcmError

_MAX_RUNS = 65_536  # memoised runs per table (a few hundred bytes each), then started afresh
_MAX_RUN_TABLES = 4096  # (instance, adapter) namespaces whose runs are kept
_BY_SOURCE = attrgetter("source_id")
_BY_MATCH = attrgetter("matched_blocks")


#: One engine holding a key, as ``get_cache_location(include_engines=true)`` names it
#: (``source_id``, ``medium``, ``group_idx``).
EngineLocation = dict[str, str | int]


class IndexQueries(IndexState):
    """Reads of the index, under its lock."""

    def match(
        self,
        instance_id: str,
        keys: Sequence[int],
        *,
        lora_name: str | None = None,
        media: Iterable[str] | None = None,
        group_idx: int | None = None,
        exclude: Collection[str] = (),
    ) -> list[SourceMatch]:
        """Per source, the longest prefix of ``keys`` it holds, per medium; best first.

        Sources holding nothing of the prefix are left out. ``matched_blocks`` is the source's
        best medium; ties are ordered by source id. ``O(len(keys))`` C-level steps plus
        ``O(matching slots)`` Python steps. Without ``group_idx``, a hybrid source's prefix is
        the one all its groups can reuse (:mod:`kvcm.engines.hybrid`), listed with its groups'
        detail as soon as one of its groups holds the first key, even when that prefix is 0.
        """
        wanted = None if media is None else frozenset(normalize_medium(m) for m in media)
        with self._lock:
            table = self._tables.get((instance_id, lora_name or ""))
            if table is None:
                return []
            runs = table.longest_prefixes(keys, table.allowed(wanted, group_idx) & ~_mask(table, exclude))
            per_source = _per_source(runs, table.slots)
            if group_idx is None and table.hybrid_slots:
                for source_id, found in self._hybrid(instance_id, table, keys, wanted, exclude):
                    per_source[source_id] = found
        out = sorted(per_source.values(), key=_BY_SOURCE)
        out.sort(key=_BY_MATCH, reverse=True)  # stable: ties stay in source id order
        return out

    def _hybrid(
        self,
        instance_id: str,
        table: HolderTable,
        keys: Sequence[int],
        wanted: frozenset[str] | None,
        exclude: Collection[str],
    ) -> list[tuple[str, SourceMatch]]:
        """The table's hybrid sources that hold the query's first key in some group, each with
        the prefix all its groups can reuse (:func:`kvcm.engines.hybrid.answer`)."""
        try:
            block_size = int(self._block_size_of(instance_id))
        except KvcmError:
            return []
        rows = Holdings(table.masks(keys), len(table.slots))
        out = []
        for source_id, slots in table.hybrid_sources().items():
            state = self._sources.get(source_id)
            if state is None or source_id in exclude or block_size <= 0:
                continue
            found = answer(state.groups, state.spec.report_mode, slots, rows, block_size, wanted)
            if found is not None:
                best = max(found.media.values(), default=0)
                out.append((source_id, SourceMatch(source_id, state.spec.dp_rank, best, found.media, found.groups,
                                                   found.unsupported)))  # fmt: skip
        return out

    def ranked(
        self,
        instance_id: str,
        keys: Sequence[int],
        *,
        block_size: int,
        weight: Callable[[str], float],
        lora_name: str | None = None,
        media: Iterable[str] | None = None,
        group_idx: int | None = None,
        exclude: Collection[str] = (),
    ) -> tuple[list[Run], bool] | None:
        """``match_engines``' fast path: the matching sources as :data:`Run` s, longest match
        first, each run's sources in source id order (so that a stable sort by score, best
        first, keeps that order among equal scores), and whether every slot of the table has
        the same weight (then that order *is* the ranking). None if a source has several
        allowed slots (media or groups to merge): use :meth:`match`.

        Only C-level iteration touches the keys (:meth:`HolderTable.runs`), and there is one
        memo lookup per *run* ``(length, running AND before and after it)``, whose fragments are
        kept while the table's slots stay the same (:meth:`_run_memo`). Python code runs per
        stretch of keys held alike and per run not seen before."""
        wanted = None if media is None else frozenset(normalize_medium(m) for m in media)
        lora = lora_name or ""
        with self._lock:
            table = self._tables.get((instance_id, lora))
            if table is None or not keys:
                return [], True
            if (group_idx is None and table.hybrid_slots) or not table.single_slot_sources(wanted, group_idx):
                return None
            allowed = table.allowed(wanted, group_idx)
            if exclude:
                allowed &= ~_mask(table, exclude)
            runs = table.runs(keys, allowed)
            memo, uniform = self._run_memo(instance_id, lora, table, block_size, weight)
            try:
                found = list(map(memo.__getitem__, runs))
            except KeyError:  # runs not seen before (rare): encode the missing ones
                found = [
                    memo.get(run) or self._run_fragments(memo, table.slots, run, block_size, weight) for run in runs
                ]
            if not found:
                return [], True
        found.reverse()
        return found, uniform

    def pods_distinct(self, instance_id: str) -> bool:
        """Whether every source of the instance is its own pod (no DP ranks to group), kept
        until a source is added."""
        known = self._pods_distinct.get(instance_id)
        if known is not None and known[0] == self._generation:
            return known[1]
        with self._lock:
            pods = [s.spec.pod or s.spec.source_id for s in self._sources.values() if s.spec.instance_id == instance_id]
            if len(self._pods_distinct) >= _MAX_RUN_TABLES:
                self._pods_distinct.clear()
            self._pods_distinct[instance_id] = (self._generation, len(pods) == len(set(pods)))
            return len(pods) == len(set(pods))

    def _run_memo(
        self, instance_id: str, lora: str, table: HolderTable, block_size: int, weight: Callable[[str], float]
    ) -> tuple[RunMemo, bool]:
        """The table's runs memo, emptied when a source was added (its pod may be new) or any
        slot id came to name another slot, and whether all its slots weigh the same. Slots
        compare by value (identity first, so the usual check is a C-level pass): an equal slot
        encodes the same fragments."""
        known = self._runs.get((instance_id, lora))
        if (
            known is None
            or known[0] is not table
            or known[1] != block_size
            or known[2] != self._generation
            or len(known[4]) >= _MAX_RUNS
            or known[3] != table.slots
        ):
            if len(self._runs) >= _MAX_RUN_TABLES:
                self._runs.clear()
            uniform = len({weight(slot.medium) for slot in table.slots if slot is not None}) <= 1
            known = self._runs[(instance_id, lora)] = (
                table,
                block_size,
                self._generation,
                list(table.slots),
                {},
                uniform,
            )
        return known[4], known[5]

    def _run_fragments(
        self,
        memo: RunMemo,
        slots: list[Slot | None],
        run: tuple[int, int, int],
        block_size: int,
        weight: Callable[[str], float],
    ) -> Run:
        """Encode the fragments of one run (its slots in source id order) and memoise them."""
        n, before, after = run
        bits = before ^ after
        found: list[Slot] = []
        while bits:
            low = bits & -bits
            bits ^= low
            slot = slots[low.bit_length() - 1]
            if slot is not None:
                found.append(slot)
        found.sort(key=_BY_SOURCE)
        frags = [self._fragment(slot, n, block_size, weight) for slot in found]
        entry = memo[run] = (
            frags,
            b"".join(f[ENTRY] for f in frags),
            b"".join(f[POD_ENTRY] for f in frags),
            len(frags),
        )
        return entry

    def _fragment(self, slot: Slot, n: int, block_size: int, weight: Callable[[str], float]) -> Fragment:
        state = self._sources.get(slot.source_id)
        pod = (state.spec.pod if state is not None else "") or slot.source_id
        return fragment(slot.source_id, slot.dp_rank, pod, {slot.medium: n}, n, block_size, weight(slot.medium) * n)

    def locations(
        self, instance_id: str, keys: Sequence[int], *, lora_name: str | None = None
    ) -> list[list[EngineLocation]]:
        """Per key, the engines holding it (``{"source_id", "medium", "group_idx"}``), for
        ``get_cache_location(include_engines=true)``."""
        with self._lock:
            table = self._tables.get((instance_id, lora_name or ""))
            if table is None:
                return [[] for _ in keys]
            allowed = table.allowed(None, None)
            out: list[list[EngineLocation]] = [
                [
                    {"source_id": s.source_id, "medium": s.medium, "group_idx": s.group}
                    for s in table.holders_of(k, allowed)
                ]
                for k in keys
            ]
            if table.hybrid_slots:  # a hybrid source holds, for this, what all its groups can reuse
                for source_id, found in self._hybrid(instance_id, table, keys, None, ()):
                    for medium, n in found.media.items():
                        for i in range(n):
                            for slot in table.holders_of(keys[i], ~allowed):
                                if slot.source_id == source_id and slot.medium == medium:
                                    out[i].append({"source_id": source_id, "medium": medium, "group_idx": slot.group})
            return out


def _mask(table: HolderTable, sources: Collection[str]) -> int:
    """The slots of ``sources`` (a match leaves stale sources out this way)."""
    mask = 0
    for source_id in sources:
        for sid in table.source_slots(source_id):
            mask |= 1 << sid
    return mask


def _per_source(runs: Iterable[tuple[int, int]], slots: list[Slot | None]) -> dict[str, SourceMatch]:
    """Each source's match from the runs ``(length, holder mask)``, ascending: a later run of a
    source is its better one."""
    per_source: dict[str, SourceMatch] = {}
    for n, bits in runs:
        while bits:
            low = bits & -bits
            bits ^= low
            slot = slots[low.bit_length() - 1]
            if slot is None:
                continue
            entry = per_source.get(slot.source_id)
            if entry is None:
                per_source[slot.source_id] = SourceMatch(slot.source_id, slot.dp_rank, n, {slot.medium: n})
            else:
                entry.media[slot.medium] = max(n, entry.media.get(slot.medium, 0))
                entry.matched_blocks = n
    return per_source
