"""The engine index: which engine (source, DP rank, medium, group) holds which kvcm block.

Engine events name blocks by the engine's own hashes; kvcm re-hashes their ``token_ids`` with the
instance's block hash (:mod:`kvcm.cache.keys`), chained through the parent block, so engine blocks
and storage-tier blocks share one key space and ``match_engines`` takes the same ``token_ids`` as
``get_cache_location``. Per source the index keeps ``(group, engine hash) -> EngineBlock``: the
block's kvcm keys, the running hash state and token position at its end (the parent seed of its
children) and a holding count per medium (vLLM can store and remove one hash twice).

Rules:

* a store whose parent is unknown is skipped and counted, never rooted (edge 15);
* engine block size ``e`` vs instance block size ``b``: re-chunked when one divides the other
  (``e = k*b``: one engine block covers ``k`` kvcm keys; ``b = k*e``: every ``k``-th engine block
  closes a kvcm key), else refused and counted (``block_size_mismatch``);
* stores without token ids (tier placeholders) resolve through the hash map, else are skipped;
* a block's ``extra_keys`` entry is mixed into its kvcm key (:mod:`kvcm.proto.extra_keys`); a store
  whose extra keys cannot be canonicalised, or cannot be placed in re-chunked blocks, is refused
  and counted (``bad_extra_keys``, ``extra_keys_block_size``), never indexed without them;
* ``BlockRemoved`` drops one holding of that source/medium/group only; ``AllBlocksCleared``, a
  publisher restart and removing the source clear exactly that source;
* LoRA adapters (``lora_name``) are separate namespaces; groups are separate holder slots, and a
  source of several groups (a hybrid model) is matched on what all of them can reuse
  (:mod:`kvcm.engines.hybrid`);
* a source in report mode ``full`` re-reports reused blocks: a held block re-reported is made
  the newest, never held twice.

Bounds (a source is fed by an engine or a tenant's reporter, so the index it fills is someone
else's memory): a source holds at most ``max_blocks_per_source`` blocks and all sources
together ``max_blocks``, each block weighing its kvcm keys (:func:`~kvcm.engines.entries.weight`).
Past its own bound a source loses its oldest blocks; past the total, the source that stores
loses its own oldest while it holds more than its fair share (the total over the sources
followed), else the largest source does. Either way down to :data:`_LOW_WATER` of the bound, so
evictions come in batches (each walks the dict's front once). A source holds at most
:data:`MAX_SLOTS` (medium, group) slots per adapter and :data:`MAX_GROUPS` groups, with media
and adapter names of at most :data:`MAX_LABEL` characters: a slot is a bit of every holder mask
of its table, so slots unbounded would make every mask, not just the source, grow. Stores past
these are refused and counted. Start-up applies the same bounds while it loads, so a lowered
bound (or an index written before the bounds) never loads more than it allows.

Persistence (``engine_sources``, ``engine_log``; layout in :mod:`kvcm.engines.entries`):
:meth:`EngineIndex.flush` appends the blocks touched since the last flush (one log record per
source, tombstones for the removed) and writes each source's ``last_seq``, in one transaction,
so the persisted index is always consistent with the persisted ``last_seq`` and a restarted kvcm
resumes by replay from ``last_seq + 1``. A source whose log outgrew its live blocks, or that was
cleared, is rewritten as its live blocks in that same transaction; :meth:`EngineIndex.load`
replays the records in order.

Thread ownership: the subscriber thread applies and flushes; the RPC thread adds/removes sources
and queries. One re-entrant lock guards all in-memory state; a write transaction, when needed,
is always opened *before* taking the lock (the store's documented lock order).
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable, MutableMapping, Sequence
from itertools import accumulate, chain, compress, islice, repeat
from operator import and_, attrgetter, is_, itemgetter, or_
from typing import TYPE_CHECKING, Any

from kvcm.backends.metastore.base import MetaStore
from kvcm.engines.entries import (
    BLOCK_KEY,
    BLOCKS_DB,
    CHUNK,
    DEC,
    LOG_DB,
    LOG_KEY,
    M64,
    SID,
    SOURCES_DB,
    ApplyStats,
    Candidates,
    EngineBlock,
    Item,
    NullTxn,
    SourceMatch,
    SourceState,
    block_id,
    decode_log,
    delete_blocks,
    flush_source,
    new_block,
    normalize_medium,
    weight,
)
from kvcm.engines.hashing import Chain, Precomputed, chain_states, chain_states_mixed, hash_chains, to_signed
from kvcm.engines.hybrid import FULL, Holdings, answer, group_from_record, noted
from kvcm.engines.scoring import ENTRY, POD_ENTRY, Fragment, fragment
from kvcm.engines.sources import SourceSpec, SubscriberSettings
from kvcm.engines.table import MAIN_KINDS, HolderTable, Slot
from kvcm.errors import Conflict, KvcmError, NotFound
from kvcm.proto.extra_keys import ExtraKeysError, event_digests, lora_digest
from kvcm.proto.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    EventDecodeError,
    ExternalBlockHash,
    hash_to_u64,
)
from kvcm.threads import gc_paused

if TYPE_CHECKING:
    from kvcm.engines.keytable import KeyTable

#: ``BlockStored.extra_keys`` of a store whose hashes are kvcm keys already (``report_events``'
#: ``keyed`` adds: Tair's reporters name blocks by key and send no tokens). Compared by identity,
#: so no decoded engine payload can carry it.
KEYED: list[Any] = ["kvcm-keys"]
#: (medium, group) slots one source may hold in one adapter namespace (engines use a handful).
MAX_SLOTS = 64
#: KV-cache groups one source may name (vLLM's hybrid models have a few).
MAX_GROUPS = 64
#: Characters of a medium or adapter name at most (they key slots and tables).
MAX_LABEL = 256
#: An eviction takes a source (or the total) down to this share of its bound.
_LOW_WATER = 31 / 32


class EngineIndex:
    """Engine blocks of every source, mapped into kvcm keys (see the module docstring)."""

    def __init__(
        self,
        store: MetaStore | None,
        block_size_of: Callable[[str], int],
        max_blocks_per_source: int = SubscriberSettings.max_blocks_per_source,
        max_blocks: int = SubscriberSettings.max_blocks,
        compact: bool = True,
    ) -> None:
        """``compact``: at each flush, move each source's common blocks out of its dict into
        compact maps (:mod:`kvcm.engines.compacted`)."""
        self._compact_blocks = compact
        self._store = store
        self._block_size_of = block_size_of
        self.max_per_source = max_blocks_per_source
        self.max_total = max_blocks
        self._total = 0  # the sizes of every source (SourceState.size), kept as they change
        self._lock = threading.RLock()
        self._sources: dict[str, SourceState] = {}
        self._tables: dict[tuple[str, str], HolderTable] = {}
        self._generation = 0
        self._dirty: set[str] = set()
        self._sizes: dict[str, int | None] = {}
        self._pods_distinct: dict[str, tuple[int, bool]] = {}  # instance -> (source generation, answer)
        # match_engines' encoded runs per table: (table, block size, source generation, its slots,
        # {(length, running AND before, after): run}, whether its slots weigh the same)
        self._runs: dict[tuple[str, str], tuple[HolderTable, int, int, list[Slot | None], RunMemo, bool]] = {}

    # --- sources ----------------------------------------------------------------------------

    def add_source(self, spec: SourceSpec) -> SourceState:
        """Register a source (idempotent for an identical spec); persisted at once."""
        with self._txn() as txn, self._lock:
            old = self._sources.get(spec.source_id)
            if old is not None:
                if old.spec == spec:
                    return old
                raise Conflict(f"event source {spec.source_id!r} exists with another spec")
            self._generation += 1
            numbers = {s.number for s in self._sources.values()}
            number = next(i for i in range(1, len(numbers) + 2) if i not in numbers)
            state = SourceState(spec, number, self._generation)
            self._sources[spec.source_id] = state
            if txn is not None:
                txn.put(SOURCES_DB, spec.source_id.encode(), state.record())
            return state

    def remove_source(self, source_id: str) -> SourceState:
        """Forget a source and exactly its blocks; persisted at once."""
        with self._txn() as txn, self._lock:
            state = self._sources.pop(source_id, None)
            if state is None:
                raise NotFound(f"no event source {source_id[:200]!r}")
            self._clear_memory(state)
            self._dirty.discard(source_id)
            if txn is not None:
                txn.delete(SOURCES_DB, source_id.encode())
                delete_blocks(txn, state.number)
            return state

    def get(self, source_id: str) -> SourceState | None:
        return self._sources.get(source_id)

    @property
    def lock(self) -> threading.RLock:
        """The index's lock, for callers that must change it together with their own state
        (push sources: :mod:`kvcm.engines.push`). Never open a transaction while holding it."""
        return self._lock

    def sources(self) -> list[SourceState]:
        with self._lock:
            return list(self._sources.values())

    def hybrid_slots(self, instance_id: str, lora_name: str | None = None) -> int:
        """Slots of hybrid sources in the ``(instance, adapter)`` table: what a default query's
        hybrid answer costs per key grows with them (:mod:`kvcm.api.costs`)."""
        table = self._tables.get((instance_id, lora_name or ""))
        return 0 if table is None else table.hybrid_slots

    def blocks_held(self, source_id: str) -> dict[str, int]:
        """Distinct kvcm keys the source holds, per medium."""
        with self._lock:
            out: Counter[str] = Counter()
            state = self._sources.get(source_id)
            if state is None:
                return {}
            for (inst, _), table in self._tables.items():
                if inst != state.spec.instance_id:
                    continue
                for sid in table.source_slots(source_id):
                    slot = table.slots[sid]
                    if slot is not None:
                        out[slot.medium] += table.count(sid)
            return dict(out)

    def blocks_of(self, source_id: str) -> dict[int, EngineBlock]:
        """Every block of the source by id, the migrated ones (copies) first (tests, tools)."""
        with self._lock:
            state = self._sources.get(source_id)
            if state is None:
                return {}
            migrated = [] if state.compact is None else state.compact.items(self._key_table(state))
            return {**dict(migrated), **state.blocks}

    def clear_source(self, source_id: str, generation: int | None = None) -> bool:
        """Drop every block of the source (``AllBlocksCleared`` or a publisher restart)."""
        with self._lock:
            state = self._sources.get(source_id)
            if state is None or (generation is not None and state.generation != generation):
                return False
            self._clear_memory(state)
            state.cleared = True
            self._dirty.add(source_id)
            return True

    def set_position(self, source_id: str, generation: int, last_seq: int) -> None:
        """Move a source's ``last_seq`` (a restart resets it to -1)."""
        with self._lock:
            state = self._sources.get(source_id)
            if state is not None and state.generation == generation:
                state.last_seq = last_seq
                self._dirty.add(source_id)

    def _clear_memory(self, state: SourceState) -> None:
        source_id = state.spec.source_id
        slots = {}  # lora -> (table, the source's slots in it)
        for key in [k for k in self._tables if k[0] == state.spec.instance_id]:
            sids = self._tables[key].source_slots(source_id)
            if sids:
                slots[key[1]] = (self._tables[key], sids)
        held: dict[str, list[int]] = {}  # the tables know no slot's keys: the source's blocks do
        migrated = [] if state.compact is None else state.compact.items(self._key_table(state))
        for blk in chain(state.blocks.values(), map(itemgetter(1), migrated)):
            if blk.keys and blk.lora in slots:
                held.setdefault(blk.lora, []).extend(blk.keys)
        for lora, (table, sids) in slots.items():
            table.forget(sum(1 << sid for sid in sids), held.get(lora, ()))
            for sid in sids:
                table.drop_slot(sid)
            if table.empty:
                del self._tables[(state.spec.instance_id, lora)]
        state.blocks.clear()
        state.compact = None
        state.dirty.clear()
        state.fresh.clear()
        self._grown(state, -state.size)

    # --- applying events ------------------------------------------------------------------------

    def apply(self, source_id: str, generation: int, seq: int, batch: DecodedBatch) -> ApplyStats | None:
        return self.apply_many([(source_id, generation, seq, batch)])[0]

    def replace_source(self, item: Item, hashed: Precomputed | None = None) -> ApplyStats | None:
        """A snapshot: drop every block of the source and apply ``item`` in one step, so neither a
        query nor a flush ever sees the source half replaced (``hashed``: see :meth:`apply_many`)."""
        with self._lock:
            if not self.clear_source(item[0], item[1]):
                return None
            return self.apply_many([item], hashed)[0]

    def apply_many(self, items: Sequence[Item], hashed: Precomputed | None = None) -> list[ApplyStats | None]:
        """Apply batches in order; ``None`` for a batch whose source is gone (stale generation).

        ``hashed``: chain states of (some of) their stores, from :meth:`precompute` over a larger
        set of batches (push reports hash a whole dispatcher turn together); each is used only
        if the seed it assumed is the one the store's parent gives when applied."""
        with self._lock, gc_paused():
            self._sizes = {}
            pre = self._precompute(items, hashed or {})
            if hashed:  # the pool's states are read, never changed: no copy unless both hold some
                pre = {**hashed, **pre} if pre else hashed
            return [self._apply_one(item, pre) for item in items]

    def _settle_tables(self) -> None:
        """Apply every table's deferred holds and releases (:meth:`HolderTable.settle`) and
        forget the tables left without slots."""
        for key, table in list(self._tables.items()):
            table.settle()
            if table.empty:
                del self._tables[key]

    def precompute(self, items: Sequence[Item]) -> Precomputed:
        """Chain states of the stores in ``items``, for a later :meth:`apply_many` of them."""
        with self._lock, gc_paused():
            self._sizes = {}
            return self._precompute(items, {})

    def _apply_one(self, item: Item, pre: Precomputed) -> ApplyStats | None:
        source_id, generation, seq, batch = item
        state = self._sources.get(source_id)
        if state is None or state.generation != generation:
            return None
        stats = ApplyStats()
        evicted = state.evicted
        for event in batch.events:
            kind = type(event).__name__
            if type(event) is BlockStored:
                stats.blocks += self._stored(state, event, pre, stats.errors)
                if state.size > self.max_per_source or self._total > self.max_total:
                    self._make_room(state)
            elif type(event) is BlockRemoved:
                stats.blocks += self._removed(state, event, stats.errors)
            elif type(event) is AllBlocksCleared:
                self._clear_memory(state)
                state.cleared = True
            stats.processed[kind] += 1
        for kind in batch.errors:
            stats.errors[kind] += 1
        if state.evicted > evicted:
            stats.errors["evicted"] += state.evicted - evicted
        state.last_seq = seq
        state.last_ts = batch.ts
        state.last_event_time = time.time()
        self._dirty.add(source_id)
        return stats

    def _stored(self, state: SourceState, ev: BlockStored, pre: Precomputed, errors: MutableMapping[str, int]) -> int:
        group = ev.group_idx or 0
        medium = normalize_medium(ev.medium)
        refused = self._refused(state, ev.lora_name or "", medium, group)
        if refused is not None:
            errors[refused] += 1
            return 0
        hashes = _u64_hashes(ev.block_hashes)
        self._note_group(state, group, ev)
        if ev.extra_keys is KEYED:
            return self._keyed(state, hashes, ev.lora_name or "", group, medium)
        if not ev.token_ids or ev.block_size <= 0:
            return self._resolve_tokenless(state, hashes, group, medium, errors)
        plan = self._plan(state, ev, hashes, group, errors)
        if plan is None:
            return 0
        seed, pos, step, block_size = plan
        digests = _step_digests(ev, len(hashes), pos, step, block_size)
        if isinstance(digests, str):
            errors[digests] += 1  # never indexed without its extra keys: that would be another block's key
            return 0
        found = pre.get(id(ev)) if digests is None else None
        try:
            if found is not None and found[0] == seed & M64:
                states = found[1]
            elif digests is None:
                states = chain_states(seed, ev.token_ids, step)
            else:
                states = chain_states_mixed(seed, ev.token_ids, step, digests)
        except EventDecodeError:  # packed token ids that are not ids (read only now): the store is refused
            errors["bad_token_ids"] += 1
            return 0
        lora = ev.lora_name or ""
        blocks = state.blocks
        size = ev.block_size
        same = step == block_size == size  # the common case: no re-chunking, one key per block
        touched = hashes if not group else list(map(or_, repeat(group << 64), hashes))  # block ids
        new = None
        if (
            same
            and len(states) == len(hashes)
            and blocks.keys().isdisjoint(touched)
            and (state.compact is None or not state.compact.holds_any(group, hashes))
        ):
            new = self._new_blocks(blocks, touched, states, lora, medium, pos, size)
        if new is not None:
            gained = new[0]
            state.fresh.append((touched, new[1]))  # persisted as made, no lookups (SourceState.fresh)
            self._grown(state, len(touched))
        else:
            state.spill()
            gained = self._update_blocks(state, touched, states, lora, medium, group, pos, step, block_size, size)
            state.dirty.extend(touched)
        if gained:
            table = self._table(state.spec.instance_id, lora)
            table.hold(self._slot(table, state, medium, group), gained)
        return len(hashes)

    @staticmethod
    def _new_blocks(
        blocks: dict[int, EngineBlock],
        touched: list[int],
        states: list[int],
        lora: str,
        medium: str,
        pos: int,
        size: int,
    ) -> tuple[list[int], list[EngineBlock]] | None:
        """The common store: every block new to the source, one kvcm key each. Built with
        C-level iteration (map, zip, dict.update) instead of a Python step per block: its kvcm
        keys and blocks. None (and nothing changed) when the store names a block twice: the
        caller takes the general path."""
        ends = range(pos + size, pos + (len(states) + 1) * size, size)
        before = len(blocks)
        made = list(map(EngineBlock, repeat(lora), states, ends, zip(states), repeat(_held_once(medium))))
        blocks.update(zip(touched, made))
        if len(blocks) - before != len(touched):
            for key in touched:  # all were new: undo
                blocks.pop(key, None)
            return None
        return states, made

    def _update_blocks(
        self,
        state: SourceState,
        touched: list[int],
        states: list[int],
        lora: str,
        medium: str,
        group: int,
        pos: int,
        step: int,
        block_size: int,
        size: int,
    ) -> list[int]:
        """Any store, one block at a time (held ones gain a holding): the keys newly held."""
        gained: list[int] = []  # keys this medium starts holding: one table update for all
        blocks = state.blocks
        full = state.spec.report_mode == FULL
        same = step == block_size == size
        grown = 0
        compact = state.compact is not None
        for i, key in enumerate(touched):
            blk = self._promote(state, key) if compact else blocks.get(key)
            if blk is None:  # the common case: a new block, first held in this medium
                if same:
                    k = states[i]
                    blk = blocks[key] = EngineBlock(lora, k, pos + (i + 1) * size, (k,))
                    gained.append(k)
                else:
                    blk = blocks[key] = new_block(lora, states, i, size, pos, step, block_size)
                    gained.extend(blk.keys)
                blk.refs = _held_once(medium)
                grown += weight(blk)
                continue
            count = blk.refs.get(medium, 0)
            if not count and blk.keys and blk.lora != lora:
                self._hold(state, blk, medium, group)  # the same engine hash under another adapter
                continue
            if count and full:  # a re-report (vLLM's kv_cache_report_mode "full"): newest again, no holding
                blocks[key] = blocks.pop(key)
                continue
            blk.refs = {**blk.refs, medium: count + 1}
            if not count and blk.keys:
                gained.extend(blk.keys)
        self._grown(state, grown)
        return gained

    def _plan(
        self, state: SourceState, ev: BlockStored, hashes: list[int], group: int, errors: MutableMapping[str, int]
    ) -> tuple[int, int, int, int] | None:
        """``(seed, start position, hash step, instance block size)``, or None if refused."""
        if len(ev.token_ids) != len(hashes) * ev.block_size:
            errors["bad_shape"] += 1  # sparse mamba / partial chunks: cannot be re-hashed
            return None
        block_size = self._instance_block_size(state, errors)
        if block_size is None:
            return None
        if ev.block_size % block_size and block_size % ev.block_size:
            errors["block_size_mismatch"] += 1
            return None
        seed, pos = 0, 0
        if ev.parent_block_hash is not None:
            parent = self._lookup(state, block_id(group, hash_to_u64(ev.parent_block_hash)))
            if parent is None:
                errors["unknown_parent"] += 1
                return None
            seed, pos = parent.end, parent.pos
        step = min(ev.block_size, block_size)
        if pos % step:
            errors["block_size_mismatch"] += 1
            return None
        return seed, pos, step, block_size

    def _instance_block_size(self, state: SourceState, errors: MutableMapping[str, int]) -> int | None:
        """The instance's block size (cached for one ``apply_many``), None if it is gone."""
        instance_id = state.spec.instance_id
        if instance_id not in self._sizes:
            try:
                self._sizes[instance_id] = int(self._block_size_of(instance_id)) or None
            except KvcmError:
                self._sizes[instance_id] = None
        size = self._sizes[instance_id]
        if size is None or size <= 0:
            errors["instance_not_found"] += 1
            return None
        return size

    def _resolve_tokenless(
        self, state: SourceState, hashes: list[int], group: int, medium: str, errors: MutableMapping[str, int]
    ) -> int:
        done = 0
        state.spill()
        for h in hashes:
            key = block_id(group, h)
            blk = self._promote(state, key)
            if blk is None:
                errors["unknown_hash"] += 1
                continue
            if not self._hold(state, blk, medium, group):
                errors["too_many_slots"] += 1
                continue
            state.dirty.add(key)
            done += 1
        return done

    def _keyed(self, state: SourceState, hashes: list[int], lora: str, group: int, medium: str) -> int:
        """Blocks named by their kvcm keys, each held at most once per medium: a repeated add
        changes nothing, so one remove always drops it (Tair's adds are idempotent). New blocks
        are made and held with C-level iteration (a report may name tens of thousands); a known
        block not yet held on ``medium`` takes the general path."""
        state.spill()
        blocks = state.blocks
        touched = hashes if not group else list(map(or_, repeat(group << 64), hashes))  # block ids
        found = list(map(blocks.get, touched))
        if state.compact is not None and None in found:
            found = [f if f is not None else self._promote(state, b) for f, b in zip(found, touched)]
        gained: list[int] = []
        if None in found:
            fresh = list(dict.fromkeys(compress(touched, map(is_, found, repeat(None)))))  # once each, in order
            gained = list(map(to_signed, map(and_, fresh, repeat(M64))))
            blocks.update(
                zip(
                    fresh, map(EngineBlock, repeat(lora), repeat(0), repeat(0), zip(gained), repeat(_held_once(medium)))
                )
            )
            self._grown(state, len(fresh))  # a keyed block is one key
        for blk in filter(None, found):
            if medium not in blk.refs:
                self._hold(state, blk, medium, group)
        if gained:
            table = self._table(state.spec.instance_id, lora)
            table.hold(self._slot(table, state, medium, group), gained)
        state.dirty.extend(touched)
        return len(hashes)

    def _removed(self, state: SourceState, ev: BlockRemoved, errors: MutableMapping[str, int]) -> int:
        group = ev.group_idx or 0
        medium = normalize_medium(ev.medium)
        done = 0
        state.spill()  # a fresh block removed must not be persisted from SourceState.fresh
        for raw in ev.block_hashes:
            key = block_id(group, hash_to_u64(raw))
            blk = self._promote(state, key)
            if blk is None or medium not in blk.refs:
                continue  # unknown removes are no-ops (edge 16)
            self._release(state, blk, medium, group)
            if not blk.refs:
                del state.blocks[key]
                self._grown(state, -weight(blk))
            state.dirty.add(key)
            done += 1
        return done

    def _hold(self, state: SourceState, blk: EngineBlock, medium: str, group: int) -> bool:
        """One more holding of ``blk`` on ``medium``; False (nothing held) when that would be a
        slot past :data:`MAX_SLOTS`."""
        count = blk.refs.get(medium, 0)
        if count and state.spec.report_mode == FULL:
            return True  # a re-report: the block is held once however often it is reported
        if count == 0 and blk.keys and self._refused(state, blk.lora, medium, group) is not None:
            return False
        blk.refs = {**blk.refs, medium: count + 1}
        if count == 0 and blk.keys:
            table = self._table(state.spec.instance_id, blk.lora)
            table.hold(self._slot(table, state, medium, group), blk.keys)
        return True

    def _slot(self, table: HolderTable, state: SourceState, medium: str, group: int) -> int:
        """The source's slot of ``(medium, group)``: counted by the default walk only for a
        source that ever sent one group, of a main kind (a hybrid source is matched by
        :mod:`kvcm.engines.hybrid`)."""
        groups = state.groups
        hybrid = len(groups) > 1
        info = groups.get(group)
        main = not hybrid and (info is None or info.kind in MAIN_KINDS)
        return table.slot(state.spec.source_id, medium, group, main, state.spec.dp_rank, hybrid)

    def _note_group(self, state: SourceState, group: int, ev: BlockStored) -> None:
        """What a store says of its group (kind, window, engine block size); a source's second
        group makes it hybrid: its slots leave the default walk."""
        info = state.groups.get(group)
        known = noted(info, ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window, ev.block_size)
        if known is info:
            return
        state.groups[group] = known
        if info is None and len(state.groups) == 2:
            for (instance_id, _), table in self._tables.items():
                if instance_id == state.spec.instance_id:
                    table.mark_hybrid(state.spec.source_id)

    def _refused(self, state: SourceState, lora: str, medium: str, group: int) -> str | None:
        """Why the source may not hold blocks of adapter ``lora`` on ``(medium, group)`` (the
        error kind), or None: names past :data:`MAX_LABEL`, a group past :data:`MAX_GROUPS`, a
        new slot past :data:`MAX_SLOTS` (module docstring). The usual answer is two lookups."""
        if len(medium) > MAX_LABEL or len(lora) > MAX_LABEL:
            return "bad_label"
        if group not in state.groups and len(state.groups) >= MAX_GROUPS:
            return "too_many_groups"
        table = self._tables.get((state.spec.instance_id, lora))
        source_id = state.spec.source_id
        if table is None or (source_id, medium, group) in table.slot_ids:
            return None
        if len(table.source_slots(source_id)) < MAX_SLOTS:
            return None
        table.settle()  # a release may have emptied a slot not dropped yet
        return "too_many_slots" if len(table.source_slots(source_id)) >= MAX_SLOTS else None

    def _grown(self, state: SourceState, n: int) -> None:
        """The source's size changed by ``n`` (blocks came or went)."""
        state.size += n
        self._total += n

    # --- bounds -------------------------------------------------------------------------------------

    def _make_room(self, state: SourceState) -> None:
        """After a store by ``state``: back within the per-source bound and the total (module
        docstring)."""
        if state.size > self.max_per_source:
            self._evict(state, state.size - int(self.max_per_source * _LOW_WATER))
        if self._total <= self.max_total:
            return
        target = int(self.max_total * _LOW_WATER)
        fair = self.max_total // max(1, len(self._sources))
        while self._total > target:
            victim = state if state.size > fair else max(self._sources.values(), key=_BY_SIZE)
            most = victim.size - fair if victim is state and state.size > fair else victim.size
            if not self._evict(victim, min(self._total - target, most)):
                return

    def _evict(self, state: SourceState, n: int) -> int:
        """Drop the source's oldest blocks (in the order they were stored) until ``n`` of its
        size is gone; persisted as tombstones at the next flush. Returns the size freed."""
        state.spill()  # a fresh block dropped must not be persisted from SourceState.fresh
        early = self._evict_migrated(state, n)  # older than every block of the dict
        if early >= n:
            return early
        n -= early
        gone, freed = _oldest(state.blocks, n)
        ids = list(map(itemgetter(0), gone))
        deque(map(state.blocks.__delitem__, ids), maxlen=0)
        state.dirty.extend(ids)
        for (lora, medium, group), keys in _held_keys(gone).items():  # one table pass per slot, not per block
            self._release_keys(state, lora, medium, group, keys)
        state.evicted += len(gone)
        self._grown(state, -freed)
        self._dirty.add(state.spec.source_id)
        return freed + early

    def _evict_migrated(self, state: SourceState, n: int) -> int:
        """Evict up to ``n`` of the source's migrated blocks, the oldest first; how many went."""
        if state.compact is None or not len(state.compact):
            return 0
        gone = state.compact.oldest(self._key_table(state), n)
        if not gone:
            return 0
        state.dirty.extend(bid for bid, _, _ in gone)
        by_group: dict[int, list[int]] = {}
        for _, group, key in gone:
            by_group.setdefault(group, []).append(key)
        for group, keys in by_group.items():
            self._release_keys(state, "", state.compact.primary, group, keys)
        state.evicted += len(gone)
        self._grown(state, -len(gone))
        self._dirty.add(state.spec.source_id)
        return len(gone)

    # --- migrated blocks (kvcm.engines.compacted) --------------------------------------------------

    def _key_table(self, state: SourceState) -> KeyTable | None:
        table = self._tables.get((state.spec.instance_id, ""))
        return None if table is None else table.key_table

    def _lookup(self, state: SourceState, bid: int) -> EngineBlock | None:
        """The block, from the dict or (a copy) from the migrated ones."""
        blk = state.blocks.get(bid)
        if blk is None and state.compact is not None:
            blk = state.compact.get(self._key_table(state), bid)
        return blk

    def _promote(self, state: SourceState, bid: int) -> EngineBlock | None:
        """The block, from the dict; a migrated one is taken back into it first (it is about to
        change)."""
        blk = state.blocks.get(bid)
        if blk is None and state.compact is not None:
            blk = state.compact.take(self._key_table(state), bid)
            if blk is not None:
                state.blocks[bid] = blk
        return blk

    def _migrate(self, state: SourceState, candidates: Candidates) -> None:
        """After a flush persisted them: the source's common blocks among ``candidates`` leave
        its dict for compact maps."""
        dirty, fresh = candidates
        if not self._compact_blocks or not (dirty or fresh):
            return
        table = self._tables.get((state.spec.instance_id, ""))
        if table is None:
            return
        if state.compact is None:
            from kvcm.engines.compacted import CompactBlocks  # numba: with the first table (table.py)

            first = fresh[0][1][0] if fresh else next(filter(None, map(state.blocks.get, dirty)), None)
            if first is None:
                return
            state.compact = CompactBlocks(next(iter(first.refs)) if len(first.refs) == 1 else "GPU")
        table.settle()
        moved = state.compact.migrate(table.key_table, state.blocks, dirty, fresh)
        blocks = state.blocks
        deque(map(blocks.__delitem__, moved), maxlen=0)
        if moved and len(blocks) < len(moved) // 4:
            state.blocks = dict(blocks)  # a dict never shrinks by deleting: the buffer's peak goes

    def _release(self, state: SourceState, blk: EngineBlock, medium: str, group: int) -> None:
        count = blk.refs[medium]
        if count > 1:
            blk.refs = {**blk.refs, medium: count - 1}
            return
        blk.refs = {m: n for m, n in blk.refs.items() if m != medium}
        if blk.keys:
            self._release_keys(state, blk.lora, medium, group, blk.keys)

    def _release_keys(self, state: SourceState, lora: str, medium: str, group: int, keys: Sequence[int]) -> None:
        """One holding less of each key in the source's slot; the slot (and its table) go once empty."""
        table = self._tables.get((state.spec.instance_id, lora))
        if table is None:
            return
        sid = table.slot_ids.get((state.spec.source_id, medium, group))
        if sid is not None:
            table.release(sid, keys)  # applied, and an emptied slot dropped, by _settle_tables

    def _table(self, instance_id: str, lora: str) -> HolderTable:
        table = self._tables.get((instance_id, lora))
        if table is None:
            table = self._tables[(instance_id, lora)] = HolderTable()
        return table

    # --- vectorised re-hashing across the stores of one drain -----------------------------------

    def _precompute(self, items: Sequence[Item], known: Precomputed) -> Precomputed:
        """Chain states of the stores in ``items`` (but those ``known``), hashed together.

        A store whose parent is the last block of an earlier store of the same drain continues
        that store's chain (its tokens are appended), so one vLLM request's successive events
        cost no extra pass. Stores that fit neither case (a parent in the middle of an earlier
        store) are left to the scalar path; every store is re-checked when applied in order.
        """
        jobs = []
        for source_id, generation, _, batch in items:
            state = self._sources.get(source_id)
            if state is None or state.generation != generation:
                continue
            for ev in batch.events:
                if type(ev) is BlockStored and ev.token_ids and ev.block_size > 0 and id(ev) not in known:
                    jobs.append((state, ev))
        if len(jobs) < 2:
            return {}  # one chain: the scalar path in _stored is as fast
        try:
            return hash_chains(self._chains(jobs))
        except EventDecodeError:  # a store's packed token ids are not ids: each is hashed (or refused) alone
            return {}

    def _chains(self, jobs: list[tuple[SourceState, BlockStored]]) -> list[Chain]:
        chains: list[Chain] = []
        tails: dict[tuple[str, int, int], Chain] = {}  # (source, group, last hash) -> open chain
        for state, ev in jobs:
            head = self._head(state, ev)
            if head is None:
                continue
            seed, step = head
            group = ev.group_idx or 0
            source_id = state.spec.source_id
            if seed is None:  # parent unknown before this drain: maybe an earlier store's tail
                assert ev.parent_block_hash is not None
                chain = tails.pop((source_id, group, hash_to_u64(ev.parent_block_hash)), None)
                if chain is None or chain.step != step:
                    continue
            else:
                chain = Chain(seed, step)
                chains.append(chain)
            chain.add(ev)
            tails[(source_id, group, hash_to_u64(ev.block_hashes[-1]))] = chain
        return chains

    def _head(self, state: SourceState, ev: BlockStored) -> tuple[int | None, int] | None:
        """``(seed, step)`` for a store; seed None if its parent is not indexed yet; None to skip."""
        if not ev.block_hashes or len(ev.token_ids) != len(ev.block_hashes) * ev.block_size or _has_extras(ev):
            return None  # a store with extra keys is hashed alone, in _stored
        block_size = self._instance_block_size(state, _IGNORED)
        if not block_size or (ev.block_size % block_size and block_size % ev.block_size):
            return None
        step = min(ev.block_size, block_size)
        if ev.parent_block_hash is None:
            return 0, step
        parent = self._lookup(state, block_id(ev.group_idx or 0, hash_to_u64(ev.parent_block_hash)))
        if parent is None:
            return None, step
        return None if parent.pos % step else (parent.end, step)

    # --- queries ------------------------------------------------------------------------------

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
            slots = table.slots
            per_source: dict[str, SourceMatch] = {}
            for n, bits in runs:  # ascending n: a later run of a source is its better one
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
    ) -> list[list[dict[str, Any]]]:
        """Per key, the engines holding it (``{"source_id", "medium", "group_idx"}``), for
        ``get_cache_location(include_engines=true)``."""
        with self._lock:
            table = self._tables.get((instance_id, lora_name or ""))
            if table is None:
                return [[] for _ in keys]
            allowed = table.allowed(None, None)
            out = [
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

    def check(self) -> list[str]:
        """Problems with the bounds' bookkeeping (tests): each source's size is what its blocks
        weigh, the total their sum, and both within their bounds."""
        with self._lock:
            problems = []
            for state in self._sources.values():
                weighed = sum(map(weight, state.blocks.values())) + (len(state.compact) if state.compact else 0)
                if weighed != state.size:
                    problems.append(f"{state.spec.source_id}: size {state.size}, its blocks weigh {weighed}")
                if state.size > self.max_per_source:
                    problems.append(f"{state.spec.source_id}: size {state.size} over {self.max_per_source}")
            total = sum(s.size for s in self._sources.values())
            if total != self._total:
                problems.append(f"total {self._total}, the sources' sizes sum to {total}")
            if total > self.max_total:
                problems.append(f"total {total} over {self.max_total}")
            return problems

    # --- persistence ------------------------------------------------------------------------------

    def flush(self) -> int:
        """Persist what changed since the last flush in one transaction; returns records written.
        The tables' deferred holdings are applied here too, so an index fed but never asked
        holds no pending keys for long; then, with ``compact``, the common blocks just persisted
        leave their dicts (:meth:`_migrate`)."""
        with self._lock:
            self._settle_tables()
        if not self._dirty:
            return 0
        if self._store is None:
            with self._lock:
                for source_id in self._dirty:
                    state = self._sources.get(source_id)
                    if state is not None:
                        candidates = self._candidates(state)
                        state.dirty.clear()
                        state.fresh.clear()
                        state.cleared = False
                        self._migrate(state, candidates)
                self._dirty.clear()
            return 0
        with self._store.write() as txn, self._lock, gc_paused():
            written = 0
            flushed: list[tuple[SourceState, Candidates]] = []
            try:
                for source_id in self._dirty:
                    state = self._sources.get(source_id)
                    if state is not None:
                        flushed.append((state, self._candidates(state)))
                        written += self._flush_source(txn, state)
            except BaseException:
                self._mark_all_dirty()  # the transaction rolls back: rewrite everything next time
                raise
            self._dirty.clear()
        with self._lock:  # committed: what was persisted may leave the dicts
            for state, candidates in flushed:
                self._migrate(state, candidates)
        return written

    def _candidates(self, state: SourceState) -> Candidates:
        """The blocks a flush of ``state`` persists, which it may migrate: the changed ones'
        ids, and the fresh stores as made (taken before the flush clears them)."""
        if not self._compact_blocks:
            return [], []
        return list(state.dirty), list(state.fresh)

    def _flush_source(self, txn: Any, state: SourceState) -> int:
        compact = state.compact
        if compact is None or not len(compact):
            return flush_source(txn, state)
        return flush_source(txn, state, lambda: compact.items(self._key_table(state)), len(compact))

    def _mark_all_dirty(self) -> None:
        for state in self._sources.values():
            state.cleared = True
            state.dirty.extend(state.blocks)
            state.fresh.clear()
            self._dirty.add(state.spec.source_id)

    def load(self) -> list[SourceState]:
        """Rebuild the in-memory index from the store (at start-up, before any source runs):
        per source its per-block records of the older format, then its log replayed in order."""
        if self._store is None:
            return []
        with self._store.read() as txn, self._lock:
            for _, raw in list(txn.scan(SOURCES_DB)):
                state = self._load_source(DEC.decode(raw))
                self._load_blocks(txn, state)
                self._sources[state.spec.source_id] = state
        with self._lock:
            self._trim_loaded()
            for state in self._sources.values():
                for bid, blk in list(state.blocks.items()):
                    self._load_block(state, bid, blk)
            self._settle_tables()
            for state in self._sources.values():
                self._migrate(state, (list(state.blocks), []))
            return list(self._sources.values())

    def _load_blocks(self, txn: Any, state: SourceState) -> None:
        """A source's blocks: its per-block records of the older format, then its log replayed
        in order, never holding more than its bound (plus one record) on the way."""
        prefix = SID.pack(state.number)
        blocks = state.blocks
        for bkey, braw in txn.scan(BLOCKS_DB, prefix=prefix):
            _, group, h = BLOCK_KEY.unpack(bkey)
            blocks[block_id(group, h)] = EngineBlock.unpack(braw)
            state.logged += 1
            if len(blocks) > self.max_per_source + CHUNK:
                self._drop_loaded(state, len(blocks) - self.max_per_source, counted=False)
        for lkey, lraw in txn.scan(LOG_DB, prefix=prefix):
            self._replay(state, LOG_KEY.unpack(lkey)[1], lraw)
            if len(blocks) > self.max_per_source:  # each block weighs at least 1
                self._drop_loaded(state, len(blocks) - self.max_per_source, counted=False)
        self._grown(state, sum(map(weight, blocks.values())))
        if state.size > self.max_per_source:
            self._drop_loaded(state, state.size - self.max_per_source)

    def _trim_loaded(self) -> None:
        """At start-up, before any block is indexed: the total within its bound, the largest
        sources losing their oldest blocks first."""
        while self._total > self.max_total:
            victim = max(self._sources.values(), key=_BY_SIZE)
            if not self._drop_loaded(victim, min(self._total - self.max_total, victim.size)):
                return

    def _drop_loaded(self, state: SourceState, n: int, counted: bool = True) -> int:
        """Drop a loading source's oldest blocks worth ``n`` (they are in no table yet); its
        records are rewritten at the next flush, so the persisted index is within bounds too.
        ``counted``: its size counts its blocks already (else the caller counts what is left)."""
        gone, freed = _oldest(state.blocks, n)
        for bid, _ in gone:
            del state.blocks[bid]
        state.evicted += len(gone)
        if counted:
            self._grown(state, -freed)
        state.cleared = True
        self._dirty.add(state.spec.source_id)
        return freed

    @staticmethod
    def _replay(state: SourceState, serial: int, raw: bytes) -> None:
        """One log record over the source's blocks: later versions replace, tombstones delete
        (a block a bound dropped while loading may have one)."""
        record = decode_log(raw)
        ids, found = record.ids(), record.blocks
        state.blocks.update(zip(ids, found))  # type: ignore[arg-type]  # the tombstones go next
        if None in found:
            pop = state.blocks.pop
            for bid in compress(ids, map(is_, found, repeat(None))):
                pop(bid, None)
        state.logged += len(ids)
        state.serial = serial + 1

    def _load_source(self, rec: dict[str, Any]) -> SourceState:
        self._generation += 1
        state = SourceState(
            SourceSpec.from_dict(rec["spec"]), int(rec["number"]), self._generation,
            int(rec["last_seq"]), float(rec["last_ts"]),
        )  # fmt: skip
        state.groups = dict(map(group_from_record, rec.get("groups", [])))
        return state

    def _load_block(self, state: SourceState, bid: int, blk: EngineBlock) -> None:
        """Index a loaded block; one whose every holding is refused (slots past the bounds, in an
        index written before them) is dropped."""
        refs, blk.refs = blk.refs, {}
        for medium, count in refs.items():
            if self._hold(state, blk, medium, bid >> 64):
                blk.refs = {**blk.refs, medium: count}
        if not blk.refs:
            del state.blocks[bid]
            self._grown(state, -weight(blk))
            state.cleared = True
            self._dirty.add(state.spec.source_id)

    def _txn(self) -> Any:
        return self._store.write() if self._store is not None else NullTxn()


_BY_SOURCE = attrgetter("source_id")
_KEYS = attrgetter("keys")
_REFS = attrgetter("refs")
_LORA = attrgetter("lora")
_BY_SIZE = attrgetter("size")
_BY_MATCH = attrgetter("matched_blocks")
_IGNORED: Counter[str] = Counter()  # errors of the precompute pass are counted when applied
#: One run of a match: the sources holding exactly the same number of the query's keys, in
#: source id order, as fragments, as their joined ``sources`` and ``pods`` entries, and how many.
Run = tuple[list[Fragment], bytes, bytes, int]
#: Runs by ``(length, running AND of the holder masks before it, after it)``: the slots in the
#: first and not in the second hold exactly ``length`` keys of the query.
RunMemo = dict[tuple[int, int, int], Run]
_MAX_RUNS = 65_536  # memoised runs per table (a few hundred bytes each), then started afresh
_MAX_RUN_TABLES = 4096  # (instance, adapter) namespaces whose runs are kept


#: ``EngineBlock.refs`` is copy-on-write: a block's map is replaced, never changed in place, so
#: the blocks held once on one medium (nearly all) share one map instead of a dict each.
_ONCE: dict[str, dict[str, int]] = {}


def _held_once(medium: str) -> dict[str, int]:
    """The shared ``{medium: 1}`` (never to be changed in place)."""
    found = _ONCE.get(medium)
    if found is None:
        if len(_ONCE) >= 1024:  # media are a handful; a flood of names must not grow this
            _ONCE.clear()
        found = _ONCE[medium] = {medium: 1}
    return found


def _oldest(blocks: dict[int, EngineBlock], n: int) -> tuple[list[tuple[int, EngineBlock]], int]:
    """The first-stored blocks that weigh at least ``n`` together, and their weight. Each
    weighs at least 1, so they are among the first ``n``: their weights are summed with C-level
    iteration (:func:`~kvcm.engines.entries.weight`: the keys, at least 1) and the prefix cut there."""
    first = list(islice(blocks.items(), max(0, n)))
    sums = list(accumulate(map(max, map(len, map(_KEYS, map(itemgetter(1), first))), repeat(1))))
    cut = bisect_left(sums, n) + 1 if sums and sums[-1] >= n else len(first)
    return first[:cut], sums[cut - 1] if cut else 0


def _held_keys(gone: list[tuple[int, EngineBlock]]) -> dict[tuple[str, str, int], list[int]]:
    """The kvcm keys dropped blocks held, per ``(lora, medium, group)`` slot: each medium of a
    block holds its keys once in the table, however many holdings. The usual eviction (blocks of
    one adapter and group, held once on one medium: their ``refs`` is one shared map) is grouped
    with C-level iteration; anything else block by block."""
    blks = list(map(itemgetter(1), gone))
    if (
        blks
        and max(map(itemgetter(0), gone)) <= M64
        and len(set(map(id, map(_REFS, blks)))) == 1
        and len(set(map(_LORA, blks))) == 1
    ):
        keys = list(chain.from_iterable(map(_KEYS, blks)))
        return {(blks[0].lora, medium, 0): keys for medium in blks[0].refs} if keys else {}
    held: dict[tuple[str, str, int], list[int]] = {}
    for bid, blk in gone:
        if blk.keys:
            for medium in blk.refs:
                held.setdefault((blk.lora, medium, bid >> 64), []).extend(blk.keys)
    return held


def _u64_hashes(raw: list[ExternalBlockHash]) -> list[int]:
    """Engine hashes as unsigned 64-bit ints; vLLM's own (ints, none negative) as they are."""
    try:
        if raw and min(raw) >= 0 and max(raw) <= M64:  # type: ignore[operator]
            return raw  # type: ignore[return-value]
    except TypeError:  # bytes among them
        pass
    return [h & M64 if type(h) is int else hash_to_u64(h) for h in raw]


def _has_extras(ev: BlockStored) -> bool:
    """Whether a store may have extra keys (an adapter, or an entry that is not null)."""
    extra = ev.extra_keys
    return bool(ev.lora_name) or (extra is not None and extra.count(None) != len(extra))


def _step_digests(ev: BlockStored, blocks: int, pos: int, step: int, block_size: int) -> list[int | None] | str | None:
    """Per hash step of a store (``_plan``), the digest of the extra keys that closes it; None
    for a store without any; or the error kind that refuses it. A digest belongs to an engine
    block, so a re-chunked store (engine and instance block sizes differ) can only place one
    that every block has alike: its adapter's name alone, mixed into every kvcm key."""
    if ev.extra_keys is None and not ev.lora_name:
        return None
    try:
        digests = event_digests(ev.extra_keys, ev.lora_name, blocks)
        if digests is None or ev.block_size == block_size:
            return digests
        lora = lora_digest(ev.lora_name) if ev.lora_name else None
    except ExtraKeysError:
        return "bad_extra_keys"
    if lora is None or any(d != lora for d in digests):
        return "extra_keys_block_size"
    return [lora if (pos + (i + 1) * step) % block_size == 0 else None for i in range(len(ev.token_ids) // step)]


def _mask(table: HolderTable, sources: Collection[str]) -> int:
    """The slots of ``sources`` (a match leaves stale sources out this way)."""
    mask = 0
    for source_id in sources:
        for sid in table.source_slots(source_id):
            mask |= 1 << sid
    return mask
