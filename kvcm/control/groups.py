"""Instance groups in the registry: create, merge an update (compare-and-set on the version), remove."""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from kvcm.backends.metastore.base import ReadTxn, WriteTxn
from kvcm.control.records import (
    InstanceGroup,
    check_group,
    convert,
    now_ms,
    to_wire,
)
from kvcm.control.registry_core import GROUP, RegistryCore, merge, names_of
from kvcm.errors import Code, Conflict, InvalidArgument
from kvcm.proto import schema

#: Group fields the server owns: an update never takes them from the caller.
_GROUP_SERVER_FIELDS = ("version", "create_time", "update_time")


class GroupRegistry(RegistryCore):
    """Instance groups in the registry: create, merge an update (compare-and-set on the version), remove."""

    def create_group(self, group: InstanceGroup) -> InstanceGroup:
        """:raises Conflict: DUPLICATE_ENTITY if it exists. Version starts at 1."""
        group = check_group(group)
        with self._store.write() as txn:
            if self._groups.read(txn, group.name) is not None:
                raise Conflict(f"instance group {group.name!r} already exists", Code.DUPLICATE_ENTITY)
            return self._put_new_group(txn, group)

    def _put_new_group(self, txn: WriteTxn, group: InstanceGroup) -> InstanceGroup:
        self._check_candidates(txn, group)
        now = now_ms()
        group = msgspec.structs.replace(group, version=1, create_time=now, update_time=now)
        self._groups.put(txn, group, self._changed)
        return group

    def update_group(self, changes: Mapping[str, object], current_version: int) -> InstanceGroup:
        """Merge ``changes`` (a partial group map with its ``name``) into the group if its version
        is still ``current_version``; the stored version becomes ``current_version + 1``.

        :raises Conflict: VERSION_CONFLICT when the group changed since the caller read it.
        :raises InvalidArgument: for any key, at any depth, that is not a group field — first,
            whatever the version, so a typo is never reported as a conflict.
        """
        schema.check_partial(changes, InstanceGroup, "instance_group")
        name = changes.get("name")
        if not isinstance(name, str):
            raise InvalidArgument("instance_group.name: required")
        with self._store.write() as txn:
            old = self._must(txn, self._groups, name)
            if old.version != current_version:
                raise Conflict(
                    f"instance group {name!r} is at version {old.version}, not {current_version}; re-read it and retry",
                    Code.VERSION_CONFLICT,
                )
            merged = merge(to_wire(old), {k: v for k, v in changes.items() if k not in _GROUP_SERVER_FIELDS})
            new = check_group(convert(merged, InstanceGroup, "instance_group"))
            self._check_candidates(txn, new)
            new = msgspec.structs.replace(
                new, version=old.version + 1, create_time=old.create_time, update_time=now_ms()
            )
            self._groups.put(txn, new, self._changed)
            return new

    def _check_candidates(self, txn: ReadTxn, group: InstanceGroup) -> None:
        for i, name in enumerate(group.storage_candidates):
            if self._storages.read(txn, name) is None:
                raise InvalidArgument(f"instance_group.storage_candidates[{i}]: storage {name!r} does not exist")

    def remove_group(self, name: str) -> None:
        """:raises Conflict: STILL_REFERENCED while instances belong to it."""
        with self._store.write() as txn:
            self._must(txn, self._groups, name)
            members = [i.instance_id for i in self._instances.all(txn) if i.instance_group == name]
            if members:
                raise Conflict(
                    f"instance group {name!r} still has {len(members)} instance(s) ({names_of(members)}); "
                    "remove them first",
                    Code.STILL_REFERENCED,
                )
            self._run_guards(txn, GROUP, name)
            self._groups.delete(txn, name, self._changed)
