"""Hybrid-aware matching: the prefix an engine with several KV-cache groups can really reuse.

A hybrid model (full attention + sliding window: Gemma 3, gpt-oss; full attention + Mamba or
linear attention: Qwen3-Next, Jamba, Nemotron-H) keeps one KV-cache group per layer kind, each
with its own blocks, block size and evictions, and vLLM reports each group's stores and removals
(``group_idx``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``, the group's
``block_size``). The engine reuses a prefix of ``L`` tokens only if every group can resume at
``L`` (vLLM's ``HybridKVCacheCoordinator.find_longest_cache_hit`` and each group manager's
``find_longest_cache_hit``), so kvcm answers the longest such ``L``, a multiple of every group's
engine block size, with:

* full-attention-like groups (``full_attention``, ``mla_attention``, ``sink_full_attention``, or
  no kind): every block before ``L`` held;
* sliding-window groups (``sliding_window``, ``sliding_window_mla``) of window ``w`` and engine
  block ``e``: the ``ceil((w - 1) / e)`` blocks before ``L`` held (those covering the window's
  last ``w - 1`` tokens: the token at ``L`` attends to itself), or every block before ``L`` when
  ``L`` is shorter than that;
* Mamba groups (``mamba``): the block ending at ``L`` held (its state exists only there).

Everything else is a group kvcm cannot reason about, and a wrong answer is worse than none: a
source with such a group holds nothing by default, and its entry says why (:class:`Unsupported`).
That is ``chunked_local_attention`` (events carry no chunk size), ``cross_attention`` and
``encoder_only_attention`` (vLLM does not prefix-cache them), ``unknown`` and any other name, a
sliding-window group without a window, a group whose engine block is not a multiple of the
instance's block or whose block size changed, and under ``report_mode: full`` the sliding-window
and Mamba groups: vLLM re-reports a reused prefix of such a group as dense from its root, naming
the skipped blocks it does not hold (vllm-project/vllm#57358).

Positions here are kvcm keys (instance blocks of ``b`` tokens): a group of engine block ``e = k*b``
holds key ``i`` when it holds the engine block covering it. Per query, each group of a source is
one byte string over the query's keys (1 = held), built with two C-level passes over the holder
masks, and the candidates are walked down from the full groups' common prefix with ``bytes.rfind``
(a missing key inside a window moves the candidate below it at once): about one pass over the
keys per group.

Thread ownership: pure functions; :class:`~kvcm.engines.index.EngineIndex` calls them under its lock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import repeat
from math import lcm
from operator import and_, methodcaller, truth
from typing import Any, NamedTuple

FULL_KINDS = frozenset({None, "full_attention", "mla_attention", "sink_full_attention"})
WINDOW_KINDS = frozenset({"sliding_window", "sliding_window_mla"})
STATE_KINDS = frozenset({"mamba"})
#: Kinds whose re-reports under ``report_mode: full`` name blocks the group does not hold.
SPARSE_KINDS = WINDOW_KINDS | STATE_KINDS
#: Why kvcm does not reason about these known kinds.
_NOT_REASONED = {
    "chunked_local_attention": "vLLM's events carry no attention chunk size",
    "cross_attention": "vLLM does not prefix-cache cross-attention",
    "encoder_only_attention": "vLLM does not prefix-cache encoder-only attention",
}
#: Characters of a group kind kvcm keeps (vLLM's longest is 23).
MAX_KIND = 64
#: ``GroupInfo.block_size`` of a group whose stores named different block sizes.
VARIES = -1
FULL = "full"
INCREMENTAL = "incremental"
REPORT_MODES = (INCREMENTAL, FULL)
_ZERO = b"\0"
_ONE = b"\1"


class GroupInfo(NamedTuple):
    """What a source's events said about one of its KV-cache groups (persisted with the source)."""

    kind: str | None = None
    window: int | None = None  # kv_cache_spec_sliding_window, tokens
    block_size: int = 0  # the engine's block size of the group, tokens (0: not seen; VARIES)


def noted(info: GroupInfo | None, kind: str | None, window: int | None, block_size: int) -> GroupInfo:
    """``info`` updated by one store event of the group (the same object when nothing changed:
    the common case, on the ingest path). A kind longer than any vLLM names is kept shortened
    (it is persisted with the source and named in replies): it is no kind kvcm reasons about."""
    if kind is not None and len(kind) > MAX_KIND:
        kind = kind[:MAX_KIND] + "..."
    if info is None:
        return GroupInfo(kind, window, max(block_size, 0))
    same_size = block_size <= 0 or block_size == info.block_size or info.block_size == VARIES
    if (kind is None or kind == info.kind) and (window is None or window == info.window) and same_size:
        return info
    size = info.block_size
    if not same_size:
        size = block_size if size == 0 else VARIES
    return GroupInfo(info.kind if kind is None else kind, info.window if window is None else window, size)


