"""Prometheus metrics: one registry per app, served on ``/metrics`` and by the ``get_metrics`` RPC.

Every module that counts something takes the :class:`Metrics` (or its ``registry``) and creates
its own families on it, all named ``kvcm_*``.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)


class Metrics:
    """The app's metric registry plus the RPC front door's own families."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvcm_rpc_requests", "RPC requests handled", ["method"], registry=r)
        self.errors = Counter("kvcm_rpc_errors", "RPC requests answered with an error", ["method", "code"], registry=r)
        self.latency = Histogram(
            "kvcm_rpc_latency_seconds", "RPC handler latency", ["method"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.bad_messages = Counter(
            "kvcm_rpc_bad_messages", "Malformed messages, by kind (answered or dropped)", ["kind"], registry=r
        )
        self.replies_dropped = Counter(
            "kvcm_rpc_replies_dropped", "Replies not delivered (peer gone or over its HWM)", ["reason"], registry=r
        )
        self.batch_size = Histogram(
            "kvcm_rpc_batch_size", "Requests drained per wake-up", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r
        )
        self.commits = Counter("kvcm_store_commits", "Group commits of the RPC loop", registry=r)
        self.store_errors = Counter("kvcm_store_errors", "Metadata store errors", ["kind"], registry=r)
        self.up = Gauge("kvcm_up", "1 while the server is serving", registry=r)

    def exposition(self) -> bytes:
        """Prometheus text format."""
        return bytes(generate_latest(self.registry))

    def snapshot(self) -> dict[str, list[dict[str, Any]]]:
        """The same numbers as ``/metrics``, as a map for the ``get_metrics`` RPC."""
        out: dict[str, list[dict[str, Any]]] = {}
        for family in self.registry.collect():
            for sample in family.samples:
                out.setdefault(sample.name, []).append({"labels": dict(sample.labels), "value": sample.value})
        return out
