"""A group's bound on indexed block copies, ``max_block_count`` (Tair's
``meta_indexer_config.max_key_count``), enforced by ``start_write_cache``.

The count is the group's usage book's: every copy the index holds, ``writing`` and ``deleting``
ones included until the deleter frees them (as Tair counts the keys its indexer holds). A start
that would pass the bound makes room in-line, as a full quota does (:mod:`kvcm.cache.room`), when
the group evicts in-line at all (:func:`evicts_inline`) and frees at once
(``delay_before_delete_ms = 0``): a victim kept for a grace delay stays counted, so evicting it
could not admit the write. Otherwise the start is ``QUOTA_EXCEEDED`` and the reclaimer's rounds
(which reclaim by block count too) make the room.
"""

from __future__ import annotations

from collections.abc import Collection

import msgpack

from kvcm.backends.metastore.base import ReadTxn, WriteTxn
from kvcm.cache.removal import Doomed, evict_inline, free_after_commit
from kvcm.cache.room import RoomMaker, Victim
from kvcm.cache.state import CacheState
from kvcm.cache.usage import DB, Key
from kvcm.control.records import InstanceGroup
from kvcm.errors import CapacityError, Code

_ANY = 1 << 62  # bytes asked of the room maker: the victims' number, not their size, is the bound


def evicts_inline(group: InstanceGroup) -> bool:
    """Whether a full group makes room in-line: only when its watermark could fire at all. A
    ``used_percentage`` above 1 without ``used_bytes`` is Tair's "never reclaim by share": such a
    group refuses writes when full, as Tair's does, until its strategy changes."""
    strategy = group.reclaim_strategy
    return strategy.used_percentage <= 1 or strategy.used_bytes > 0


def group_blocks(view: ReadTxn, group: str) -> int:
    """Block copies the group's usage book counts in ``view``."""
    return sum(int(msgpack.unpackb(value)[1]) for _, value in view.scan(DB, prefix=group.encode() + b"\0"))


def bound_blocks(s: CacheState, txn: WriteTxn, group: InstanceGroup, adding: int,
                 spare: Collection[tuple[str, int]], usage: dict[Key, list[int]]) -> None:
    """Admit ``adding`` new copies under ``group.max_block_count``, evicting in-line if allowed;
    ``spare``: the request's own keys (never evicted); ``usage`` gets the dropped copies' deltas.

    :raises CapacityError: QUOTA_EXCEEDED, saying what is indexed and why nothing was evicted."""
    limit = group.max_block_count
    if not limit:
        return
    used = group_blocks(txn, group.name)
    over = used + adding - limit
    if over <= 0:
        return
    if adding > limit:
        why = "the request alone is over the bound"
    elif s.room_maker is None:
        why = "no room maker (in-line eviction off): the reclaimer's next round frees space"
    elif not evicts_inline(group):
        why = "off for this group (used_percentage above 1 and no used_bytes: never reclaimed by share)"
    elif s.delay(group.name) > 0:
        why = "off: evicted copies stay counted for delay_before_delete_ms; the reclaimer frees them"
    else:
        dropped = _evict(s, txn, s.room_maker, group.name, over, spare, usage)
        if dropped >= over:
            return
        why = f"{dropped} copies dropped, {over - dropped} more needed and nothing else to evict"
    raise CapacityError(f"instance group {group.name!r} block count exceeded: {used} of {group.max_block_count} "
                        f"block copies indexed, {adding} more requested; in-line eviction: {why}", Code.QUOTA_EXCEEDED)


def _evict(s: CacheState, txn: WriteTxn, maker: RoomMaker, group: str, over: int,
           spare: Collection[tuple[str, int]], usage: dict[Key, list[int]]) -> int:
    """Drop up to ``over`` victims of the group's policy in ``txn``; returns how many copies left
    the count (read from the usage deltas: a victim with another copy is only marked)."""
    before = sum(delta[1] for delta in usage.values())
    marked: list[Victim] = []
    spared: list[Victim] = []
    dropped: dict[str, int] = {}
    doomed: Doomed = {}
    txn.on_abort(lambda: maker.give_back(list(marked)) if marked else None)
    txn.on_commit(lambda: free_after_commit(s, doomed) if doomed else None)
    try:
        for _ in range(3):  # later rounds replace victims the maker's lagging view got wrong
            left = min(over, s.inline_limit) - len(marked)
            if left <= 0:
                break
            offered = maker.make_room(group, {"": _ANY}, left).victims[:left]
            spared += [v for v in offered if (v[0], v[1]) in spare]
            evict_inline(s, txn, group, [v for v in offered if (v[0], v[1]) not in spare], marked, dropped,
                         doomed, usage)
            if not offered or before - sum(delta[1] for delta in usage.values()) >= over:
                break
    finally:
        if spared:
            maker.give_back(spared)
    return before - sum(delta[1] for delta in usage.values())
