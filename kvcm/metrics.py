"""Prometheus metrics: one registry per app, served on ``/metrics`` and by the ``get_metrics`` RPC.

Every module that counts something takes the :class:`Metrics` (or its ``registry``) and creates
its own families on it, all named ``kvcm_*``; the registry also carries prometheus_client's
standard ``process_*`` and ``python_info`` collectors.

One rule for ``_created``: none of kvcm's output has it. prometheus_client writes a ``_created``
sample for its own counters and histograms but not for custom collectors (:class:`RpcStats`), and
its switch (``disable_created_metrics``) is process-global, so :meth:`Metrics.exposition` and
:meth:`Metrics.snapshot` drop those samples themselves, for every family of the registry.
"""

from __future__ import annotations

import platform
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, PlatformCollector, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from kvcm.version import __version__

# The "le" text prometheus_client's own Histogram writes (it ships this helper untyped).
_le: Callable[[float], str] = floatToGoString

_LATENCY_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class RpcStats:
    """Per-request figures of the RPC loop: ``kvcm_rpc_requests_total{method}``,
    ``kvcm_rpc_latency_seconds{method}`` and ``kvcm_rpc_batch_size``.

    A custom prometheus_client collector: the hot path adds to plain lists under one lock, and
    the families are built only when scraped. A ``Counter.inc`` plus two ``Histogram.observe``
    per request took a lock per value touched and cost 15-20 us of RPC-thread CPU per request
    under load on the 2-core VM (4 sync clients doing 64-key ``prefix_match``, measured with
    those calls made no-ops)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._lock = threading.Lock()
        self._methods: dict[str, list[float]] = {}  # method -> [sum, bucket counts ..., +Inf count]
        self._batches: list[float] = [0.0] * (len(_BATCH_BUCKETS) + 2)  # [sum, buckets ..., +Inf]
        registry.register(self)

    def request(self, method: str, seconds: float) -> None:
        with self._lock:
            row = self._methods.get(method)
            if row is None:
                row = self._methods[method] = [0.0] * (len(_LATENCY_BUCKETS) + 2)
            row[0] += seconds
            row[1 + bisect_left(_LATENCY_BUCKETS, seconds)] += 1

    def batch(self, size: int) -> None:
        with self._lock:
            self._batches[0] += size
            self._batches[1 + bisect_left(_BATCH_BUCKETS, size)] += 1

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            methods = {name: list(row) for name, row in self._methods.items()}
            batches = list(self._batches)
        requests = CounterMetricFamily("kvcm_rpc_requests", "RPC requests handled", labels=["method"])
        latency = HistogramMetricFamily("kvcm_rpc_latency_seconds", "RPC handler latency", labels=["method"])
        for name, row in sorted(methods.items()):
            requests.add_metric([name], sum(row[1:]))
            latency.add_metric([name], _cumulative(_LATENCY_BUCKETS, row[1:]), sum_value=row[0])
        sizes = HistogramMetricFamily("kvcm_rpc_batch_size", "Requests drained per wake-up")
        sizes.add_metric([], _cumulative(_BATCH_BUCKETS, batches[1:]), sum_value=batches[0])
        yield from (requests, latency, sizes)


def _cumulative(bounds: Sequence[float], counts: list[float]) -> list[tuple[str, float]]:
    out, total = [], 0.0
    for bound, count in zip([*bounds, float("inf")], counts):
        total += count
        out.append((_le(bound), total))
    return out


class Metrics:
    """The app's metric registry plus the RPC front door's own families."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.errors = Counter("kvcm_rpc_errors", "RPC requests answered with an error", ["method", "code"], registry=r)
        self.rpc = RpcStats(r)  # requests, latency and batch sizes of the RPC loop
        self.bad_messages = Counter(
            "kvcm_rpc_bad_messages", "Malformed messages, by kind (answered or dropped)", ["kind"], registry=r
        )
        self.replies_dropped = Counter(
            "kvcm_rpc_replies_dropped", "Replies not delivered (peer gone or over its HWM)", ["reason"], registry=r
        )
        self.commits = Counter("kvcm_store_commits", "Group commits of the RPC loop", registry=r)
        self.carried = Counter(
            "kvcm_rpc_carried", "Requests carried over to a later loop turn (hashing, budget, auth)", ["reason"], registry=r
        )
        self.refusals_held = Counter(
            "kvcm_rpc_refusals_held", "Big requests' refusals answered later (server.refusal_hold_ms)", registry=r
        )
        self.store_errors = Counter("kvcm_store_errors", "Metadata store errors", ["kind"], registry=r)
        self.http_refused = Counter(
            "kvcm_http_refused", "Side HTTP requests and connections refused, by reason", ["reason"], registry=r
        )
        self.up = Gauge("kvcm_up", "1 while the server is serving", registry=r)
        build = Gauge("kvcm_build_info", "Always 1; the labels say which kvcm and Python run", ["version", "python"],
                      registry=r)
        build.labels(__version__, platform.python_version()).set(1)
        # Each app gets its own instances: the global default registry already has these, and a
        # collector can only be registered once per registry.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self._view = _WithoutCreated(r)

    def exposition(self) -> bytes:
        """Prometheus text format."""
        return bytes(generate_latest(self._view))

    def snapshot(self) -> dict[str, list[dict[str, dict[str, str] | float]]]:
        """The same numbers as ``/metrics``, as a map for the ``get_metrics`` RPC."""
        out: dict[str, list[dict[str, dict[str, str] | float]]] = {}
        for family in self._view.collect():
            for sample in family.samples:
                out.setdefault(sample.name, []).append({"labels": dict(sample.labels), "value": sample.value})
        return out


class _WithoutCreated(CollectorRegistry):
    """A read-only view of ``source`` whose families carry no ``_created`` samples.

    ``_created`` is a timestamp, not a number to alert on, and only prometheus_client's own
    counters and histograms have it; dropping it everywhere keeps every family of one app shaped
    the same, whatever collector built it."""

    def __init__(self, source: CollectorRegistry) -> None:
        super().__init__(auto_describe=False)
        self._source = source

    def collect(self) -> Iterator[Metric]:
        for family in self._source.collect():
            created = family.name + "_created"
            if any(sample.name == created for sample in family.samples):
                copy = Metric(family.name, family.documentation, family.type, family.unit)
                copy.samples = [sample for sample in family.samples if sample.name != created]
                family = copy
            yield family
