"""Scores of ``match_engines`` entries, and the entries' pre-encoded reply fragments.

A block an engine holds on GPU saves more prefill than one it must first load from CPU, and one
kvcm's storage tier holds saves less again. So each matched block counts once, at the weight of
the best medium holding it (``events.tier_weights``, default GPU 1.0, CPU 0.8, DISK 0.6,
kvcm's STORAGE 0.5, any other medium 0.5), and the caller's load for that source, in the same
unit (blocks of work already queued there), is subtracted: Dynamo's ``overlap - load`` cost,
negated so that higher is better::

    score = sum(weight(best medium holding block i) for each matched block i) - load

Media of one source hold nested prefixes of the query, so with ``media = {GPU: 4, CPU: 6}``
blocks 0-3 count at the GPU weight and blocks 4-5 at the CPU weight: ``4*1.0 + 2*0.8 = 5.6``.
Blocks a router said it sent to a source (``note_routed``) and that the source does not hold yet
count at ``events.speculative_weight``.

Speed: a router asks ``match_engines`` thousands of times a second over a hundred sources, so a
source's entry and its pod's entry are encoded once per ``(slot, matched length)`` and kept
(:class:`Fragment`); a reply is then a sort of small tuples and one ``b"".join``.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from itertools import repeat
from operator import add, itemgetter, sub
from typing import Final

import msgspec

from kvcm.config import EventsConfig

#: ``events.tier_weights``' default; ``*`` is every medium not listed.
DEFAULT_TIER_WEIGHTS: str = EventsConfig.tier_weights

#: Bounds of one weight and of one load: beyond them a value is a mistake, not a setting.
MAX_WEIGHT = 1_000.0

#: The pseudo-source of kvcm's own storage tier in a reply (``include_storage``).
STORAGE = "storage"

_packb = msgspec.msgpack.Encoder().encode
_F64 = struct.Struct(">d").pack


class TierWeights:
    """Weight per medium (upper-cased, as the index stores media), ``other`` for the rest."""

    __slots__ = ("by_medium", "other")

    def __init__(self, by_medium: Mapping[str, float], other: float) -> None:
        self.by_medium = dict(by_medium)
        self.other = other

    def of(self, medium: str) -> float:
        return self.by_medium.get(medium, self.other)

    def of_storage(self, storage_type: str) -> float:
        """A storage type's weight: ``STORAGE.<TYPE>`` if listed, else ``STORAGE``, else ``*``."""
        named = self.by_medium.get("STORAGE." + storage_type.upper())
        return named if named is not None else self.by_medium.get("STORAGE", self.other)

    def weighted_blocks(self, media: Mapping[str, int]) -> float:
        """Each of the matched blocks once, at the best weight among the media holding it."""
        total, covered = 0.0, 0
        for weight, n in sorted(((self.of(m), n) for m, n in media.items()), reverse=True):
            if n > covered:
                total += weight * (n - covered)
                covered = n
        return total


def parse_weights(text: str) -> TierWeights:
    """``"GPU=1.0,CPU=0.8,*=0.5"`` -> :class:`TierWeights`.

    :raises ValueError: naming the bad entry (a weight must be a finite number in [0, 1000]).
    """
    by_medium: dict[str, float] = {}
    other = None
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, raw = part.partition("=")
        name = name.strip().upper()
        try:
            weight = float(raw) if sep and name else math.nan
        except ValueError:
            weight = math.nan
        if not 0.0 <= weight <= MAX_WEIGHT:  # also refuses NaN
            raise ValueError(f"bad entry {part[:60]!r}: expected MEDIUM=WEIGHT with 0 <= WEIGHT <= {MAX_WEIGHT:g}")
        if name in by_medium or (name == "*" and other is not None):
            raise ValueError(f"medium {name[:40]!r} is listed twice")
        if name == "*":
            other = weight
        else:
            by_medium[name] = weight
    if other is None:
        other = min(by_medium.values(), default=1.0)  # an unlisted medium is no better than the worst listed
    return TierWeights(by_medium, other)


# --- reply fragments ------------------------------------------------------------------------------

