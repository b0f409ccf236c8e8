"""Where a storage may live: the one rule ``add_storage``, ``update_storage``, snapshot loading
and the default storage all go through (:func:`check_placement`).

kvcm creates, sweeps and deletes files in a storage's directory, so the directory must be one
the operator meant to give it. The allowed roots come from configuration only
(``storage.allowed_roots``), never from an RPC: a client that could widen them could point a
storage at ``/etc``. A ``file`` ``root_path`` or ``shm`` ``shm_dir`` is accepted when, after
resolving ``..`` and symlinks, it lies inside an allowed root, carries no control character,
is not the data dir itself (it holds the metadata), and overlaps no other storage: not the same
directory, not nested in or around another one (shm storages may share a directory when
neither prefix is a prefix of the other, since their segment names then never collide).

Pure checks: nothing here creates or touches a file.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvcm.errors import InvalidArgument

#: The tmpfs behind ``shm_open``: allowed for ``shm`` storages unless roots are configured.
SHM_ROOT = "/dev/shm"

# The spec fields naming a directory kvcm manages, per storage type (others have none).
_DIR_FIELD = {"file": "root_path", "shm": "shm_dir"}


@dataclass(frozen=True)
class StorageRoots:
    """The directories storages may live under. ``configured`` empty means the default: the
    data dir for every type, plus ``/dev/shm`` for ``shm``. The data dir is always allowed."""

    data_dir: str | None = None
    configured: tuple[str, ...] = ()

    def for_type(self, storage_type: str) -> list[str]:
        roots = [self.data_dir] if self.data_dir else []
        extra = list(self.configured) if self.configured else ([SHM_ROOT] if storage_type == "shm" else [])
        return [real_path(r) for r in roots + extra]


def real_path(path: str) -> str:
    """``os.path.realpath`` that also resolves a path whose tail does not exist yet: the real
    path of its nearest existing ancestor, then the missing components (a directory made later
    at that place cannot redirect what was checked, since only its parent could hold a link)."""
    path = os.path.abspath(path)
    missing: list[str] = []
    head = path
    while not os.path.lexists(head) and head != os.path.dirname(head):
        head, tail = os.path.split(head)
        missing.append(tail)
    return os.path.join(os.path.realpath(head), *reversed(missing))


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _check_text(name: str, field: str, value: object) -> None:
    if isinstance(value, str) and any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise InvalidArgument(f"storage {name!r}: storage_spec.{field} contains a control character (NUL, newline, ...)")


def placement(storage_type: str, spec: Mapping[str, object]) -> tuple[str, str] | None:
    """``(real directory, shm prefix or "")`` a storage manages, or None (external types)."""
    field = _DIR_FIELD.get(storage_type)
    directory = spec.get(field) if field is not None else None
    if not isinstance(directory, str):
        return None
    prefix = spec.get("prefix", "") if storage_type == "shm" else ""
    return real_path(directory), prefix if isinstance(prefix, str) else ""


def check_placement(
    storage_type: str,
    name: str,
    spec: Mapping[str, object],
    others: Iterable[tuple[str, str, Mapping[str, object]]],
    roots: StorageRoots,
) -> None:
    """InvalidArgument with the reason unless ``spec`` (normalized) may live where it says.

    ``others``: ``(name, storage_type, spec)`` of every other storage of this kvcm."""
    for field in ("root_path", "shm_dir", "prefix"):
        _check_text(name, field, spec.get(field))
    mine = placement(storage_type, spec)
    if mine is None:
        return
    field = _DIR_FIELD[storage_type]
    directory = mine[0]
    allowed = roots.for_type(storage_type)
    if not any(_inside(directory, root) for root in allowed):
        raise InvalidArgument(
            f"storage {name!r}: storage_spec.{field} {spec[field]!r} (really {directory}) is outside the "
            f"allowed roots ({', '.join(allowed) or 'none'}); to allow it, restart kvcm with "
            f"--set storage.allowed_roots={','.join([*allowed, directory])} (or set storage.allowed_roots "
            "in its config file)"
        )
    if roots.data_dir and directory == real_path(roots.data_dir):
        raise InvalidArgument(
            f"storage {name!r}: storage_spec.{field} is the data dir itself, which holds the metadata; "
            "use a subdirectory"
        )
    for other_name, other_type, other_spec in others:
        if other_name != name:
            _check_overlap(name, field, mine, other_name, other_type, other_spec)


def _check_overlap(
    name: str, field: str, mine: tuple[str, str], other_name: str, other_type: str, other_spec: Mapping[str, object]
) -> None:
    theirs = placement(other_type, other_spec)
    if theirs is None:
        return
    (directory, prefix), (other_dir, other_prefix) = mine, theirs
    if directory == other_dir:
        # Two shm storages in one directory only collide when one prefix starts the other.
        if prefix and other_prefix and not (prefix.startswith(other_prefix) or other_prefix.startswith(prefix)):
            return
        what = f"prefix {prefix!r} overlaps prefix {other_prefix!r} of" if prefix and other_prefix else "is the directory of"
        raise InvalidArgument(f"storage {name!r}: storage_spec.{field} {directory} {what} storage {other_name!r}")
    if _inside(directory, other_dir) or _inside(other_dir, directory):
        raise InvalidArgument(
            f"storage {name!r}: storage_spec.{field} {directory} is nested with {other_dir} of storage {other_name!r}"
        )


__all__ = ["SHM_ROOT", "StorageRoots", "check_placement", "placement", "real_path"]
