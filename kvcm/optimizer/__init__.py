"""kvcm's offline optimizer: replay KV-cache traces, compare policies and capacities, price hits.

The same capabilities as Tair KVCM's optimizer, using the live reclaimer's policies
(:mod:`kvcm.policies`), so a configuration measured here behaves the same in the server.

>>> from kvcm.optimizer import read_trace, replay
>>> trace = read_trace("mooncake_synthetic_trace.jsonl", "mooncake")   # doctest: +SKIP
>>> replay(trace, block_size_of=trace.block_size_of).total.token_hit_rate  # doctest: +SKIP
0.6512444360312151

Modules: :mod:`~kvcm.optimizer.trace_readers` (readers, one per format), :mod:`~.radix` (the radix
tree), :mod:`~.spec` (groups, tiers, capacities, TOML), :mod:`~.replay`, :mod:`~.stats` (results), :mod:`~.sweep`,
:mod:`~.report` (tables, CSV, JSON), :mod:`~.cost`, :mod:`~.plot`, :mod:`~.cli`.
"""

from __future__ import annotations

from kvcm.optimizer.cost import CostModel, Value
from kvcm.optimizer.radix import RadixTree
from kvcm.optimizer.replay import Replayer, replay
from kvcm.optimizer.spec import (
    Capacity,
    GroupSpec,
    InstanceSpec,
    ReplaySpec,
    SpecError,
    TierSpec,
    parse_capacity,
    spec_from_config,
)
from kvcm.optimizer.stats import HitStats, ReplayResult
from kvcm.optimizer.sweep import SweepPoint, capacity_points, run_sweep, unbounded_run
from kvcm.optimizer.trace import Record, TraceError
from kvcm.optimizer.trace_readers import READERS, Trace, dump_schema, read_trace

__all__ = [
    "READERS",
    "Capacity",
    "CostModel",
    "GroupSpec",
    "HitStats",
    "InstanceSpec",
    "RadixTree",
    "Record",
    "ReplayResult",
    "ReplaySpec",
    "Replayer",
    "SpecError",
    "SweepPoint",
    "TierSpec",
    "Trace",
    "TraceError",
    "Value",
    "capacity_points",
    "dump_schema",
    "parse_capacity",
    "read_trace",
    "replay",
    "run_sweep",
    "spec_from_config",
    "unbounded_run",
]
