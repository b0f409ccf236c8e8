"""The reclaimer's memory across restarts: a snapshot of every group's policies, plus a journal
of the events folded in since.

Without it a restart rebuilds every policy from the block records in *write* order, and LRU
becomes least-recently-written exactly when it matters. Files, in ``<data_dir>/reclaim/``:

* ``snapshot`` — msgpack ``{"version", "gen", "groups": {name: group state}}`` (see
  :meth:`~kvcm.reclaimer.state.GroupState.dump`); written to a temporary file, fsynced and
  renamed, so it is always whole;
* ``journal.<gen>`` — what every round folded in after that snapshot: one msgpack array of
  events per round, appended with one ``write``. No fsync: a process crash loses nothing the
  kernel has, a power cut may lose the last rounds (their reads only: the blocks themselves are
  found again in the store). A torn tail ends the replay there.

A snapshot is taken at a clean stop and whenever the journal has grown past
``max(compact_bytes, 2 x the last snapshot)``, which keeps the work per event constant. The
state is derived data: a file that does not decode is logged, moved aside and ignored (the
reclaimer then rebuilds from the store, as without it).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import msgpack

from kvcm.backends.migrations import RECLAIM_SNAPSHOT

log = logging.getLogger("kvcm.reclaimer")

VERSION = RECLAIM_SNAPSHOT.current
SNAPSHOT = "snapshot"
_DAMAGED = (ValueError, KeyError, TypeError, IndexError, msgpack.UnpackException)


class RecencyFile:
    """Snapshot + journal in one directory. Owned by whoever holds the reclaimer's lock."""

    def __init__(self, directory: str, compact_bytes: int = 64 << 20) -> None:
        self.directory = directory
        self.compact_bytes = compact_bytes
        os.makedirs(directory, exist_ok=True)
        self.gen = 0
        self._journal: Any = None
        self._journal_bytes = 0
        self._snapshot_bytes = 0

    # -- reading (start-up) ---------------------------------------------------------------------

    def load(self) -> tuple[dict[str, Any] | None, Iterator[list[Any]]]:
        """``(groups of the snapshot or None, the journal's rounds in order)``."""
        groups: dict[str, Any] | None = None
        path = os.path.join(self.directory, SNAPSHOT)
        try:
            with open(path, "rb") as f:
                raw = f.read()
            self._snapshot_bytes = len(raw)
            snap = msgpack.unpackb(raw, strict_map_key=False)
            if not isinstance(snap, dict) or (problem := RECLAIM_SNAPSHOT.refusal(snap.get("version"))) is not None:
                raise ValueError(problem if isinstance(snap, dict) else "not a snapshot")
            self.gen, groups = int(snap["gen"]), dict(snap["groups"])
        except FileNotFoundError:
            pass
        except _DAMAGED as exc:  # derived data: set it aside, rebuild from the store
            log.warning("reclaimer: ignoring unreadable %s (%s); recency is rebuilt from the store", path, exc)
            os.replace(path, path + ".bad")
            groups = None
        self._drop_old_journals()
        path = os.path.join(self.directory, f"journal.{self.gen}")
        # Opened now, not at the first event, so the server's descriptors are all set at start-up;
        # the rounds are read through a handle of their own, before anything is appended.
        self._open_journal()
        return groups, self._rounds(path)

    def _rounds(self, path: str) -> Iterator[list[Any]]:
        if not os.path.exists(path):
            return
        with open(path, "rb") as f:
            unpacker = msgpack.Unpacker(f, strict_map_key=False, max_buffer_size=1 << 30)
            try:
                for events in unpacker:
                    if isinstance(events, list):
                        yield events
            except _DAMAGED as exc:  # a torn or damaged tail: what came before is good
                log.warning("reclaimer: journal %s ends early (%s)", path, exc)

    def _drop_old_journals(self) -> None:
        for name in os.listdir(self.directory):
            if name.startswith("journal.") and name != f"journal.{self.gen}":
                os.unlink(os.path.join(self.directory, name))

    # -- writing --------------------------------------------------------------------------------

    def append(self, events: list[Any]) -> None:
        """One round's events, in the order they were folded in."""
        if not events:
            return
        if self._journal is None:
            self._open_journal()
        raw = msgpack.packb(events)
        self._journal.write(raw)
        self._journal.flush()
        self._journal_bytes += len(raw)

    def _open_journal(self) -> None:
        # kept open from round to round (one write per round), closed by snapshot()/close()
        self._journal = open(os.path.join(self.directory, f"journal.{self.gen}"), "ab")  # noqa: SIM115
        self._journal_bytes = self._journal.tell()

    def wants_snapshot(self) -> bool:
        return self._journal_bytes > max(self.compact_bytes, 2 * self._snapshot_bytes)

    def snapshot(self, groups: dict[str, Any]) -> None:
        """Replace the snapshot with ``groups`` and start an empty journal."""
        gen = self.gen + 1
        raw = msgpack.packb({"version": VERSION, "gen": gen, "groups": groups})
        path = os.path.join(self.directory, SNAPSHOT)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self.close()
        old = os.path.join(self.directory, f"journal.{self.gen}")
        self.gen, self._snapshot_bytes, self._journal_bytes = gen, len(raw), 0
        if os.path.exists(old):
            os.unlink(old)
        self._open_journal()

    def close(self) -> None:
        if self._journal is not None:
            self._journal.close()
            self._journal = None
