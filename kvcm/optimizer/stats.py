"""What a replay measures: hit counters per instance, group usage, the whole result.

Rates are hits over reads: *internal* hits were masked (on the device already), *external*
hits were found in kvcm's tiers; token rates weigh each lookup by its prompt tokens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import TypedDict

from kvcm.optimizer.radix import RadixTree

#: One lookup of a replay timeline: ``(time, instance's cached blocks, group's cached blocks,
#: blocks read, internal hits, external hits, tokens read, internal hit tokens, hit tokens)``.
TimelineRow = tuple[float, int, int, int, int, int, int, int, int]


class TierResult(TypedDict):
    """Where one tier of a group ended."""

    name: str
    policy: str
    capacity: int | None
    limit: int | None
    usage: int
    blocks: int

#: Columns of a timeline row, one row per lookup.
TIMELINE_COLUMNS = (
    "ts", "cached_blocks_instance", "cached_blocks_group", "read_blocks", "internal_hit_blocks",
    "external_hit_blocks", "read_tokens", "internal_hit_tokens", "hit_tokens",
)  # fmt: skip


@dataclass(slots=True)
class HitStats:
    """Counters for one instance (or a sum over instances)."""

    reads: int = 0
    read_blocks: int = 0
    internal_hit_blocks: int = 0
    external_hit_blocks: int = 0
    read_tokens: int = 0
    internal_hit_tokens: int = 0
    hit_tokens: int = 0
    written_blocks: int = 0
    evicted_blocks: int = 0
    removed_blocks: int = 0
    tier_hit_blocks: list[int] = field(default_factory=list)

    @property
    def hit_blocks(self) -> int:
        return self.internal_hit_blocks + self.external_hit_blocks

    @property
    def block_hit_rate(self) -> float:
        return _ratio(self.hit_blocks, self.read_blocks)

    @property
    def internal_block_hit_rate(self) -> float:
        return _ratio(self.internal_hit_blocks, self.read_blocks)

    @property
    def external_block_hit_rate(self) -> float:
        return _ratio(self.external_hit_blocks, self.read_blocks)

    @property
    def token_hit_rate(self) -> float:
        return _ratio(self.hit_tokens, self.read_tokens)

    @property
    def internal_token_hit_rate(self) -> float:
        return _ratio(self.internal_hit_tokens, self.read_tokens)

    @property
    def external_token_hit_rate(self) -> float:
        return _ratio(self.hit_tokens - self.internal_hit_tokens, self.read_tokens)

    def add(self, other: HitStats) -> None:
        """Accumulate ``other`` into this one."""
        for f in fields(self):
            if f.name != "tier_hit_blocks":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        tiers = self.tier_hit_blocks
        tiers.extend([0] * (len(other.tier_hit_blocks) - len(tiers)))
        for i, n in enumerate(other.tier_hit_blocks):
            tiers[i] += n

    def to_json(self) -> dict[str, object]:
        out = asdict(self)
        out["hit_blocks"] = self.hit_blocks
        for name in RATES:
            out[name] = getattr(self, name)
        return out


RATES = (
    "block_hit_rate", "internal_block_hit_rate", "external_block_hit_rate",
    "token_hit_rate", "internal_token_hit_rate", "external_token_hit_rate",
)  # fmt: skip


def _ratio(a: int, b: int) -> float:
    return a / b if b else 0.0


@dataclass
class GroupResult:
    """Where a group ended: its tiers, their usage and the peak of the first tier."""

    name: str
    unit: str
    tiers: list[TierResult]
    instances: list[str]
    peak_usage: int
    peak_blocks: int


@dataclass
class ReplayResult:
    """Everything a replay measured."""

    label: str
    instances: dict[str, HitStats]
    block_sizes: dict[str, int]
    groups: list[GroupResult]
    timelines: dict[str, list[TimelineRow]]
    records: int
    dropped_records: int
    first_ts: float
    last_ts: float
    wall_seconds: float
    trees: dict[str, RadixTree] = field(default_factory=dict)

    @property
    def total(self) -> HitStats:
        """Sum over all instances."""
        out = HitStats()
        for stats in self.instances.values():
            out.add(stats)
        return out

    @property
    def duration(self) -> float:
        """Trace time covered, in seconds."""
        return max(self.last_ts - self.first_ts, 0.0)
