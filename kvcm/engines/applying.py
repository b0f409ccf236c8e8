"""Applying engine events to the index: stores re-hashed into kvcm keys, removes, clears.

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
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import MutableMapping, Sequence
from itertools import compress, repeat
from operator import and_, is_, or_

from kvcm.engines.bounds import BoundedIndex
from kvcm.engines.entries import (
    M64,
    ApplyStats,
    EngineBlock,
    Item,
    SourceState,
    block_id,
    new_block,
    normalize_medium,
    weight,
)
from kvcm.engines.hashing import Chain, Precomputed, chain_states, chain_states_mixed, hash_chains, to_signed
from kvcm.engines.hybrid import FULL, noted
from kvcm.errors import KvcmError
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
from kvcm.proto.wire import Decoded
from kvcm.threads import gc_paused

#: ``BlockStored.extra_keys`` of a store whose hashes are kvcm keys already (``report_events``'
#: ``keyed`` adds: Tair's reporters name blocks by key and send no tokens). Compared by identity,
#: so no decoded engine payload can carry it.
KEYED: list[Decoded] = ["kvcm-keys"]


class EventApplier(BoundedIndex):
    """Engine event batches applied to the index (module docstring)."""

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
        states = _chain_states(ev, len(hashes), plan, pre, errors)
        if states is None:
            return 0
        self._index_states(state, ev, hashes, states, plan, medium)
        return len(hashes)

    def _index_states(
        self,
        state: SourceState,
        ev: BlockStored,
        hashes: list[int],
        states: list[int],
        plan: tuple[int, int, int, int],
        medium: str,
    ) -> None:
        """Index a re-hashed store's blocks; their keys newly held on ``medium`` go into the table."""
        _, pos, step, block_size = plan
        group = ev.group_idx or 0
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
        """A store of any kind, one block at a time (held ones gain a holding): the keys newly held."""
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



_IGNORED: Counter[str] = Counter()  # errors of the precompute pass are counted when applied



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



def _u64_hashes(raw: list[ExternalBlockHash]) -> list[int]:
    """Engine hashes as unsigned 64-bit ints; vLLM's own (ints, none negative) as they are."""
    try:
        if raw and min(raw) >= 0 and max(raw) <= M64:  # type: ignore[operator]
            return raw  # type: ignore[return-value]
    except TypeError:  # bytes among them
        pass
    return [h & M64 if type(h) is int else hash_to_u64(h) for h in raw]


def _chain_states(
    ev: BlockStored, blocks: int, plan: tuple[int, int, int, int], pre: Precomputed, errors: MutableMapping[str, int]
) -> list[int] | None:
    """The store's running hash states per hash step, from ``pre`` when it assumed the seed the
    store's parent gives; None (and the error counted) when the store is refused."""
    seed, pos, step, block_size = plan
    digests = _step_digests(ev, blocks, pos, step, block_size)
    if isinstance(digests, str):
        errors[digests] += 1  # never indexed without its extra keys: that would be another block's key
        return None
    found = pre.get(id(ev)) if digests is None else None
    try:
        if found is not None and found[0] == seed & M64:
            return found[1]
        if digests is None:
            return chain_states(seed, ev.token_ids, step)
        return chain_states_mixed(seed, ev.token_ids, step, digests)
    except EventDecodeError:  # packed token ids that are not ids (read only now): the store is refused
        errors["bad_token_ids"] += 1
        return None


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
