"""System RPCs: ``get_metrics`` (the numbers of ``/metrics``, as a map)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvcm.metrics import Metrics
from kvcm.proto.schema import RequestBase
from kvcm.rpc.dispatch import Method


class GetMetricsRequest(RequestBase, kw_only=True):
    pass


def methods(metrics: Metrics, info: Callable[[], dict[str, Any]]) -> list[Method]:
    """``info()`` gives facts about this node (id, endpoint, version) added to the reply as ``node``."""

    def get_metrics(req: GetMetricsRequest) -> dict[str, Any]:
        return {"timestamp": int(time.time() * 1000), "node": info(), "metrics": metrics.snapshot()}

    return [Method("get_metrics", get_metrics, request=GetMetricsRequest, writes=False, idempotent=True, admin=True)]