#: One group's entry of a reply's ``groups`` (``group_idx``, ``kind``, ``block_size``, ``window``,
#: ``held_blocks``, ``reusable_blocks``).
GroupDetail = dict[str, int | str | None]

def group_record(group: int, info: GroupInfo) -> list[int | str | None]:
    return [group, info.kind, info.window, info.block_size]


def group_from_record(raw: Sequence[Any]) -> tuple[int, GroupInfo]:
    """A persisted group: ``[group, kind]`` (before the window and block size were kept) or
    ``[group, kind, window, block_size]``."""
    group, kind = int(raw[0]), raw[1]
    if len(raw) < 4:
        return group, GroupInfo(kind)
    return group, GroupInfo(kind, None if raw[2] is None else int(raw[2]), int(raw[3]))


class Rule(NamedTuple):
    """One group resolved against the instance's block size: what ``L`` needs of it."""

    group: int
    info: GroupInfo
    k: int  # engine block, in instance blocks


class Unsupported(NamedTuple):
    """A source kvcm does not reason about: why, naming the group."""

    group: int
    info: GroupInfo
    reason: str


def rules(groups: Mapping[int, GroupInfo], block_size: int, report_mode: str) -> tuple[list[Rule], int] | Unsupported:
    """The source's groups as rules and the alignment ``L`` must keep (in instance blocks), or
    the first group kvcm cannot reason about."""
    out: list[Rule] = []
    align = 1
    for group in sorted(groups):
        info = groups[group]
        reason = _unreasoned(info, block_size, report_mode)
        if reason:
            return Unsupported(group, info, reason)
        k = (info.block_size or block_size) // block_size
        out.append(Rule(group, info, k))
        align = lcm(align, k)
    return out, align


def _unreasoned(info: GroupInfo, block_size: int, report_mode: str) -> str:
    kind = info.kind
    if kind not in FULL_KINDS and kind not in WINDOW_KINDS and kind not in STATE_KINDS:
        return _NOT_REASONED.get(str(kind), f"kind {str(kind)[:64]!r} is not one kvcm reasons about")
    if kind in WINDOW_KINDS and (info.window is None or info.window <= 0):
        return f"{kind} group without a window (kv_cache_spec_sliding_window)"
    if info.block_size == VARIES:
        return "its stores named different block sizes"
    if info.block_size % block_size:
        return f"engine block of {info.block_size} tokens is not a multiple of the instance's {block_size}"
    if report_mode == FULL and kind in SPARSE_KINDS:
        return (
            f"report_mode full: vLLM re-reports a reused {kind} prefix as dense from its root, "
            f"naming blocks the group does not hold (vllm-project/vllm#57358)"
        )
    return ""


def window_start(rule: Rule, end: int, block_size: int) -> int:
    """The first key a sliding-window group must hold for a prefix of ``end`` keys."""
    first_token = end * block_size - (rule.info.window or 0) + 1
    return 0 if first_token <= 0 else first_token // (rule.k * block_size) * rule.k


#: ``_BIT[j]`` maps a byte to 1 where its bit ``j`` is set, else 0 (``bytes.translate``).
_BIT = [bytes(1 if byte >> j & 1 else 0 for byte in range(256)) for j in range(8)]
#: Bytes of the per-query matrix at most (keys x mask width); a wider table's columns are made
#: one by one from the masks instead.
MAX_MATRIX = 8 << 20


