"""Where blocks go and which copies may be read: the data plane's view of storages and groups.

* :class:`InstanceView` / :class:`GroupView` — the registry facts the hot paths need, flattened
  once per registry change (namespace bytes, spec sizes, the empty filler, candidate order).
* :func:`write_targets` — write targets (Tair KVCM's rule without its estimate): the first candidate of
  the group, in order, that is enabled, available and opened, and whose storage type still has
  quota for this request; the group's total quota is checked first. Quotas are hard limits:
  ``used - being_freed + needed <= capacity`` (0 = unlimited), where ``being_freed`` are the
  bytes of ``deleting`` locations the deleter has not freed yet.
* :func:`shortfall` — what in-line eviction must free when they are not met.
* reads skip copies on storages that are not usable, and prefer copies in candidate order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from kvcm.cache.meta_index import namespace
from kvcm.cache.record_codec import empty_wire
from kvcm.control.records import Instance, InstanceGroup
from kvcm.errors import CapacityError, Code, InvalidArgument


@dataclass(frozen=True)
class InstanceView:
    """An instance as the data plane uses it."""

    instance_id: str
    group: str
    ns: bytes
    block_size: int
    specs: tuple[tuple[str, int], ...]  # (name, bytes per block) in registered order
    spec_groups: dict[str, frozenset[str]]
    empty_wire: bytes  # Tair's filler entry for batch_get / sw match misses

    @classmethod
    def of(cls, instance: Instance) -> InstanceView:
        specs = tuple((s.name, int(s.size)) for s in instance.location_spec_infos)
        groups = {g.name: frozenset(g.spec_names) for g in instance.location_spec_groups}
        return cls(instance.instance_id, instance.instance_group, namespace(instance.instance_id),
                   int(instance.block_size), specs, groups, empty_wire([name for name, _ in specs]))

    def specs_for(self, group_names: Sequence[str] | None, n: int) -> list[tuple[tuple[str, int], ...]]:
        """Specs to allocate for each of ``n`` blocks (hybrid attention: a spec group per block)."""
        if not self.specs:
            raise InvalidArgument(f"instance {self.instance_id!r} is a router-only instance (registered without "
                                  f"location_spec_infos): it has no storage to write to")
        if not group_names:
            return [self.specs] * n
        if len(group_names) != n:
            # Compared with the *derived* keys, so token_ids work too (Tair compared with
            # block_keys only).
            raise InvalidArgument(f"location_spec_group_names: has {len(group_names)} entries for {n} blocks")
        out = []
        for i, name in enumerate(group_names):
            members = self.spec_groups.get(name)
            if members is None:
                raise InvalidArgument(f"location_spec_group_names[{i}]: unknown spec group {name!r}")
            out.append(tuple(s for s in self.specs if s[0] in members))
        return out


@dataclass(frozen=True)
class GroupView:
    name: str
    candidates: tuple[str, ...]
    capacity: int  # bytes, 0 = unlimited
    type_capacity: dict[str, int] = field(default_factory=dict)  # 0 = unlimited
    delay_ms: int = 0

    @classmethod
    def of(cls, group: InstanceGroup) -> GroupView:
        quota = group.quota
        per_type = {q.storage_type: int(q.capacity) for q in quota.quota_config}
        delay = int(group.reclaim_strategy.delay_before_delete_ms)
        return cls(group.name, tuple(group.storage_candidates), int(quota.capacity), per_type, delay)

    def rank(self, storage: str) -> int:
        """Read preference: candidate order first, then anything else."""
        try:
            return self.candidates.index(storage)
        except ValueError:
            return len(self.candidates)


@dataclass(frozen=True)
class Target:
    storage: str
    type: str


def _usable_candidates(group: GroupView, storage_type: Callable[[str], str | None],
                       usable: Callable[[str], bool]) -> Iterator[tuple[str, str, int]]:
    """``(storage, type, type quota or 0)`` of the group's usable candidates, in preference order."""
    for name in group.candidates:
        kind = storage_type(name)
        if kind is not None and usable(name):
            yield name, kind, group.type_capacity.get(kind, 0)


def write_targets(
    group: GroupView,
    needed: int,
    used_total: int,
    used_by_type: Mapping[str, int],
    freeing: Mapping[str, int],
    storage_type: Callable[[str], str | None],
    usable: Callable[[str], bool],
) -> list[Target]:
    """Write targets for ``needed`` bytes in preference order (the caller tries them in turn, so
    a storage that turns out full at allocation falls over to the next), or why there is none.

    ``freeing``: bytes per type being freed (``deleting``, still in ``used``): they no longer
    count against a quota, so a write need not wait for the deleter's grace delay.

    :raises CapacityError: QUOTA_EXCEEDED (group total, or every usable candidate's type is
        full) or NO_STORAGE_AVAILABLE (no candidate is usable).
    """
    gone = sum(freeing.values())
    if group.capacity and used_total - gone + needed > group.capacity:
        raise CapacityError(
            f"instance group {group.name!r} quota exceeded: {used_total} of {group.capacity} bytes used "
            f"({gone} of them being freed), {needed} more requested", Code.QUOTA_EXCEEDED)
    full: list[str] = []
    targets: list[Target] = []
    for name, kind, cap in _usable_candidates(group, storage_type, usable):
        used, going = used_by_type.get(kind, 0), freeing.get(kind, 0)
        if cap and used - going + needed > cap:
            full.append(f"{name} ({kind}: {used} of {cap} bytes used, {going} of them being freed)")
            continue
        targets.append(Target(name, kind))
    if targets:
        return targets
    if full:
        raise CapacityError(
            f"instance group {group.name!r}: storage type quota exceeded on every usable candidate: "
            f"{', '.join(full)}; {needed} more bytes requested", Code.QUOTA_EXCEEDED)
    raise CapacityError(
        f"instance group {group.name!r}: no usable storage among candidates {list(group.candidates)} "
        "(disabled, unavailable or not opened)", Code.NO_STORAGE_AVAILABLE)


def shortfall(
    group: GroupView,
    needed: int,
    used_total: int,
    used_by_type: Mapping[str, int],
    freeing: Mapping[str, int],
    storage_type: Callable[[str], str | None],
    usable: Callable[[str], bool],
) -> dict[str, int]:
    """What in-line eviction must free for :func:`write_targets` to admit ``needed`` bytes:
    ``{"": bytes of any type}`` for the group total, and ``{type: bytes}`` of the first usable
    candidate's type that could hold the request at all, when no usable candidate's type has room
    (a candidate that has room takes the write without evicting anything, as before). Empty: nothing to free (it fits, or no
    candidate is usable, which eviction cannot help)."""
    if (group.capacity and needed > group.capacity) or needed <= 0:
        return {}  # never fits (or nothing to fit): evicting would only waste blocks
    needs: dict[str, int] = {}
    if group.capacity:
        over = used_total - sum(freeing.values()) + needed - group.capacity
        if over > 0:
            needs[""] = over
    first: tuple[str, int] | None = None
    for _, kind, cap in _usable_candidates(group, storage_type, usable):
        over = used_by_type.get(kind, 0) - freeing.get(kind, 0) + needed - cap if cap else 0
        if over <= 0:
            return needs  # this type has room
        if first is None and needed <= cap:  # a type whose quota is below the request never fits
            first = (kind, over)
    if first is None:
        return {}
    needs[first[0]] = first[1]
    return needs
