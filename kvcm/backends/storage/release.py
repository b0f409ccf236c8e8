"""``kvcm storage release <root>``: remove the ownership marker of a root whose data dir is gone.

A root refused because its marker names another data dir stays refused until someone removes
that marker. This does it, and only that: no block file is touched (they stay, unindexed; a
kvcm given the root then adopts them or, on ``--discard-orphans``, deletes only what a marker
it can verify names). It removes a marker only when its owner is provably gone
(:func:`~kvcm.backends.storage.ownership.owner_gone`: signed by this host's key, naming this
host and a data dir that no longer lives), or, with ``force``, a marker nothing proves (an
earlier kvcm's, with no host recorded) whose data dir path does not exist on this host.
"""

from __future__ import annotations

import os

from kvcm.backends.storage.host import machine_id
from kvcm.backends.storage.ownership import (
    FILE_MARKER,
    MARKER_SUFFIX,
    ForeignDirectory,
    Marker,
    Owner,
    owner_gone,
    read_marker,
)
from kvcm.backends.storage.safe_files import create_unique
from kvcm.errors import InvalidArgument


def marker_path(root: str) -> str:
    """A file root's marker (``<root>/.kvcm-storage``), or a shm prefix's (``<root>kvcm-storage``)."""
    root = os.path.abspath(root) + ("/" if root.endswith("/") else "")
    if os.path.isdir(root):
        return os.path.join(root, FILE_MARKER)
    return root + MARKER_SUFFIX


def release(root: str, force: bool = False) -> str:
    """Remove the marker of ``root`` if its owner is gone; returns what was done. Raises
    InvalidArgument (and removes nothing) when the owner may still live."""
    path = marker_path(root)
    found = _read(path)
    reason = _why_released(found, path, force)
    aside, fd = create_unique(f"{path}.released.")  # moved aside, checked again, then removed
    os.close(fd)
    os.replace(path, aside)
    moved = _read(aside)
    if moved != found or moved.mac != found.mac:  # swapped in between: put back whatever is there
        os.replace(aside, path)
        raise InvalidArgument(f"the marker {path} changed while it was released; nothing was removed")
    os.unlink(aside)
    return f"released {root}: removed the marker of {found.describe()} ({reason}); its files were not touched"


def _read(path: str) -> Marker:
    try:
        found = read_marker(path)
    except ForeignDirectory as exc:
        raise InvalidArgument(exc.message) from None
    if found is None:
        raise InvalidArgument(f"{path}: no kvcm ownership marker there; nothing to release")
    return found


def _why_released(found: Marker, path: str, force: bool) -> str:
    gone = owner_gone(found, Owner(""))
    if gone:
        return gone
    if found.host_signed:
        raise InvalidArgument(f"{path} belongs to {found.describe()}, which may still live; nothing was removed")
    if not force:
        raise InvalidArgument(
            f"{path} names {found.describe()}, but nothing proves kvcm on this host wrote it (no host signature: an "
            f"earlier kvcm's marker, or a planted one); if that data dir is gone, run again with --force")
    if found.host and found.host != machine_id():
        raise InvalidArgument(f"{path} names host {found.host}, not this one; release it there")
    if found.data_dir and os.path.lexists(found.data_dir):
        raise InvalidArgument(f"{path} names data dir {found.data_dir}, which exists here; nothing was removed")
    return "--force: an unproven marker whose data dir does not exist here"
