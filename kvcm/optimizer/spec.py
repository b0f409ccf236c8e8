"""What to replay: groups of instances, their tiers, capacities and policies (and the TOML form).

A *group* shares one capacity (Tair: an instance group's quota) between its *instances*; it has
one or more *tiers*, fastest first, each with a capacity and a policy. Capacities are in blocks
(``10000``) or in bytes (``"40GiB"``, ``"512MB"``, ``"1e9B"``); byte capacities need each
instance's ``block_bytes`` (the size of one block across all its location specs).

TOML (``kvcm optimize --config FILE``)::

    [trace]
    path = "trace.jsonl"        # the TRACE argument wins over this
    format = "mooncake"
    block_size = 512            # default tokens per block
    options = { time_scale = 0.001 }

    [replay]
    mode = "exact"              # or "batched": evict whole batches of `batch_size` blocks
    batch_size = 100
    watermark = 1.0             # evict down to capacity * watermark
    promote = false             # multi-tier: move a block hit in a slower tier to the first

    [cost]                      # optional: see kvcm.optimizer.cost
    prefill_tokens_per_s = 5000
    gpu_price_per_hour = 2.5

    [[groups]]
    name = "g"
    capacity = 20000            # the first tier's capacity; absent = unbounded
    policy = "lru"
    policy_options = { }
    instances = ["instance"]    # or tables: { id = "a", block_size = 16, block_bytes = 1048576 }
    block_bytes = 0             # bytes per block of the group's instances (byte capacities)

    [[groups.tiers]]            # optional, replaces capacity/policy: one table per tier
    name = "hbm"
    capacity = 2000
    policy = "lru"

Records of an instance no group lists go to the group named ``default`` if there is one, else
they are dropped (and counted).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvcm.policies import POLICIES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]

MODES = ("exact", "batched")
_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_CAPACITY = re.compile(r"^\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*$")


class SpecError(ValueError):
    """A replay configuration that cannot work; the message names the key."""


@dataclass(frozen=True)
class Capacity:
    """An amount of blocks or of bytes."""

    amount: int
    unit: str = "blocks"  # or "bytes"

    def __str__(self) -> str:
        return f"{self.amount}" if self.unit == "blocks" else f"{self.amount}B"


def parse_capacity(value: float | str | None) -> Capacity | None:
    """``10000`` / ``"10000"`` -> blocks; ``"40GiB"`` -> bytes; ``None``/``"inf"`` -> unbounded."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("inf", "none", "")):
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _blocks(value, value)
    match = _CAPACITY.match(str(value))
    if not match:
        raise SpecError(f"bad capacity {value!r}: use a block count or bytes like '40GiB'")
    number, unit = match.groups()
    try:
        amount = float(number)
    except ValueError:
        raise SpecError(f"bad capacity {value!r}") from None
    if not unit:
        return _blocks(amount, value)
    scale = _UNITS.get(unit.lower())
    if scale is None:
        raise SpecError(f"bad capacity unit {unit!r} in {value!r}; units: {', '.join(_UNITS)}")
    return Capacity(int(amount * scale), "bytes")


def _blocks(amount: float, raw: object) -> Capacity:
    if amount < 0 or amount != int(amount):
        raise SpecError(f"capacity {raw!r} must be a whole number of blocks >= 0")
    return Capacity(int(amount), "blocks")


@dataclass(frozen=True)
class InstanceSpec:
    """One instance: ``block_size`` tokens per block (None: from the trace), bytes per block."""

    id: str
    block_size: int | None = None
    block_bytes: int = 0


@dataclass(frozen=True)
class TierSpec:
    """One tier of a group: its capacity (None: unbounded) and eviction policy."""

    name: str = "cache"
    capacity: Capacity | None = None
    policy: str = "lru"
    policy_options: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class GroupSpec:
    """Instances sharing tiers; ``instances`` may be empty for the catch-all ``default`` group.

    ``block_bytes`` is the block size in bytes of instances the group does not list.
    """

    name: str = "default"
    tiers: tuple[TierSpec, ...] = (TierSpec(),)
    instances: tuple[InstanceSpec, ...] = ()
    block_bytes: int = 0

    def instance(self, instance_id: str) -> InstanceSpec:
        """The spec of ``instance_id`` in this group (a default one if not listed)."""
        for inst in self.instances:
            if inst.id == instance_id:
                return inst
        return InstanceSpec(instance_id, block_bytes=self.block_bytes)

    def with_first_tier(self, **changes: Any) -> GroupSpec:
        """A copy with the first tier changed (what ``--capacity`` / ``--policy`` / sweeps do)."""
        first = replace(self.tiers[0], **changes)
        return replace(self, tiers=(first, *self.tiers[1:]))


