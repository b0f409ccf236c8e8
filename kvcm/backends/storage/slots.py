"""The slots of ``file`` and ``shm`` storages: containers (files, segments) cut into blocks of
one size, and the pool that packs blocks into them."""

from __future__ import annotations

from collections.abc import Iterable, Iterator


def slot_runs(slots: Iterable[int]) -> list[tuple[int, int]]:
    """Coalesce slot ids into ``(first, count)`` runs so adjacent frees cost one syscall."""
    runs: list[tuple[int, int]] = []
    for slot in sorted(set(slots)):
        if runs and runs[-1][0] + runs[-1][1] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((slot, 1))
    return runs


class Container:
    """One file or segment cut into ``slots`` blocks of ``size`` bytes.

    Slot state is a bytearray (1 = used): one byte per slot keeps a 1 GiB segment of 4 KiB
    blocks at 256 KiB, and ``find`` scans it at C speed. Invariant: no free slot lies below
    ``hint``, so the lowest free slot is ``bits.find(0, hint)``.

    ``lost`` marks a container the metadata references but that is gone from disk: its slots
    are accounted (so deletes balance) but never handed out again."""

    __slots__ = ("bits", "free", "hint", "lost", "name", "size", "slots")

    def __init__(self, name: str, size: int, slots: int, lost: bool = False) -> None:
        self.name = name
        self.size = size
        self.slots = slots
        self.bits = bytearray(slots)
        self.free = slots  # number of free slots
        self.hint = 0
        self.lost = lost

    @property
    def used(self) -> int:
        return self.slots - self.free

    def holds(self, slot: int) -> bool:
        """Whether ``slot`` is reserved."""
        return 0 <= slot < self.slots and self.bits[slot] == 1

    def pop_free(self) -> int:
        """The lowest free slot, now used (callers check ``free`` first)."""
        slot = self.bits.find(0, self.hint)
        self.bits[slot] = 1
        self.free -= 1
        self.hint = slot + 1
        return slot

    def mark(self, slot: int, used: bool) -> bool:
        """Set one slot's state; False if it already had it (or is out of range)."""
        if not 0 <= slot < self.slots or self.bits[slot] == used:
            return False
        self.bits[slot] = used
        self.free += -1 if used else 1
        if not used:
            self.hint = min(self.hint, slot)
        return True


class SlotPool:
    """Slot accounting for containers, grouped by block-size class (instances with different
    block sizes never share a container, so a slot offset is always ``slot * size``).

    Purely in memory: it is rebuilt at start-up from the metadata via ``reserve``. Not
    thread-safe by itself; the owning backend holds its lock around every call."""

    def __init__(self) -> None:
        self._containers: dict[str, Container] = {}
        # size -> containers having a free slot (a dict as an insertion-ordered set)
        self._with_free: dict[int, dict[str, Container]] = {}
        self.slots_used = 0
        self.bytes_used = 0
        self.bytes_allocated = 0  # logical size of all containers (sparse: not all on disk)

    def __len__(self) -> int:
        return len(self._containers)

    def __iter__(self) -> Iterator[Container]:
        return iter(list(self._containers.values()))

    def get(self, name: str) -> Container | None:
        return self._containers.get(name)

    def add(self, container: Container) -> None:
        self._containers[container.name] = container
        self.bytes_allocated += container.slots * container.size
        used = container.used
        self.slots_used += used
        self.bytes_used += used * container.size
        self._offer(container)

    def remove(self, container: Container) -> None:
        del self._containers[container.name]
        self._with_free.get(container.size, {}).pop(container.name, None)
        self.bytes_allocated -= container.slots * container.size
        self.slots_used -= container.used
        self.bytes_used -= container.used * container.size

    def take(self, size: int, count: int) -> list[tuple[Container, int]]:
        """Up to ``count`` free slots of existing containers, fullest container first: packing
        freed slots back into busy containers lets the emptiest ones drain and be unlinked."""
        taken: list[tuple[Container, int]] = []
        candidates = self._with_free.get(size, {})
        for container in sorted(candidates.values(), key=lambda c: c.free):
            n = min(count - len(taken), container.free)
            taken.extend((container, container.pop_free()) for _ in range(n))
            self._count(container, n)
            if not container.free:
                del candidates[container.name]
            if len(taken) == count:
                break
        return taken

    def claim(self, container: Container, slot: int) -> bool:
        """Mark one given slot used (recovery); False if it already was."""
        if not container.mark(slot, True):
            return False
        self._count(container, 1)
        if not container.free:
            self._with_free.get(container.size, {}).pop(container.name, None)
        return True

    def put_back(self, container: Container, slot: int) -> bool:
        """Mark one slot free again; False if it was free already or out of range."""
        if not container.mark(slot, False):
            return False
        self._count(container, -1)
        self._offer(container)
        return True

    def grow(self, container: Container, slots: int) -> None:
        """Give ``container`` ``slots`` slots (recovery: the metadata knows of more slots than
        a truncated file still holds)."""
        extra = slots - container.slots
        if extra <= 0:
            return
        container.bits.extend(bytes(extra))
        container.slots = slots
        container.free += extra
        self.bytes_allocated += extra * container.size
        self._offer(container)

    def withdraw(self, container: Container) -> None:
        """Hand out no more slots of ``container`` (it lost its bytes); accounting stays."""
        self._with_free.get(container.size, {}).pop(container.name, None)

    def _offer(self, container: Container) -> None:
        if container.free and not container.lost:
            self._with_free.setdefault(container.size, {})[container.name] = container

    def _count(self, container: Container, delta: int) -> None:
        self.slots_used += delta
        self.bytes_used += delta * container.size