class Holdings:
    """The query's holder masks as columns: per slot, a byte per key, 1 where the slot holds it.

    The masks are laid out once as a matrix of fixed-width little-endian rows, so a slot's column
    is one strided slice and one ``translate`` (both C, no int per key), whatever the number of
    hybrid sources asked about."""

    __slots__ = ("first", "masks", "matrix", "n", "width")

    def __init__(self, masks: Sequence[int], slots: int) -> None:
        self.masks = masks
        self.n = len(masks)
        self.first = masks[0] if masks else 0
        self.width = max(1, (slots + 7) // 8)
        self.matrix = b""
        if self.n * self.width <= MAX_MATRIX:
            self.matrix = b"".join(map(methodcaller("to_bytes", self.width, "little"), masks))

    def column(self, sid: int) -> bytes:
        if self.matrix or not self.n:
            return self.matrix[sid >> 3 :: self.width].translate(_BIT[sid & 7])
        return bytes(map(truth, map(and_, self.masks, repeat(1 << sid))))


def reusable(found: Sequence[tuple[Rule, bytes]], n: int, align: int, block_size: int) -> int:
    """The longest prefix (keys, a multiple of ``align``, at most ``n``) every group allows;
    each column covers at least the first ``n`` keys."""
    limit = n
    for rule, col in found:
        if rule.info.kind in FULL_KINDS:
            miss = col.find(_ZERO, 0, limit)
            if miss >= 0:
                limit = miss
    end = limit // align * align
    while end > 0:
        for rule, col in found:
            kind = rule.info.kind
            if kind in FULL_KINDS:
                continue
            start = end - rule.k if kind in STATE_KINDS else window_start(rule, end, block_size)
            miss = col.rfind(_ZERO, start, end)
            if miss >= 0:
                # No prefix ending past a missing key of its window (or state block) is whole,
                # nor one ending inside the run of missing keys below it: continue below that run.
                held = col.rfind(_ONE, 0, miss)
                end = (held + 1) // align * align if held >= 0 else 0
                break
        else:
            return end
    return 0


def held_prefix(col: bytes, n: int) -> int:
    """Keys held from the first one on."""
    miss = col.find(_ZERO, 0, n)
    return n if miss < 0 else miss


def detail(rule: Rule, block_size: int, held: int, reuse: int) -> GroupDetail:
    """One group's entry of a reply's ``groups``."""
    out: GroupDetail = {"group_idx": rule.group, "kind": rule.info.kind, "block_size": rule.k * block_size}
    if rule.info.kind in WINDOW_KINDS:
        out["window"] = rule.info.window
    out["held_blocks"] = held
    out["reusable_blocks"] = reuse
    return out


def unsupported_detail(groups: Mapping[int, GroupInfo]) -> list[GroupDetail]:
    """The groups of a source kvcm does not reason about, as the reply names them."""
    out = []
    for group in sorted(groups):
        info = groups[group]
        entry: GroupDetail = {"group_idx": group, "kind": info.kind, "block_size": info.block_size}
        if info.window is not None:
            entry["window"] = info.window
        out.append(entry)
    return out


class Answer(NamedTuple):
    """A hybrid source's answer to one query: reusable keys per medium (those above 0), its
    groups' detail (on its best medium), and why it holds nothing when kvcm cannot tell."""

    media: dict[str, int]
    groups: list[GroupDetail]
    unsupported: str | None


def answer(
    groups: Mapping[int, GroupInfo],
    report_mode: str,
    slots: Mapping[tuple[str, int], int],
    rows: Holdings,
    block_size: int,
    media: frozenset[str] | None,
) -> Answer | None:
    """One hybrid source's answer over the query's holdings (``slots``: its slot ids by
    ``(medium, group)``), or None when none of its groups holds the query's first key."""
    mine = {m for m, _ in slots if media is None or m in media}
    union = 0
    for (medium, _), sid in slots.items():
        if medium in mine:
            union |= 1 << sid
    if not rows.first & union:
        return None
    resolved = rules(groups, block_size, report_mode)
    if isinstance(resolved, Unsupported):
        group, info, reason = resolved
        return Answer({}, unsupported_detail(groups), f"group {group} ({info.kind}): {reason}")
    found_rules, align = resolved
    n = rows.n
    best: tuple[int, int, str] | None = None
    per_medium: dict[str, list[tuple[Rule, bytes]]] = {}
    result: dict[str, int] = {}
    for medium in sorted(mine):
        found = []
        for rule in found_rules:
            held_by = slots.get((medium, rule.group))
            found.append((rule, rows.column(held_by) if held_by is not None else bytes(n)))
        per_medium[medium] = found
        keys = reusable(found, n, align, block_size)
        if keys:
            result[medium] = keys
        held = max(held_prefix(col, n) for _, col in found)
        if best is None or (keys, held) > best[:2]:
            best = (keys, held, medium)
    assert best is not None  # internal: the first key is held on one of its media
    shown = [
        detail(rule, block_size, held_prefix(col, n), reusable([(rule, col)], n, rule.k, block_size))
        for rule, col in per_medium[best[2]]
    ]
    return Answer(result, shown, None)
