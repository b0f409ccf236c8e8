"""The cost model: what the hits of a capacity are worth in GPU time and money.

Every token served from kvcm (an *external* hit) is a prompt token the engine does not prefill;
internal hits were on the device already and would have been saved without kvcm, so they are
not counted. With a model's prefill throughput ``T`` (tokens/s on one GPU) and a GPU price
``P`` per hour, ``tokens_saved`` tokens are worth ``tokens_saved / T`` GPU-seconds and
``tokens_saved / T / 3600 * P`` money. Dividing by the trace's duration gives rates per hour of
this traffic, comparable with what the capacity costs to hold (``storage_price_per_gib_hour``
times the capacity in GiB, with ``block_bytes`` per block for block capacities).

The model is linear on purpose: prefill cost per token grows with context length (attention),
and loading blocks from storage is not free, so treat the figures as first-order estimates;
``prefill_tokens_per_s`` measured at the trace's typical prompt length keeps them honest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvcm.optimizer.stats import HitStats

_GIB = float(1 << 30)


@dataclass(frozen=True)
class CostModel:
    """Prices and throughputs; ``prefill_tokens_per_s`` is per GPU."""

    prefill_tokens_per_s: float
    gpu_price_per_hour: float = 0.0
    storage_price_per_gib_hour: float = 0.0
    block_bytes: int = 0

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0:
            raise ValueError("prefill_tokens_per_s must be > 0")
        if min(self.gpu_price_per_hour, self.storage_price_per_gib_hour, self.block_bytes) < 0:
            raise ValueError("prices and block_bytes must be >= 0")

    @classmethod
    def from_config(cls, table: dict[str, Any]) -> CostModel:
        """From a ``[cost]`` TOML table. :raises ValueError: unknown key or bad value."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(table) - known)
        if unknown:
            raise ValueError(f"[cost]: unknown key {unknown[0]!r}; valid: {', '.join(sorted(known))}")
        if "prefill_tokens_per_s" not in table:
            raise ValueError("[cost]: prefill_tokens_per_s is required")
        return cls(**table)

    def capacity_bytes(self, capacity: int, unit: str) -> int:
        """Bytes held by ``capacity`` (blocks are ``block_bytes`` each)."""
        return capacity if unit == "bytes" else capacity * self.block_bytes

    def value(self, stats: HitStats, duration_s: float, capacity_bytes: int = 0) -> Value:
        """What ``stats`` (measured over ``duration_s`` of trace) are worth, holding
        ``capacity_bytes`` of cache."""
        tokens = stats.hit_tokens - stats.internal_hit_tokens
        gpu_s = tokens / self.prefill_tokens_per_s
        money = gpu_s / 3600.0 * self.gpu_price_per_hour
        hours = duration_s / 3600.0
        storage_per_hour = capacity_bytes / _GIB * self.storage_price_per_gib_hour
        per_hour = (lambda x: x / hours) if hours > 0 else (lambda x: 0.0)
        return Value(
            tokens_saved=tokens,
            gpu_seconds_saved=gpu_s,
            money_saved=money,
            gpu_hours_saved_per_hour=per_hour(gpu_s / 3600.0),
            money_saved_per_hour=per_hour(money),
            storage_cost_per_hour=storage_per_hour,
            net_per_hour=per_hour(money) - storage_per_hour,
        )


@dataclass(frozen=True)
class Value:
    """The worth of one replay. ``*_per_hour`` are per hour of the trace's traffic."""

    tokens_saved: int
    gpu_seconds_saved: float
    money_saved: float
    gpu_hours_saved_per_hour: float
    money_saved_per_hour: float
    storage_cost_per_hour: float
    net_per_hour: float

    def to_json(self) -> dict[str, float]:
        return asdict(self)


def marginal(capacities: Sequence[int], values: Sequence[Value]) -> list[float | None]:
    """Extra money per hour bought by each extra unit of capacity, point to point.

    ``None`` for the first point. Where this falls below the storage price of one unit, a
    larger cache no longer pays for itself.
    """
    out: list[float | None] = [None]
    for i in range(1, len(values)):
        step = capacities[i] - capacities[i - 1]
        gain = values[i].money_saved_per_hour - values[i - 1].money_saved_per_hour
        out.append(gain / step if step else None)
    return out
