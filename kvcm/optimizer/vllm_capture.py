"""Captured vLLM KV-event streams (format ``vllm_events``): the file format and its reader.

``kvcm events record SOURCE --out FILE`` writes one JSON object per received PUB message:

=============== ============================================================================
``ts``          float, receive time (seconds since the epoch)
``source``      str, the event source (one engine / DP rank); becomes the replay instance
``seq``         int, the message's sequence number (frame 1)
``topic``       str, the message's topic (frame 0)
``payload_b64`` str, base64 of the raw msgpack ``KVEventBatch`` (frame 2)
=============== ============================================================================

:func:`capture_line` builds such a line. Payloads are decoded by
:func:`kvcm.proto.kv_events.decode_batch` (map, array and mixed layouts; int or bytes hashes,
normalised to unsigned 64-bit with vLLM's own rule).

Replay: a ``BlockStored`` is a ``turn`` for its source — the engine just computed these blocks,
so each one kvcm already holds is prefill the engine could have loaded instead — with
``parent = parent_block_hash``; ``tokens`` counts the event's token ids. By default only the
device tier (``medium`` GPU or unset) is replayed (``medium=all`` or another name to change it).
``BlockRemoved`` and ``AllBlocksCleared`` are engine evictions; with ``removals=true`` they are
applied as ``remove`` / ``clear`` records (the replayed cache then mirrors the engine's), by
default they are only counted (the replayed cache is a store that keeps what the engine drops).
Sequence gaps (lost messages) and undecodable events are counted in :attr:`Trace.counts`.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable, Iterator

from kvcm.optimizer.trace import LineContext, Record, Trace, json_lines
from kvcm.proto.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventDecodeError,
    decode_batch,
    hash_to_u64,
)


def capture_line(ts: float, source: str, seq: int, topic: str, payload: bytes) -> str:
    """One line of a capture file (no trailing newline)."""
    payload_b64 = base64.b64encode(payload).decode("ascii")
    return json.dumps(
        {"ts": ts, "source": source, "seq": seq, "topic": topic, "payload_b64": payload_b64}
    )


class _Capture:
    """State of one pass: last sequence number per source, filters."""

    def __init__(self, trace: Trace, medium: str, removals: bool) -> None:
        self.trace = trace
        self.medium = medium.upper()
        self.removals = removals
        self.last_seq: dict[str, int] = {}

    def _wanted(self, medium: str | None) -> bool:
        if self.medium == "ALL":
            return True
        return (medium or "GPU").upper() == self.medium

    def _track_seq(self, source: str, seq: int) -> None:
        last = self.last_seq.get(source)
        if last is not None and seq > last + 1:
            self.trace.counts["seq_gaps"] += 1
            self.trace.counts["seq_lost"] += seq - last - 1
        elif last is not None and seq <= last:
            self.trace.counts["seq_restarts"] += 1
        self.last_seq[source] = seq

    def records(self, line: LineContext) -> Iterator[Record]:
        source = line.get("source", str)
        self._track_seq(source, line.get("seq", int))
        try:
            payload = base64.b64decode(line.get("payload_b64", str), validate=True)
            batch = decode_batch(payload)
        except (binascii.Error, ValueError) as exc:
            if isinstance(exc, EventDecodeError):
                raise line.fail(str(exc)) from None
            raise line.fail(f"payload_b64 is not base64 ({exc})") from None
        for kind in batch.errors:
            self.trace.counts[f"events_{kind}"] += 1
        ts = batch.ts or line.number("ts")
        for event in batch.events:
            record = self._record(event, ts, source)
            if record is not None:
                yield record

    def _record(self, event: Event, ts: float, source: str) -> Record | None:
        counts = self.trace.counts
        if type(event) is AllBlocksCleared:
            counts["cleared"] += 1
            return Record(ts, source, "clear") if self.removals else None
        if not self._wanted(event.medium):  # type: ignore[union-attr]
            counts["skipped_medium"] += 1
            return None
        keys = [hash_to_u64(h) for h in event.block_hashes]  # type: ignore[union-attr]
        if type(event) is BlockRemoved:
            counts["removed_blocks"] += len(keys)
            return Record(ts, source, "remove", keys) if self.removals else None
        assert type(event) is BlockStored
        if event.block_size > 0:
            self.trace.block_sizes.setdefault(source, event.block_size)
        parent = None if event.parent_block_hash is None else hash_to_u64(event.parent_block_hash)
        tokens = len(event.token_ids) or None
        return Record(ts, source, "turn", keys, parent=parent, tokens=tokens)


def read_capture(
    path: str,
    trace: Trace,
    progress: Callable[[int], object] | None = None,
    medium: str = "GPU",
    removals: bool = False,
) -> Iterator[Record]:
    """Replayable records from a capture file (see the module docstring)."""
    capture = _Capture(trace, medium, removals)
    for lineno, obj in json_lines(path, progress):
        yield from capture.records(LineContext(path, lineno, obj))
