"""Placeholder of the in-line eviction contract (the cache side replaces this module)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class Room:
    victims: list[tuple[str, int, str]] = field(default_factory=list)
    why: str = ""


class RoomMaker(Protocol):
    def make_room(self, group: str, needs: Mapping[str, int], limit: int) -> Room: ...

    def give_back(self, victims: Sequence[tuple[str, int, str]]) -> None: ...
