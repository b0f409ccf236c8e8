"""Storage backends by type name, reading and opening them from a spec, and the health prober.

Each backend's ``read_spec`` is the one definition of its spec: fields, defaults and checks.
:func:`normalize_spec` (what the registry validates ``add_storage``/``update_storage`` with)
and :func:`open_backend` both go through it, so whatever the registry accepts opens, and the
spec it stores is exactly what the backend runs with.

Availability, two separate flags (the read/write paths use a storage only when both hold):

* ``enabled`` — the admin's word (``enable_storage`` / ``disable_storage``), persisted by the
  control plane. :class:`StorageHealth` never touches it.
* ``available`` — the probes' word, reported by :class:`StorageHealth` through its
  ``set_available(name, bool)`` callback. Admin calls never change it.

So a storage disabled by an admin stays unused however healthy it is, and an enabled one stops
being used while its probes fail and comes back by itself when they pass again.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Protocol, TypeAlias

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric

from kvcm.backends.storage.base import StorageBackend
from kvcm.backends.storage.external import ExternalStorage, MooncakeStorage, TairMemPoolStorage, ThreeFsStorage
from kvcm.backends.storage.file import FileStorage, resolve_file_uri
from kvcm.backends.storage.ownership import Owner
from kvcm.backends.storage.shm import ShmStorage, resolve_shm_uri
from kvcm.backends.storage.specs import Spec
from kvcm.errors import Code, InvalidArgument, ServerError
from kvcm.proto.uris import ParsedUri, format_uri, parse_uri
from kvcm.threads import LoopThread

log = logging.getLogger("kvcm.backends.storage")

#: A backend class: it takes ``(name, spec, data_dir, owner)`` and has a pure
#: ``read_spec(name, spec, data_dir) -> Spec`` classmethod (validate, fill defaults, normalize).
BackendClass: TypeAlias = type[FileStorage] | type[ShmStorage] | type[ExternalStorage]

#: type name -> backend class.
STORAGE_BACKENDS: dict[str, BackendClass] = {
    "file": FileStorage,
    "shm": ShmStorage,
    "3fs": ThreeFsStorage,
    "mooncake": MooncakeStorage,
    "tairmempool": TairMemPoolStorage,
}

# The name is the host of every URI the storage hands out: URI-unreserved characters only.
_NAME = re.compile(r"[A-Za-z0-9._~-]{1,128}")

__all__ = [
    "STORAGE_BACKENDS",
    "ParsedUri",
    "StorageAvailability",
    "StorageBackend",
    "StorageHealth",
    "format_uri",
    "normalize_spec",
    "open_backend",
    "parse_uri",
    "resolve_file_uri",
    "resolve_shm_uri",
]


class StorageRecord(Protocol):
    """A registry ``Storage`` record, as :func:`open_backend` reads it."""

    @property
    def storage_type(self) -> str: ...

    @property
    def global_unique_name(self) -> str: ...

    @property
    def storage_spec(self) -> Mapping[str, object]: ...


def _backend_class(storage_type: object, name: object) -> BackendClass:
    cls = STORAGE_BACKENDS.get(storage_type) if isinstance(storage_type, str) else None
    if cls is None:
        raise InvalidArgument(
            f"unknown storage_type {storage_type!r} (valid: {', '.join(sorted(STORAGE_BACKENDS))})"
        )
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidArgument(f"storage name {name!r} must be 1-128 of A-Z a-z 0-9 . _ ~ - (it is the URI host)")
    return cls


def normalize_spec(
    storage_type: str, name: str, spec: Mapping[str, object] | None, data_dir: str | None = None
) -> Spec:
    """Validate ``spec`` strictly with the backend's own reader and return it complete: every
    field of the type with its default filled in, as plain builtins (str, int, bool).

    Side-effect free: creates no directory, file or segment and connects nowhere. Normalizing
    a normalized spec returns it unchanged. Relative paths are resolved the way the backend
    resolves them (``file``: ``root_path`` under ``data_dir``; refused without one), so the
    result holds absolute paths. InvalidArgument for an unknown type (listing the valid ones),
    a bad name, or a bad spec (naming ``storage_spec.<field>``)."""
    return _backend_class(storage_type, name).read_spec(name, spec, data_dir)


def open_backend(
    storage_type: str | StorageRecord, name: str | None = None, spec: Mapping[str, object] | None = None,
    data_dir: str | None = None, owner: Owner | None = None,
) -> StorageBackend:
    """Build and open one storage. InvalidArgument for an unknown type (listing the valid ones),
    a bad name, or a bad spec (naming the field); ServerError(IO_ERROR) if it cannot open;
    Conflict if another process already manages its directory or shm prefix.

    Also takes a registry ``Storage`` record, the way the storage pool calls it:
    ``open_backend(storage, data_dir)``. The backend remembers the spec it was opened with as
    ``spec_source`` so the pool can tell when ``update_storage`` changed it.

    ``owner`` proves which directory is whose (:mod:`kvcm.backends.storage.ownership`); without one a
    stable standalone id is derived from type and name (tools, tests)."""
    if not isinstance(storage_type, str):
        record = storage_type
        return open_backend(record.storage_type, record.global_unique_name, record.storage_spec, name, owner)
    cls = _backend_class(storage_type, name)
    assert name is not None  # _backend_class refused anything but a valid name
    backend = cls(name, spec, data_dir, owner)
    try:
        backend.open()
    except OSError as exc:
        raise ServerError(f"storage {name!r}: cannot open: {exc}", Code.IO_ERROR) from exc
    backend.spec_source = spec
    return backend


class _Probe:
    """One ``health()`` call on its own daemon thread, so a hung mount cannot hang the loop."""

    def __init__(self, backend: StorageBackend) -> None:
        self.backend = backend
        self.result = False
        self.thread = threading.Thread(target=self._run, name=f"kvcm-probe-{backend.name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.result = bool(self.backend.health())
        except Exception:  # a probe that raises is a failed probe; keep the traceback in the log
            log.exception("storage %s: health probe raised", self.backend.name)


class StorageHealth:
    """Probes every storage and reports ``available`` flips through ``set_available``.

    The first probe of a storage always reports (its persisted state may be stale); after that
    only changes do. A storage goes unavailable after ``fall`` consecutive failed probes (one
    NFS hiccup should not divert traffic) and available again after one good probe.

    Thread ownership: ``run_once`` runs on the storage-health thread (``start``) or in a test;
    each probe runs on a short-lived daemon thread. A probe still running after
    ``probe_timeout`` counts as failed and its storage is not probed again until it returns.
    ``set_available`` is called on the health thread; it must be thread-safe on the caller side.

    ``reopen`` runs first in every round: it opens again the storages whose open failed for a
    passing reason (a lock another process holds), which only then join ``backends``. Such a
    storage is never probed (nor reported unavailable) while it waits.
    """

    def __init__(
        self,
        backends: Callable[[], Iterable[StorageBackend]],
        set_available: Callable[[str, bool], None],
        *,
        fall: int = 2,
        probe_timeout: float = 5.0,
        reopen: Callable[[], object] | None = None,
    ) -> None:
        if fall < 1:
            raise InvalidArgument(f"fall must be >= 1, got {fall}")
        self._backends = backends
        self._set_available = set_available
        self._reopen = reopen
        self.fall = fall
        self.probe_timeout = probe_timeout
        self._available: dict[str, bool] = {}
        self._failures: dict[str, int] = {}
        self._inflight: dict[str, _Probe] = {}
        self._loop: LoopThread | None = None

    def run_once(self) -> dict[str, bool]:
        """Probe all storages once; returns the availability of each (after this round)."""
        if self._reopen is not None:
            try:
                self._reopen()
            except Exception:  # the probes still run; the next round tries again
                log.exception("opening waiting storages failed")
        results = self._probe_all(list(self._backends()))
        for name in set(self._available) - set(results):  # removed storages: forget them
            self._available.pop(name, None)
            self._failures.pop(name, None)
        for name, ok in results.items():
            self._apply(name, ok)
        return dict(self._available)

    def _probe_all(self, backends: list[StorageBackend]) -> dict[str, bool]:
        for backend in backends:
            if backend.name not in self._inflight:
                self._inflight[backend.name] = _Probe(backend)
        deadline = time.monotonic() + self.probe_timeout
        results: dict[str, bool] = {}
        for backend in backends:
            probe = self._inflight[backend.name]
            probe.thread.join(max(0.0, deadline - time.monotonic()))
            if probe.thread.is_alive():
                log.warning("storage %s: health probe still running after %.1fs", backend.name, self.probe_timeout)
                results[backend.name] = False
            else:
                results[backend.name] = probe.result
                del self._inflight[backend.name]
        return results

    def _apply(self, name: str, ok: bool) -> None:
        failures = 0 if ok else self._failures.get(name, 0) + 1
        self._failures[name] = failures
        previous = self._available.get(name)
        now = ok or (previous is True and failures < self.fall)
        if now != previous:
            log.log(logging.INFO if now else logging.WARNING, "storage %s: available=%s", name, now)
            self._set_available(name, now)  # raises -> state kept, so the next round retries
            self._available[name] = now

    def start(self, interval: float) -> None:
        """Run ``run_once`` every ``interval`` seconds on the ``kvcm-storage-health`` thread."""
        if self._loop is None:
            self._loop = LoopThread("storage-health", self.run_once, interval)
            self._loop.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Idempotent; stuck probe threads are daemons and are left behind."""
        if self._loop is not None:
            self._loop.stop(timeout)
            self._loop = None


class StorageAvailability:
    """``kvcm_storage_available{storage}``: 1 while the probes say a storage is usable, else 0.

    Built at scrape time from ``storages()`` (name, available) pairs, i.e. from the registry's
    records that :class:`StorageHealth` (through ``set_storage_available``) and the storage
    pool write: the gauge cannot drift from what ``check_health`` reports, and a storage removed
    from the registry has no series. ``enabled`` (the admin's word) is not part of it."""

    def __init__(self, storages: Callable[[], Iterable[tuple[str, bool]]], registry: CollectorRegistry) -> None:
        self._storages = storages
        registry.register(self)

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("kvcm_storage_available", "1 while the storage passes its health probes",
                                   labels=["storage"])
        for name, available in self._storages():
            family.add_metric([name], 1.0 if available else 0.0)
        yield family
