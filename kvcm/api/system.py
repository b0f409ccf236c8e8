"""System RPCs: ``get_metrics`` (the numbers of ``/metrics``, as a map)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from kvcm.metrics import Metrics
from kvcm.proto.requests.admin import GetMetricsRequest
from kvcm.rpc.dispatch import Method


def methods(metrics: Metrics, info: Callable[[], Mapping[str, object]]) -> list[Method]:
    """``info()`` gives facts about this node (id, endpoint, version) added to the reply as ``node``."""

    def get_metrics(req: GetMetricsRequest) -> dict[str, object]:
        return {"timestamp": int(time.time() * 1000), "node": info(), "metrics": metrics.snapshot()}

    return [Method("get_metrics", get_metrics, request=GetMetricsRequest, writes=False, idempotent=True, admin=True)]
