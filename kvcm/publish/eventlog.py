"""kvcm's JSON-lines event log: Tair KVCM's four event types and kvcm's pins, read by the optimizer.

The format is specified in :mod:`kvcm.optimizer.kvcm_events` (the reader) and follows Tair's
``LogEventPublisher``: one JSON object per line with ``id``,
``source`` (the instance id), ``component``, ``type``, ``trigger_time_us`` and per type:

* ``GetCacheLocation``: ``query_type``, ``keys``, ``tokens``, ``block_mask``, ``sw_size``,
  ``location_spec_names``;
* ``StartWriteCache``: ``write_session_id``, ``keys``, ``tokens``, ``block_mask``,
  ``location_spec_group_names``, ``write_timeout_seconds``;
* ``FinishWriteCache``: ``write_session_id``, ``success_block``;
* ``CacheReclaimSubmit`` (component ``cache_reclaimer``): ``block_keys``, ``location_ids``,
  ``delay_us``;
* ``PinCache`` (kvcm's own, no Tair equivalent): ``block_keys``, ``ttl_seconds``,
  ``expires_at_us`` (wall clock);
* ``UnpinCache``: ``block_keys``.

Unlike Tair, nothing is dropped silently: the writer appends under a lock from the calling
thread (a line is a few hundred bytes; the file is line-buffered by the OS page cache), and a
write error is counted and logged once, never raised into the request path.

Thread ownership: any thread; one lock serialises appends.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import IO

log = logging.getLogger("kvcm.publish.eventlog")

EVENT_TYPES = ("GetCacheLocation", "StartWriteCache", "FinishWriteCache", "CacheReclaimSubmit", "PinCache",
               "UnpinCache")


class EventLog:
    """Append-only JSON-lines writer of the event types (see the module docstring)."""

    def __init__(self, path: str, flush_every: int = 1) -> None:
        self.path = path
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        self._file: IO[str] | None = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._lock = threading.Lock()
        self._flush_every = max(1, flush_every)
        self._pending = 0
        self.written = 0
        self.errors = 0

    def write(self, event: Mapping[str, object]) -> None:
        """Append one event; fills ``id`` and ``trigger_time_us`` when missing."""
        if event.get("type") not in EVENT_TYPES:
            raise ValueError(f"event type must be one of {EVENT_TYPES}, got {event.get('type')!r}")
        line = json.dumps(_with_common(event), separators=(",", ":"), default=_jsonable)
        with self._lock:
            if self._file is None:
                return
            try:
                self._file.write(line + "\n")
                self._pending += 1
                if self._pending >= self._flush_every:
                    self._file.flush()
                    self._pending = 0
                self.written += 1
            except OSError as exc:
                self.errors += 1
                if self.errors == 1:
                    log.error("event log %s: write failed: %s", self.path, exc)

    def get_cache_location(
        self,
        instance_id: str,
        query_type: str,
        keys: Sequence[int],
        tokens: Sequence[int] = (),
        block_mask: object = None,
        sw_size: int = -1,
        location_spec_names: Sequence[str] = (),
    ) -> None:
        self.write({
            "source": instance_id, "component": "cache_manager", "type": "GetCacheLocation",
            "query_type": query_type, "keys": list(keys), "tokens": list(tokens), "block_mask": block_mask,
            "sw_size": sw_size, "location_spec_names": list(location_spec_names),
        })  # fmt: skip

    def start_write_cache(
        self,
        instance_id: str,
        write_session_id: str,
        keys: Sequence[int],
        tokens: Sequence[int] = (),
        block_mask: object = None,
        location_spec_group_names: Sequence[str] = (),
        write_timeout_seconds: int = 10,
    ) -> None:
        self.write({
            "source": instance_id, "component": "cache_manager", "type": "StartWriteCache",
            "write_session_id": write_session_id, "keys": list(keys), "tokens": list(tokens),
            "block_mask": block_mask, "location_spec_group_names": list(location_spec_group_names),
            "write_timeout_seconds": write_timeout_seconds,
        })  # fmt: skip

    def finish_write_cache(self, instance_id: str, write_session_id: str, success_block: object) -> None:
        self.write({
            "source": instance_id, "component": "cache_manager", "type": "FinishWriteCache",
            "write_session_id": write_session_id, "success_block": success_block,
        })  # fmt: skip

    def cache_reclaim_submit(
        self, instance_id: str, block_keys: Sequence[int], location_ids: Sequence[Sequence[str]], delay_us: int
    ) -> None:
        self.write({
            "source": instance_id, "component": "cache_reclaimer", "type": "CacheReclaimSubmit",
            "block_keys": list(block_keys), "location_ids": [list(x) for x in location_ids], "delay_us": delay_us,
        })  # fmt: skip

    def pin_cache(self, instance_id: str, block_keys: Sequence[int], ttl_seconds: float, expires_at: float) -> None:
        self.write({
            "source": instance_id, "component": "cache_manager", "type": "PinCache",
            "block_keys": list(block_keys), "ttl_seconds": ttl_seconds, "expires_at_us": int(expires_at * 1e6),
        })  # fmt: skip

    def unpin_cache(self, instance_id: str, block_keys: Sequence[int]) -> None:
        self.write({
            "source": instance_id, "component": "cache_manager", "type": "UnpinCache",
            "block_keys": list(block_keys),
        })  # fmt: skip

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def _with_common(event: Mapping[str, object]) -> dict[str, object]:
    out = {"id": event.get("id") or uuid.uuid4().hex, "source": str(event.get("source", "")),
           "component": event.get("component", "cache_manager"), "type": event["type"],
           "trigger_time_us": event.get("trigger_time_us") or int(time.time() * 1e6)}  # fmt: skip
    for key, value in event.items():
        out.setdefault(key, value)
    return out


def _jsonable(value: object) -> str | list[object]:
    if isinstance(value, (bytes, bytearray)):
        return value.hex()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
