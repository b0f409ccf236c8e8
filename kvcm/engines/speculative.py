"""Speculative entries: blocks a router says it just sent to a source (``note_routed``).

Between a routing decision and the engine's ``BlockStored`` there is a prefill's worth of time
in which the index does not know the engine will hold the prompt, so a second request with the
same prefix would be routed as if nobody had it (llm-d keeps such short-lived entries for that).
An entry is ``(instance, source, kvcm keys of the prompt, expiry)``; a ``match_engines`` query
counts, per source, the longest prefix of the query an entry of that source covers, beyond what
the source really holds, at ``events.speculative_weight``, flagged ``speculative``.

An entry ends when its ttl ends, or when the source really holds every key the entry names (the
engine's event confirmed it: it is then only the index's business). Memory is bounded: at most
``max_entries`` entries, the oldest dropped first and counted.

Thread ownership: none of its own; :class:`~kvcm.engines.service.EngineService` calls it from
the RPC thread only (the index it reads takes its own lock).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from kvcm.engines.index import EngineIndex
from kvcm.engines.scoring import BLOCKS, MEDIA, SCORE, SOURCE, Fragment, fragment

#: Keys held by all entries together at most (each a prompt's kvcm keys): with
#: ``events.speculative_max_entries``, what bounds the entries' memory (about 40 MB).
MAX_KEYS = 1 << 20
_SWEEP = 8  # expired entries ended per note_routed, the oldest first (matches end the others)


@dataclass(frozen=True)
class Entry:
    instance_id: str
    source_id: str
    keys: tuple[int, ...]
    expires_at: float  # on the entries' monotonic clock
    lora_name: str = ""  # the adapter namespace the prompt was routed in


class SpeculativeEntries:
    """The live ``note_routed`` entries, bounded (see the module docstring)."""

    def __init__(
        self, max_entries: int, max_ttl_s: float, clock: Callable[[], float] = time.monotonic, max_keys: int = MAX_KEYS
    ) -> None:
        self.max_entries = max_entries
        self.max_ttl_s = max_ttl_s
        self.max_keys = max_keys
        self._clock = clock
        self._ids = itertools.count()
        self._entries: dict[int, Entry] = {}  # insertion order = oldest first
        self._keys = 0  # keys held by all entries
        # (instance, adapter, first key) -> entry ids: a query looks at the entries that share
        # its first block only (no common prefix otherwise)
        self._by_head: dict[tuple[str, str, int], set[int]] = {}
        self._per_instance: dict[str, int] = {}
        #: entries ended so far, by why: ``expired``, ``confirmed``, ``dropped`` (over a cap)
        #: and ``removed`` (their source went away)
        self.ended = {"expired": 0, "confirmed": 0, "dropped": 0, "removed": 0}

    def __len__(self) -> int:
        return len(self._entries)

    def note(self, instance_id: str, source_id: str, keys: Sequence[int], ttl_s: float, lora_name: str | None = None) -> float:
        """Add an entry; returns its ttl. No keys, no entry: an entry is found by its first key."""
        if not keys:
            return ttl_s
        now = self._clock()
        for oldest in list(itertools.islice(self._entries, _SWEEP)):  # the oldest first: most share one ttl
            if self._entries[oldest].expires_at > now:
                break
            self._end(oldest, "expired")
        kept = tuple(keys[: self.max_keys])
        while self._entries and (len(self._entries) >= self.max_entries or self._keys + len(kept) > self.max_keys):
            self._end(next(iter(self._entries)), "dropped")
        entry_id = next(self._ids)
        entry = self._entries[entry_id] = Entry(instance_id, source_id, kept, now + ttl_s, lora_name or "")
        self._keys += len(kept)
        self._by_head.setdefault((instance_id, entry.lora_name, kept[0]), set()).add(entry_id)
        self._per_instance[instance_id] = self._per_instance.get(instance_id, 0) + 1
        return ttl_s

    def active(self, instance_id: str) -> bool:
        """Whether the instance has entries (the common answer, no: one dict lookup)."""
        return instance_id in self._per_instance

    def matched(self, instance_id: str, keys: Sequence[int], lora_name: str | None = None) -> dict[str, list[tuple[int, int]]]:
        """Per source, ``(entry id, matched prefix length)`` of its live entries (of the same
        adapter) that share at least the query's first key; expired entries end here."""
        now = self._clock()
        out: dict[str, list[tuple[int, int]]] = {}
        if not keys:
            return out
        for entry_id in list(self._by_head.get((instance_id, lora_name or "", keys[0]), ())):
            entry = self._entries[entry_id]
            if entry.expires_at <= now:
                self._end(entry_id, "expired")
                continue
            out.setdefault(entry.source_id, []).append((entry_id, common_prefix(entry.keys, keys)))
        return out

    def keys_of(self, entry_id: int) -> tuple[int, ...]:
        return self._entries[entry_id].keys

    def confirm(self, entry_id: int) -> None:
        """The source holds every key of the entry now: the entry has done its job."""
        if entry_id in self._entries:
            self._end(entry_id, "confirmed")

    def forget_source(self, source_id: str) -> int:
        """End the entries of a source that is no longer followed."""
        gone = [i for i, e in self._entries.items() if e.source_id == source_id]
        for entry_id in gone:
            self._end(entry_id, "removed")
        return len(gone)

    def _end(self, entry_id: int, why: str) -> None:
        entry = self._entries.pop(entry_id)
        self._keys -= len(entry.keys)
        head = (entry.instance_id, entry.lora_name, entry.keys[0])
        ids = self._by_head.get(head)
        if ids is not None:
            ids.discard(entry_id)
            if not ids:
                del self._by_head[head]
        left = self._per_instance.get(entry.instance_id, 1) - 1
        if left > 0:
            self._per_instance[entry.instance_id] = left
        else:
            self._per_instance.pop(entry.instance_id, None)
        self.ended[why] += 1


