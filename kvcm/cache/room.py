"""In-line eviction: the hook through which ``start_write_cache`` makes room in a full group.

A write that would exceed a group's quota (``quota.capacity`` or a per-type ``quota_config``)
asks the group's :class:`RoomMaker` — in kvcm the reclaimer, which owns the eviction policies —
for victims, marks them ``deleting`` in the request's own transaction
(:func:`kvcm.cache.removal.mark_deleting`), and admits the write if that covered the need
(:mod:`kvcm.cache.writes`). Without a room maker the write is refused ``QUOTA_EXCEEDED`` as
before, and waits for the reclaimer's next round.

The contract, both sides:

* ``make_room(group, needs, limit)`` runs on the RPC thread inside a write transaction, so it
  must not open one of its own, nor block. ``needs`` maps a storage type to the bytes of that
  type to free; the key ``""`` is the group total: bytes of *any* type, those freed for a
  per-type need included. ``limit`` is the most victims it may return. It picks them by the
  group's own policy, never ``writing`` or pinned blocks, and stops tracking them; when it
  cannot cover every need it says why in :attr:`Room.why`.
* The cache marks only victims that still have a ``serving`` copy of the named type in that
  group; the others are dropped (the maker's view lags the store by up to one round, and a
  victim without such a copy is one it should not track anyway).
* Victims among the request's own keys (a stored prefix the write builds on) are not evicted:
  that would leave the new blocks unreachable by ``prefix_match``. They are handed back with
  ``give_back`` when the request is done asking (not earlier, or they would be offered again).
* ``give_back(victims)`` is also called with the victims that were marked when the transaction
  that marked them does not commit (the request failed after making room, or its group commit
  failed): they are ``serving`` again, and the maker tracks them again.
* Threads: both are called on the thread that runs the write (the RPC thread), while the
  reclaimer's own rounds run on theirs; the maker synchronises its policy state itself.
* On commit the listeners hear ``on_evicted`` for the marked victims (as for the reclaimer's own
  evictions) and ``on_removed`` for keys that lost their last readable copy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

Victim = tuple[str, int, str]  # (instance_id, block key, storage type)


@dataclass
class Room:
    """What a :class:`RoomMaker` found: the victims, and why they do not cover the need (if so)."""

    victims: list[Victim] = field(default_factory=list)
    why: str = ""  # e.g. "12 pinned blocks"; empty when the victims cover every need


class RoomMaker(Protocol):
    """Chooses eviction victims for in-line eviction; see the module docstring."""

    def make_room(self, group: str, needs: Mapping[str, int], limit: int) -> Room: ...

    def give_back(self, victims: Sequence[Victim]) -> None: ...
