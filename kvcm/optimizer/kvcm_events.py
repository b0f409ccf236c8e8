"""kvcm's event log (JSON lines) and its reader for the optimizer (format ``kvcm_events``).

The server writes one JSON object per line, the four event types of Tair KVCM's
``LogEventPublisher`` with the same field names, and kvcm's own pin events. Every line has:

=================== ========================================================================
``id``              str, unique per event
``source``          str, the ``instance_id``
``component``       ``"cache_manager"`` or ``"cache_reclaimer"``
``type``            ``"GetCacheLocation"``, ``"StartWriteCache"``, ``"FinishWriteCache"``,
                    ``"CacheReclaimSubmit"``, ``"PinCache"`` or ``"UnpinCache"``
``trigger_time_us`` int, wall clock in microseconds since the epoch
=================== ========================================================================

and, per type (a *mask* is an int offset, a list of bools, kvcm's wire form ``{"offset": n}``
/ ``{"bool_masks": [...]}``, or absent/null for "nothing"):

* ``GetCacheLocation`` (emitted on success): ``query_type`` (``"prefix_match"``,
  ``"batch_get"``, ``"reverse_roll_sw_match"``), ``keys`` (block keys; derived from the tokens
  when the client sent tokens), ``tokens`` (the request's token ids, may be ``[]``),
  ``block_mask`` (blocks already on the device), ``sw_size`` (int), ``location_spec_names``
  ([str]);
* ``StartWriteCache``: ``write_session_id`` (str), ``keys`` (all request keys), ``tokens``,
  ``block_mask`` (the server's filter result over ``keys``: set / below the offset = already
  stored, not written in this session), ``location_spec_group_names`` ([str]),
  ``write_timeout_seconds`` (int);
* ``FinishWriteCache``: ``write_session_id``, ``success_block`` (a mask over the session's *new*
  keys, i.e. ``keys`` minus the masked ones: offset n = the first n succeeded; a bool per key);
  ``success_blocks`` is accepted as an alias;
* ``CacheReclaimSubmit`` (component ``cache_reclaimer``): ``block_keys`` ([int]),
  ``location_ids`` ([[str]], one list per key), ``delay_us`` (int);
* ``PinCache`` (a committed ``pin_cache``): ``block_keys`` ([int]), ``ttl_seconds`` (number > 0),
  ``expires_at_us`` (int, wall clock; informative: the reader uses ``trigger_time_us`` +
  ``ttl_seconds``);
* ``UnpinCache`` (a committed ``unpin_cache``): ``block_keys`` ([int]).

Unknown fields are ignored, so the server may add some.

How the reader replays it (Tair's ``publisher_log`` rules, read/write separated):

* ``prefix_match`` lookups become ``read`` records; the other query types are counted and
  skipped (their hits are not prefix hits).
* a write becomes a ``write`` record at its ``FinishWriteCache`` time, holding the keys the
  server already had plus the new keys that succeeded; a session that never finishes wrote
  nothing (the server expires it as failed; Tair instead assumes success after 100 ms).
* pairing: a write is paired with the most recent earlier unpaired lookup of the same instance
  whose keys, minus the last one, are a prefix of the write's keys (the read of the same
  dialog turn). The write record then carries ``tokens = len(read keys) * block_size`` and
  ``output_tokens = (len(write keys) - len(read keys) + 1) * block_size``, Tair's DialogTurn
  accounting; counts of paired/unpaired events go to :attr:`Trace.counts`.
* ``CacheReclaimSubmit`` is the live server's own eviction: ignored (the replay evicts with its
  own policy) unless ``apply_reclaims=true``, which turns it into ``remove`` records so a replay
  reproduces what the server did.
* ``PinCache`` becomes a ``pin`` record lasting ``ttl_seconds`` of trace time, ``UnpinCache`` an
  ``unpin`` record: the replay never evicts a pinned key while its pin lasts, as the server does.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar

from kvcm.optimizer.trace import LineContext, Mask, Record, Trace, json_lines

EVENT_TYPES = ("GetCacheLocation", "StartWriteCache", "FinishWriteCache", "CacheReclaimSubmit", "PinCache",
               "UnpinCache")
_RECENT_READS = 64  # lookups remembered per instance for pairing; a turn's write follows soon


@dataclass(slots=True)
class _Session:
    ts: float
    instance: str
    keys: list[int]
    stored: list[bool]  # per key: the server already had it (not written in this session)
    tokens: int | None = None
    output_tokens: int = 0


def parse_mask(value: object, n: int, line: LineContext, name: str) -> Mask:
    """Any accepted mask form -> an int offset or a list of bools (see the module docstring)."""
    if value is None:
        return 0
    if isinstance(value, dict):
        # Logs written before the mask was logged as sent hold both fields, one of them null,
        # and Tair's proto-JSON bool form {"values": [...]}.
        offset = value.get("offset")
        value = offset if offset is not None else value.get("bool_masks")
        if isinstance(value, dict):
            value = value.get("values")
        if value is None:
            return 0
    if type(value) is int and value >= 0:
        return value
    if isinstance(value, list) and all(isinstance(v, bool) for v in value):
        if len(value) != n:
            raise line.fail(f"{name} has {len(value)} entries for {n} keys")
        return value
    raise line.fail(f"{name} must be an offset, a list of booleans or a kvcm mask map")


def _as_bools(mask: Mask, n: int) -> list[bool]:
    if isinstance(mask, int):
        return [i < mask for i in range(n)]
    return list(mask)


class _Reader:
    """State of one pass over an event log (pending sessions, recent reads)."""

    def __init__(self, path: str, trace: Trace, apply_reclaims: bool) -> None:
        self.path = path
        self.trace = trace
        self.apply_reclaims = apply_reclaims
        self.sessions: dict[str, _Session] = {}
        self.reads: dict[str, deque[list[int]]] = {}

    def handle(self, line: LineContext) -> Record | None:
        kind = line.get("type", str)
        handler = self._HANDLERS.get(kind)
        if handler is None:
            self.trace.counts[f"skipped_type_{kind}"] += 1
            return None
        ts = line.number("trigger_time_us") / 1e6
        return handler(self, line, ts, line.get("source", str))

    def _lookup(self, line: LineContext, ts: float, instance: str) -> Record | None:
        query = line.get("query_type", str, "prefix_match")
        if query != "prefix_match":
            self.trace.counts[f"skipped_query_{query}"] += 1
            return None
        keys = line.ints("keys")
        tokens = line.ints("tokens", [])
        mask = parse_mask(line.obj.get("block_mask"), len(keys), line, "block_mask")
        self.reads.setdefault(instance, deque(maxlen=_RECENT_READS)).append(keys)
        return Record(ts, instance, "read", keys, mask=mask, tokens=len(tokens) or None)

    def _start(self, line: LineContext, ts: float, instance: str) -> None:
        session_id = line.get("write_session_id", str)
        keys = line.ints("keys")
        mask = parse_mask(line.obj.get("block_mask"), len(keys), line, "block_mask")
        session = _Session(ts, instance, keys, _as_bools(mask, len(keys)))
        self._pair(session)
        self.sessions[session_id] = session

    def _pair(self, session: _Session) -> None:
        """Tair's rule: the latest read whose keys minus the last prefix the write's keys."""
        reads = self.reads.get(session.instance, deque())
        keys = session.keys
        for i in range(len(reads) - 1, -1, -1):
            read = reads[i]
            head = read[:-1]
            if keys[: len(head)] == head:
                del reads[i]
                bs = self.trace.block_size_of(session.instance)
                session.tokens = len(read) * bs
                session.output_tokens = (len(keys) - len(read) + 1) * bs
                self.trace.counts["paired_writes"] += 1
                return
        self.trace.counts["unpaired_writes"] += 1

    def _finish(self, line: LineContext, ts: float, instance: str) -> Record | None:
        session = self.sessions.pop(line.get("write_session_id", str), None)
        if session is None:
            self.trace.counts["finish_without_start"] += 1
            return None
        new = [k for k, stored in zip(session.keys, session.stored) if not stored]
        raw = line.obj.get("success_block", line.obj.get("success_blocks"))
        ok = _as_bools(parse_mask(raw, len(new), line, "success_block"), len(new))
        done = iter(ok)
        keys = [k for k, stored in zip(session.keys, session.stored) if stored or next(done)]
        return Record(ts, session.instance, "write", keys, tokens=session.tokens,
                      output_tokens=session.output_tokens)  # fmt: skip

    def _reclaim(self, line: LineContext, ts: float, instance: str) -> Record | None:
        keys = line.ints("block_keys")
        self.trace.counts["reclaim_events"] += 1
        return Record(ts, instance, "remove", keys) if self.apply_reclaims else None

    def _pin(self, line: LineContext, ts: float, instance: str) -> Record:
        keys = line.ints("block_keys")
        ttl = line.number("ttl_seconds")
        if not ttl > 0 or not math.isfinite(ttl):
            raise line.fail("ttl_seconds must be a finite number > 0")
        self.trace.counts["pin_events"] += 1
        return Record(ts, instance, "pin", keys, ttl=ttl)

    def _unpin(self, line: LineContext, ts: float, instance: str) -> Record:
        self.trace.counts["unpin_events"] += 1
        return Record(ts, instance, "unpin", line.ints("block_keys"))

    def finish(self) -> None:
        self.trace.counts["unfinished_writes"] += len(self.sessions)
        self.trace.counts["unpaired_reads"] += sum(len(q) for q in self.reads.values())

    _HANDLERS: ClassVar[dict[str, Callable[[_Reader, LineContext, float, str], Record | None]]] = {
        "GetCacheLocation": _lookup,
        "StartWriteCache": _start,
        "FinishWriteCache": _finish,
        "CacheReclaimSubmit": _reclaim,
        "PinCache": _pin,
        "UnpinCache": _unpin,
    }


def read_events(
    path: str,
    trace: Trace,
    progress: Callable[[int], object] | None = None,
    apply_reclaims: bool = False,
) -> Iterator[Record]:
    """Replayable records from a kvcm event log (see the module docstring for the rules)."""
    reader = _Reader(path, trace, apply_reclaims)
    for lineno, obj in json_lines(path, progress):
        record = reader.handle(LineContext(path, lineno, obj))
        if record is not None:
            yield record
    reader.finish()


def event_line(
    kind: str, source: str, trigger_time_us: int, event_id: str, **fields: object
) -> dict[str, object]:
    """One event-log object with the common fields first (for writers and tests)."""
    if kind not in EVENT_TYPES:
        raise ValueError(f"unknown event type {kind!r}; valid: {', '.join(EVENT_TYPES)}")
    component = "cache_reclaimer" if kind == "CacheReclaimSubmit" else "cache_manager"
    return {"id": event_id, "source": source, "component": component, "type": kind,
            "trigger_time_us": trigger_time_us, **fields}  # fmt: skip