#: One ranked entry: ``(score, matched_blocks, source_id, pod, entry_head, pod_head, entry,
#: pod_entry, dp_rank, media)``. ``*_head`` is the encoded map up to the ``score`` value (always
#: the last field); ``entry`` and ``pod_entry`` are the whole maps at load 0. Tuples, not
#: objects: sorting and joining them is C.
Fragment = tuple[float, int, str, str, bytes, bytes, bytes, bytes, int, dict[str, int]]

SCORE: Final = 0
BLOCKS: Final = 1
SOURCE: Final = 2
POD: Final = 3
ENTRY_HEAD: Final = 4
POD_HEAD: Final = 5
ENTRY: Final = 6
POD_ENTRY: Final = 7
DP_RANK: Final = 8
MEDIA: Final = 9

_SCORE_KEY = _packb("score")


def score_bytes(score: float) -> bytes:
    """msgpack float64, as msgspec encodes a float."""
    return b"\xcb" + _F64(score)


def fragment(
    source_id: str,
    dp_rank: int,
    pod: str,
    media: Mapping[str, int],
    matched: int,
    block_size: int,
    score: float,
    extra: Mapping[str, object] | None = None,
) -> Fragment:
    """Encode one source's entry and its single-rank pod entry (``extra``: more entry fields,
    e.g. the speculative ones)."""
    entry = {
        "source_id": source_id, "dp_rank": dp_rank, "matched_blocks": matched, "media": dict(media),
        "pod": pod, "matched_tokens": matched * block_size,
        "media_tokens": {m: k * block_size for m, k in media.items()}, **(extra or {}),
    }  # fmt: skip
    pod_entry = {"pod": pod, "matched_blocks": matched, "matched_tokens": matched * block_size,
                 "best_source": source_id, "sources": [source_id]}  # fmt: skip
    entry_head = _with_score_key(entry)
    pod_head = _with_score_key(pod_entry)
    value = score_bytes(score)
    return (score, matched, source_id, pod, entry_head, pod_head, entry_head + value, pod_head + value, dp_rank,
            dict(media))  # fmt: skip


def rescored(frag: Fragment, score: float) -> Fragment:
    """``frag`` at another score (the caller's load subtracted)."""
    value = score_bytes(score)
    return (score, frag[1], frag[2], frag[3], frag[4], frag[5], frag[4] + value, frag[5] + value, frag[8], frag[9])


def _with_score_key(fields: dict[str, object]) -> bytes:
    """The map of ``fields`` plus a last key ``score``, its value left for the caller."""
    packed = _packb(fields)
    n = len(fields) + 1
    if n >= 16:
        raise ValueError("an entry map has at most 15 fields")
    return bytes((0x80 | n,)) + packed[1:] + _SCORE_KEY


def map_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x80 | n,))
    return b"\xde" + n.to_bytes(2, "big")


def array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    return b"\xdc" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xdd" + n.to_bytes(4, "big")


# --- ranking and the reply ------------------------------------------------------------------------

_BY_SOURCE = itemgetter(SOURCE)
_BY_BLOCKS = itemgetter(BLOCKS)
_BY_SCORE = itemgetter(SCORE)
_ENTRIES = itemgetter(ENTRY)
_POD_ENTRIES = itemgetter(POD_ENTRY)
_ENTRY_HEADS = itemgetter(ENTRY_HEAD)
_POD_HEADS = itemgetter(POD_HEAD)
_RUN_ENTRIES, _RUN_PODS, _RUN_COUNT = itemgetter(1), itemgetter(2), itemgetter(3)
_PACK_SCORE = struct.Struct(">Bd").pack  # msgpack float64: 0xcb, then the big-endian double


def with_loads(ranked: list[Fragment], loads: Mapping[str, float]) -> list[Fragment]:
    """The fragments whose source has a load, rescored; the others as they are."""
    return [rescored(f, f[SCORE] - loads[f[SOURCE]]) if f[SOURCE] in loads else f for f in ranked]


def order_ties(ranked: list[Fragment]) -> None:
    """More blocks first, then source id: the order ties on the score keep."""
    ranked.sort(key=_BY_SOURCE)
    ranked.sort(key=_BY_BLOCKS, reverse=True)


