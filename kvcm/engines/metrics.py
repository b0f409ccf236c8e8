"""Per-source event metrics, named like AIBrix's KV-event metrics but ``kvcm_engine_event_*``.

Every family carries a ``source`` label; :meth:`EventMetrics.remove_source` drops all series of a
removed source so ``/metrics`` does not keep reporting a pod that is gone.

Thread ownership: written by the subscriber thread, removed by whoever removes a source;
prometheus_client metrics are thread-safe.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

_LATENCY = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_PREFIX = "kvcm_engine_event_"
_TALLY_HELP = {"received": "Events decoded from the wire, by type", "processed": "Events applied to the index, by type"}


class EventMetrics:
    """The subscriber's metric families (see the module docstring)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry if registry is not None else CollectorRegistry()
        self.registry = r
        src = ["source"]
        self.connections = Counter(_PREFIX + "connections", "Connections established", src, registry=r)
        self.disconnections = Counter(_PREFIX + "disconnections", "Connections lost", src, registry=r)
        self.reconnect_attempts = Counter(
            _PREFIX + "reconnect_attempts", "Reconnect attempts (ZMQ retries and socket re-creations)", src, registry=r
        )
        self.tallies = _Tallies(r)  # events received / processed by type, the last applied seq
        self.latency = Histogram(
            _PREFIX + "processing_latency_seconds", "Time to apply one batch", src, buckets=_LATENCY, registry=r
        )
        self.missed = Counter(_PREFIX + "missed_events", "Batches missed (sequence gaps)", src, registry=r)
        self.replay_requests = Counter(_PREFIX + "replay_requests", "Replay requests sent", src, registry=r)
        self.replay_success = Counter(_PREFIX + "replay_success", "Replays completed (end marker)", src, registry=r)
        self.replay_failures = Counter(_PREFIX + "replay_failures", "Replays that timed out or failed", src, registry=r)
        self.errors = Counter(_PREFIX + "errors", "Errors, by kind", ["source", "kind"], registry=r)
        self.status = Gauge(_PREFIX + "connection_status", "1 while connected", src, registry=r)
        self.probes = Counter(_PREFIX + "probes", "Liveness probes of a silent source (replay ROUTER)", src, registry=r)
        self.probe_failures = Counter(_PREFIX + "probe_failures", "Liveness probes left unanswered", src, registry=r)
        self.stale = Gauge(_PREFIX + "stale", "1 while the source is not heard for events.stale_after_s", src, registry=r)
        self.expired = Counter(_PREFIX + "expired", "Times the source expired (not heard for events.expire_after_s)", src, registry=r)
        self.expired_blocks = Counter(_PREFIX + "expired_blocks", "Blocks dropped when the source expired", src, registry=r)
        self.rebuilds = Counter(
            _PREFIX + "rebuilds", "Full rebuilds (publisher restart, replay buffer no longer reaching back)", src, registry=r
        )
        self.blocks = Gauge(_PREFIX + "blocks_held", "Engine blocks held, by medium", ["source", "medium"], registry=r)
        self._labels: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
        self._lock = threading.Lock()
        # Labelled children of the series counted per batch, by (family, labels): a labels()
        # lookup costs more than the increment, several times per report_events request.
        self._children: dict[tuple[str, tuple[str, ...]], Any] = {}

    def note(self, family: str, source: str, value: str) -> None:
        """Remember a second label value used for ``source`` (so it can be removed later)."""
        with self._lock:
            self._labels[source][family].add(value)

    def _child(self, family: str, metric: Counter | Gauge | Histogram, *labels: str) -> Any:
        key = (family, labels)
        child = self._children.get(key)
        if child is None:
            with self._lock:
                child = self._children[key] = metric.labels(*labels)
        return child

    def received(self, source: str, events: Iterable[object]) -> None:
        """Events of a batch decoded from the wire, counted by type."""
        self.tallies.received(source, events)

    def processed(self, source: str, by_type: dict[str, int]) -> None:
        """Events of a batch applied to the index, by type."""
        self.tallies.processed(source, by_type)

    def applied(self, source: str, seq: int, seconds: float | None = None) -> None:
        """A batch of ``source`` applied: its sequence number (and how long applying took)."""
        self.tallies.last_seq(source, seq)
        if seconds is not None:
            self._child("latency", self.latency, source).observe(seconds)

    def error(self, source: str, kind: str, n: int = 1) -> None:
        self.note("errors", source, kind)
        self.errors.labels(source, kind).inc(n)

    def remove_source(self, source: str) -> None:
        """Drop every series of ``source``."""
        with self._lock:
            extra = self._labels.pop(source, {})
            for key in [k for k in self._children if k[1][0] == source]:
                del self._children[key]
        self.tallies.drop(source)
        simple = (
            self.connections, self.disconnections, self.reconnect_attempts, self.latency, self.missed,
            self.replay_requests, self.replay_success, self.replay_failures, self.status,
            self.probes, self.probe_failures, self.stale, self.expired, self.expired_blocks, self.rebuilds,
        )  # fmt: skip
        for metric in simple:
            _remove(metric, source)
        pairs: dict[str, Counter | Gauge] = {"errors": self.errors, "blocks": self.blocks}
        for family, metric in pairs.items():
            for value in extra.get(family, ()):
                _remove(metric, source, value)


def _remove(metric: Counter | Gauge | Histogram, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass  # never observed


class _Tallies:
    """The series touched for every batch, ``_events_received_total`` and
    ``_events_processed_total`` by source and type and ``_last_sequence_id`` by source, as a
    custom collector (as :class:`kvcm.metrics.RpcStats` does it): a batch adds to plain dicts
    under one lock, and the families are built only when scraped. A labelled ``Counter.inc``
    costs about 40 Python opcodes and a lock of its own per value, several times per batch and
    per ``report_events`` request."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, dict[tuple[str, str], float]] = {"received": {}, "processed": {}}
        self._seqs: dict[str, float] = {}
        registry.register(self)

    def received(self, source: str, events: Iterable[object]) -> None:
        """One each, by the event's type."""
        counts = self._counts["received"]
        with self._lock:
            for event in events:
                key = (source, type(event).__name__)
                counts[key] = counts.get(key, 0.0) + 1

    def processed(self, source: str, by_type: dict[str, int]) -> None:
        counts = self._counts["processed"]
        with self._lock:
            for event_type, n in by_type.items():
                key = (source, event_type)
                counts[key] = counts.get(key, 0.0) + n

    def last_seq(self, source: str, seq: int) -> None:
        with self._lock:
            self._seqs[source] = float(seq)

    def drop(self, source: str) -> None:
        """Forget every series of ``source``."""
        with self._lock:
            for counts in self._counts.values():
                for key in [k for k in counts if k[0] == source]:
                    del counts[key]
            self._seqs.pop(source, None)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            counts = {family: sorted(c.items()) for family, c in self._counts.items()}
            seqs = sorted(self._seqs.items())
        for family, rows in counts.items():
            metric = CounterMetricFamily(f"{_PREFIX}events_{family}", _TALLY_HELP[family], labels=["source", "event_type"])
            for (source, event_type), value in rows:
                metric.add_metric([source, event_type], value)
            yield metric
        last = GaugeMetricFamily(_PREFIX + "last_sequence_id", "Last applied sequence number", labels=["source"])
        for source, seq in seqs:
            last.add_metric([source], seq)
        yield last
