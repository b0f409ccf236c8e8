"""The lease epoch's floor: the highest epoch a node has seen, kept in its data dir.

``{P}:epoch`` lives in Redis, and a Redis that restarts without persistence (or is flushed)
forgets it: the next ``INCR`` would start again at 1 and hand out a fencing token an earlier
term already carried. Each node keeps the highest epoch it has seen (its own terms, and every
holder it read) in ``ha-epoch`` in its data dir, which outlives Redis; an acquire passes it to
the script, which never issues an epoch at or below it.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("kvcm.ha")

#: The floor's file in a node's data dir.
FLOOR_FILE = "ha-epoch"


class EpochFloor:
    """The highest epoch this node has seen, persisted in ``path`` whenever it rises."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._value = self._load()

    @classmethod
    def in_data_dir(cls, data_dir: str) -> EpochFloor:
        os.makedirs(data_dir, exist_ok=True)
        return cls(os.path.join(data_dir, FLOOR_FILE))

    def _load(self) -> int:
        try:
            with open(self.path, encoding="ascii") as fh:
                return max(0, int(fh.read().strip() or "0"))
        except FileNotFoundError:
            return 0
        except (OSError, ValueError) as exc:
            # Unreadable, it protects nothing; the store's deployment check still refuses a
            # deposed leader's commits into a store that lost its data.
            log.warning("lease epoch floor %s unreadable (%s): starting from 0", self.path, exc)
            return 0

    def get(self) -> int:
        return self._value

    def raise_to(self, epoch: int) -> None:
        """Remember ``epoch`` if it is the highest seen (written through before it counts)."""
        with self._lock:
            if epoch <= self._value:
                return
            try:
                self._write(epoch)
            except OSError as exc:
                log.warning("lease epoch floor %s not written (%s): a Redis that loses the epoch may "
                            "issue %d again", self.path, exc, epoch)
            self._value = epoch

    def _write(self, epoch: int) -> None:
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="ascii") as fh:
            fh.write(f"{epoch}\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)


__all__ = ["FLOOR_FILE", "EpochFloor"]