def sort_ranked(ranked: list[Fragment], in_order: bool = True) -> None:
    """Best score first, then more blocks, then source id. ``in_order``: ``ranked`` is
    already by blocks then source id (the index's walk), so one stable sort on the score, a
    float, does it: and when the scores follow the blocks it is one linear pass."""
    if not in_order:
        order_ties(ranked)
    ranked.sort(key=_BY_SCORE, reverse=True)  # stable, also reversed


def encode_loaded(
    ranked: list[Fragment], loads: Mapping[str, float], limit: int, block_size: int, distinct: bool
) -> tuple[bytes, bytes]:
    """``sources`` and ``pods`` of a reply with the caller's loads subtracted, best first.
    ``ranked`` is in tie order (:func:`order_ties`). Every step is a C-level map: a router
    passes a load for each of a hundred sources on every call."""
    scores = list(map(sub, map(_BY_SCORE, ranked), map(loads.get, map(_BY_SOURCE, ranked), repeat(0.0))))
    order = sorted(range(len(ranked)), key=scores.__getitem__, reverse=True)  # stable: ties keep their order
    if limit > 0:
        del order[limit:]
    frags = list(map(ranked.__getitem__, order))
    values = list(map(_PACK_SCORE, repeat(0xCB), map(scores.__getitem__, order)))
    sources = array_header(len(frags)) + b"".join(map(add, map(_ENTRY_HEADS, frags), values))
    if distinct:
        return sources, array_header(len(frags)) + b"".join(map(add, map(_POD_HEADS, frags), values))
    rescored_frags = [rescored(f, scores[i]) for f, i in zip(frags, order)]
    return sources, encode_pods(rescored_frags, block_size)


def encode_sources(ranked: list[Fragment]) -> bytes:
    return array_header(len(ranked)) + b"".join(map(_ENTRIES, ranked))


def encode_runs(
    runs: Sequence[tuple[list[Fragment], bytes, bytes, int]], block_size: int, distinct: bool, sources_key: bytes,
    pods_key: bytes,
) -> list[bytes]:
    """The reply's ``sources`` and ``pods`` (keys included) of runs already in ranking order,
    as pieces of the reply: their joined entries are copied once, into the reply itself."""
    head = array_header(sum(map(_RUN_COUNT, runs)))
    if distinct:
        return [sources_key, head, *map(_RUN_ENTRIES, runs), pods_key, head, *map(_RUN_PODS, runs)]
    return [sources_key, head, *map(_RUN_ENTRIES, runs), pods_key,
            encode_pods([f for run in runs for f in run[0]], block_size)]  # fmt: skip


def encode_pods(ranked: list[Fragment], block_size: int, distinct: bool = False) -> bytes:
    """The pods of the ranked sources, best first: a pod is as good as its best rank, whose
    figures it shows, and lists its ranks best first. ``distinct``: the caller knows every
    source is its own pod."""
    if distinct or len({f[POD] for f in ranked}) == len(ranked):  # one rank per pod: the kept entries
        return array_header(len(ranked)) + b"".join(map(_POD_ENTRIES, ranked))
    pods: dict[str, list[Fragment]] = {}
    for f in ranked:  # best first: a pod's first rank is its best
        pods.setdefault(f[POD], []).append(f)
    parts = [array_header(len(pods))]
    for pod, ranks in pods.items():
        best = ranks[0]
        parts.append(_packb({"pod": pod, "matched_blocks": best[BLOCKS], "matched_tokens": best[BLOCKS] * block_size,
                             "best_source": best[SOURCE], "sources": [f[SOURCE] for f in ranks],
                             "score": best[SCORE]}))  # fmt: skip
    return b"".join(parts)


def pod_summary(ranked: list[Fragment]) -> list[tuple[str, Fragment, list[str]]]:
    """``(pod, best rank, ranks)`` best first, for callers that shape pods themselves."""
    pods: dict[str, tuple[str, Fragment, list[str]]] = {}
    for f in ranked:
        known = pods.get(f[POD])
        if known is None:
            pods[f[POD]] = (f[POD], f, [f[SOURCE]])
        else:
            known[2].append(f[SOURCE])
    return list(pods.values())