@dataclass(frozen=True)
class ReplaySpec:
    """Everything a replay needs besides the trace."""

    groups: tuple[GroupSpec, ...] = (GroupSpec(),)
    mode: str = "exact"
    batch_size: int = 100
    watermark: float = 1.0
    promote: bool = False
    timeline: bool = True
    trees: bool = False

    def validate(self) -> ReplaySpec:
        """Check names, policies and units; returns self. :raises SpecError: naming the key."""
        if self.mode not in MODES:
            raise SpecError(f"replay.mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.batch_size <= 0:
            raise SpecError(f"replay.batch_size must be > 0, got {self.batch_size}")
        if not 0 < self.watermark <= 1:
            raise SpecError(f"replay.watermark must be in (0, 1], got {self.watermark}")
        seen: set[str] = set()
        for group in self.groups:
            _check_group(group, seen)
        return self

    def map_groups(self, **changes: Any) -> ReplaySpec:
        """Every group's first tier changed the same way (Tair's sweeps override every group)."""
        return replace(self, groups=tuple(g.with_first_tier(**changes) for g in self.groups))


def _check_group(group: GroupSpec, seen: set[str]) -> None:
    where = f"group {group.name!r}"
    if not group.tiers:
        raise SpecError(f"{where}: needs at least one tier")
    for tier in group.tiers:
        if tier.policy not in POLICIES:
            raise SpecError(f"{where}: unknown policy {tier.policy!r}; valid: {', '.join(POLICIES)}")
    units = {t.capacity.unit for t in group.tiers if t.capacity is not None}
    if len(units) > 1:
        raise SpecError(f"{where}: tiers mix block and byte capacities")
    for inst in group.instances:
        if inst.id in seen:
            raise SpecError(f"instance {inst.id!r} is listed in two groups")
        seen.add(inst.id)
        if units == {"bytes"} and inst.block_bytes <= 0:
            raise SpecError(f"{where}: byte capacity needs block_bytes for instance {inst.id!r}")
    if units == {"bytes"} and group.block_bytes <= 0 and group.name == "default":
        raise SpecError(f"{where}: byte capacity needs block_bytes for unlisted instances")


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML config file. :raises SpecError: unreadable or invalid TOML."""
    try:
        with open(path, "rb") as f:
            config: dict[str, Any] = tomllib.load(f)
            return config
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SpecError(f"{path}: {exc}") from None


_TOP_KEYS = {"trace", "replay", "cost", "groups", "output"}
_REPLAY_KEYS = {"mode", "batch_size", "watermark", "promote", "timeline", "trees"}
_GROUP_KEYS = {"name", "capacity", "policy", "policy_options", "instances", "tiers", "block_bytes"}
_TIER_KEYS = {"name", "capacity", "policy", "policy_options"}
_INSTANCE_KEYS = {"id", "block_size", "block_bytes"}


def _no_unknown(table: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise SpecError(f"{where}: unknown key {unknown[0]!r}; valid: {', '.join(sorted(allowed))}")


def spec_from_config(config: dict[str, Any]) -> ReplaySpec:
    """The :class:`ReplaySpec` of a parsed TOML config (``[replay]`` and ``[[groups]]``)."""
    _no_unknown(config, _TOP_KEYS, "config")
    replay = config.get("replay", {})
    _no_unknown(replay, _REPLAY_KEYS, "[replay]")
    groups = tuple(_group(g, i) for i, g in enumerate(config.get("groups", [])))
    return ReplaySpec(
        groups=groups or (GroupSpec(),),
        **{k: replay[k] for k in _REPLAY_KEYS if k in replay},
    ).validate()


def _group(table: dict[str, Any], index: int) -> GroupSpec:
    where = f"groups[{index}]"
    _no_unknown(table, _GROUP_KEYS, where)
    if "tiers" in table:
        if "capacity" in table or "policy" in table:
            raise SpecError(f"{where}: give either capacity/policy or [[groups.tiers]], not both")
        tiers = tuple(_tier(t, f"{where}.tiers[{i}]") for i, t in enumerate(table["tiers"]))
    else:
        tiers = (_tier({k: table[k] for k in _TIER_KEYS - {"name"} if k in table}, where),)
    block_bytes = int(table.get("block_bytes", 0))
    instances = tuple(
        _instance(x, f"{where}.instances", block_bytes) for x in table.get("instances", [])
    )
    return GroupSpec(table.get("name", f"group{index}"), tiers, instances, block_bytes)


def _tier(table: dict[str, Any], where: str) -> TierSpec:
    _no_unknown(table, _TIER_KEYS, where)
    return TierSpec(
        name=table.get("name", "cache"),
        capacity=parse_capacity(table.get("capacity")),
        policy=table.get("policy", "lru"),
        policy_options=dict(table.get("policy_options", {})),
    )


def _instance(value: str | dict[str, Any], where: str, block_bytes: int) -> InstanceSpec:
    """An instance entry; ``block_bytes`` is the group's, the default for its instances."""
    if isinstance(value, str):
        return InstanceSpec(value, block_bytes=block_bytes)
    _no_unknown(value, _INSTANCE_KEYS, where)
    if "id" not in value:
        raise SpecError(f"{where}: every instance needs an id")
    size = int(value.get("block_bytes", block_bytes))
    return InstanceSpec(str(value["id"]), value.get("block_size"), size)