def with_speculative(
    entries: SpeculativeEntries,
    index: EngineIndex,
    instance_id: str,
    lora_name: str | None,
    keys: Sequence[int],
    ranked: list[Fragment],
    block_size: int,
    left_out: Collection[str],
    weight: float,
    explained: Mapping[str, Mapping[str, object]] | None = None,
) -> list[Fragment]:
    """``ranked`` (a match's fragments) with each source's speculative blocks beyond what it
    really holds, at ``weight`` each; an entry whose every block the source holds now is
    confirmed and ends. ``explained``: entry fields of hybrid sources (their groups' detail),
    kept on their speculative entries. The result is in no particular order."""
    noted = entries.matched(instance_id, keys, lora_name)
    if not noted:
        return ranked
    by_source = {f[SOURCE]: f for f in ranked}
    for source_id, found in noted.items():
        state = index.get(source_id)
        if state is None or source_id in left_out:
            continue
        real = by_source.get(source_id)
        held = real[BLOCKS] if real is not None else 0
        best = 0
        for entry_id, n in found:
            if n <= held and _holds_all(index, instance_id, lora_name, source_id, entries.keys_of(entry_id), n):
                entries.confirm(entry_id)
            best = max(best, n)
        if best > held:
            media = real[MEDIA] if real is not None else {}
            score = (real[SCORE] if real is not None else 0.0) + weight * (best - held)
            extra = {**(explained or {}).get(source_id, {}), "speculative": True, "speculative_blocks": best - held}
            by_source[source_id] = fragment(source_id, state.spec.dp_rank, state.spec.pod or source_id, media, best,
                                            block_size, score, extra)
    return list(by_source.values())


def _holds_all(
    index: EngineIndex, instance_id: str, lora_name: str | None, source_id: str, keys: tuple[int, ...], matched: int
) -> bool:
    """Whether the source holds every key of an entry (``matched`` of them are known held)."""
    if matched == len(keys):
        return True
    found = index.match(instance_id, keys, lora_name=lora_name)
    return any(m.source_id == source_id and m.matched_blocks == len(keys) for m in found)


def common_prefix(a: tuple[int, ...], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two key lists."""
    n = min(len(a), len(b))
    if a[:n] == tuple(b[:n]):  # the common case (the same prompt asked again), compared in C
        return n
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
