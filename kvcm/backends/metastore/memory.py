"""In-memory twin of the LMDB store: same contract, nothing on disk.

For tests, the optimizer and throwaway servers (``store.backend = "memory"``). Write
transactions buffer their changes in an overlay and apply them on commit, so rollback and
nested (child) transactions behave as in LMDB. One global lock serialises writers, as LMDB's
single-writer rule does. Reads see committed data as of each call (no snapshot isolation across
calls in one ``read()`` block: a documented difference from LMDB).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from sortedcontainers import SortedDict

from kvcm.backends.metastore.base import DATABASES, bad_key, key_fits, run_aborts

_DELETED = None  # overlay marker for a deleted key


class _Data:
    """Committed data: one SortedDict per database.

    ``lock`` is held while a commit is applied and while a reader copies a key range, so a
    range read never walks a SortedDict that a committing writer is changing (that could skip
    keys). Point reads are single dict calls, atomic under the GIL."""

    def __init__(self) -> None:
        self.dbs: dict[str, SortedDict] = {name: SortedDict() for name in DATABASES}
        self.lock = threading.Lock()

    def get(self, db: str, key: bytes) -> bytes | None:
        value: bytes | None = self.dbs[db].get(key)
        return value

    def keys_from(self, db: str, start: bytes) -> Iterable[bytes]:
        table = self.dbs[db]
        with self.lock:  # a copy, made while no commit is being applied
            if not start:
                return list(table.keys())
            return table.keys()[table.bisect_left(start):]  # type: ignore[no-any-return]

    def items(self, db: str) -> list[tuple[bytes, bytes]]:
        table = self.dbs[db]
        with self.lock:
            return list(table.items())

    def count(self, db: str) -> int:
        return len(self.dbs[db])


class _View:
    """Reads through a chain of overlays down to the committed data."""

    def __init__(self, base: _Data | _View) -> None:
        self._base = base
        self.overlay: dict[str, dict[bytes, bytes | None]] = {}

    def get(self, db: str, key: bytes) -> bytes | None:
        layer = self.overlay.get(db)
        if layer is not None and key in layer:
            return layer[key]
        return self._base.get(db, key)

    def get_many(self, db: str, keys: Iterable[bytes]) -> list[bytes | None]:
        return [self.get(db, k) for k in keys]

    def keys_from(self, db: str, start: bytes) -> Iterable[bytes]:
        own = sorted(k for k in self.overlay.get(db, {}) if k >= start)
        merged = sorted(set(self._base.keys_from(db, start)) | set(own))
        return merged

    def scan(
        self, db: str, start: bytes = b"", prefix: bytes = b"", limit: int | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        n = 0
        for key in list(self.keys_from(db, max(start, prefix))):
            if not key.startswith(prefix) or (limit is not None and n >= limit):
                return
            value = self.get(db, key)
            if value is not None:
                n += 1
                yield key, value

    def count(self, db: str) -> int:
        return sum(1 for _ in self.scan(db))


class _WriteView(_View):
    def __init__(self, base: _Data | _View) -> None:
        super().__init__(base)
        self.callbacks: list[Callable[[], None]] = []
        self.aborts: list[Callable[[], None]] = []

    def put(self, db: str, key: bytes, value: bytes) -> None:
        if db not in DATABASES:
            raise KeyError(db)
        if not key_fits(key):
            raise bad_key()  # as LMDB would
        self.overlay.setdefault(db, {})[bytes(key)] = bytes(value)

    def put_many(self, db: str, items: Iterable[tuple[bytes, bytes]]) -> None:
        for key, value in items:
            self.put(db, key, value)

    def delete(self, db: str, key: bytes) -> bool:
        existed = self.get(db, key) is not None
        self.overlay.setdefault(db, {})[bytes(key)] = _DELETED
        return existed

    def delete_many(self, db: str, keys: Iterable[bytes]) -> int:
        return sum(1 for k in keys if self.delete(db, k))

    def drop(self, db: str) -> None:
        for key, _ in list(self.scan(db)):
            self.delete(db, key)

    def on_commit(self, fn: Callable[[], None]) -> None:
        self.callbacks.append(fn)

    def on_abort(self, fn: Callable[[], None]) -> None:
        self.aborts.append(fn)

    def remember(self, db: str, items: Iterable[tuple[bytes, bytes | None]]) -> None:
        """Ignored: a savepoint is a view over its parent, dropped on rollback: no undo log."""

    def merge_into(self, target: _WriteView) -> None:
        for db, layer in self.overlay.items():
            target.overlay.setdefault(db, {}).update(layer)
        target.callbacks.extend(self.callbacks)
        target.aborts.extend(self.aborts)

    def apply_to(self, data: _Data) -> None:
        with data.lock:
            for db, layer in self.overlay.items():
                table = data.dbs[db]
                for key, value in layer.items():
                    if value is None:
                        table.pop(key, None)
                    else:
                        table[key] = value


class _ThreadState(threading.local):
    """This thread's open views: the group's own first, then one per open ``write()`` block
    (None outside a group)."""

    def __init__(self) -> None:
        self.stack: list[_WriteView] | None = None


class MemoryStore:
    """Dict-backed :class:`~kvcm.backends.metastore.base.MetaStore`."""

    def __init__(self) -> None:
        self.path: str | None = None
        self._data = _Data()
        self._writer = threading.RLock()
        self._local = _ThreadState()

    @contextmanager
    def read(self) -> Iterator[_View]:
        yield _View(self._data)

    @contextmanager
    def group(self) -> Iterator[None]:
        if self._local.stack:
            yield
            return
        with self._writer:
            top = _WriteView(self._data)
            self._local.stack = [top]
            try:
                yield
            except BaseException:
                run_aborts(top.aborts)
                raise
            finally:
                self._local.stack = None
            top.apply_to(self._data)  # reached only when the group did not raise
        for fn in top.callbacks:
            fn()

    @contextmanager
    def write(self, join: bool = False) -> Iterator[_WriteView]:
        stack = self._local.stack
        if join and stack and len(stack) > 1:  # stack[0] is the group's own view, not a block
            yield stack[-1]
            return
        if not stack:
            with self.group(), self.write() as txn:
                yield txn
            return
        child = _WriteView(stack[-1])
        stack.append(child)
        try:
            yield child
        except BaseException:
            run_aborts(child.aborts)
            raise
        finally:
            stack.pop()
        child.merge_into(stack[-1])  # reached only when the block did not raise

    def sample(self, db: str, n: int, prefix: bytes = b"") -> list[tuple[bytes, bytes]]:
        items = [(k, v) for k, v in self._data.items(db) if k.startswith(prefix)]
        return random.sample(items, min(max(n, 0), len(items)))

    def stats(self) -> dict[str, int]:
        return {f"entries.{name}": self._data.count(name) for name in DATABASES}

    def close(self) -> None:
        """Nothing to release; kept for the contract."""
