"""Instances in the registry: register (or attach with the same identity), capacity, remove."""

from __future__ import annotations

import msgspec

from kvcm.backends.metastore.base import ReadTxn
from kvcm.control.records import (
    Instance,
    InstanceGroup,
    Storage,
    check_instance,
    identity_difference,
    now_ms,
)
from kvcm.control.registry_core import INSTANCE, Registration, RegistryCore, instance_not_found
from kvcm.errors import Code, Conflict, error


class InstanceRegistry(RegistryCore):
    """Instances in the registry: register (or attach with the same identity), capacity, remove."""

    def register_instance(self, instance: Instance, given: frozenset[str] | None = None) -> Registration:
        """Register, or confirm a registration of the same instance (Tair's idempotency).

        ``given``: the optional identity fields the caller gave (``OPTIONAL_IDENTITY_FIELDS``);
        those left out are not compared, so a worker attaches to an instance an operator
        registered without restating its deployment. None compares every field.

        :raises Conflict: DUPLICATE_ENTITY if the id exists with another group, block size, specs,
            spec groups or deployment (order of specs and groups does not matter); the message
            names the field and both values.
        :raises NotFound: the group does not exist.
        """
        instance = check_instance(instance)
        with self._store.write() as txn:
            old = self._instances.read(txn, instance.instance_id)
            if old is not None:
                difference = identity_difference(old, instance, given)
                if difference is not None:
                    raise Conflict(
                        f"instance {instance.instance_id!r} is already registered with another {difference}",
                        Code.DUPLICATE_ENTITY,
                    )
                return Registration(
                    old, False, self._candidates(txn, self._must(txn, self._groups, old.instance_group))
                )
            group = self._must(txn, self._groups, instance.instance_group)
            self._check_capacity(txn, group)
            new = msgspec.structs.replace(
                instance, quota_group_name=group.global_quota_group_name, create_time=now_ms()
            )
            self._instances.put(txn, new, self._changed)
            return Registration(new, True, self._candidates(txn, group))

    def _candidates(self, view: ReadTxn, group: InstanceGroup) -> list[Storage]:
        found = (self._storages.read(view, name) for name in group.storage_candidates)
        return [s for s in found if s is not None]

    def _check_capacity(self, txn: ReadTxn, group: InstanceGroup) -> None:
        if group.max_instance_count <= 0:
            return
        count = sum(1 for i in self._instances.all(txn) if i.instance_group == group.name)
        if count >= group.max_instance_count:
            raise error(
                Code.REACH_MAX_ENTITY_CAPACITY,
                f"instance group {group.name!r} already has max_instance_count={group.max_instance_count} instances",
            )

    def remove_instance(self, instance_id: str) -> Instance:
        """Unregister; observers learn of it (the data plane then drops the instance's blocks)."""
        with self._store.write() as txn:
            old = self._instances.read(txn, instance_id)
            if old is None:
                raise instance_not_found(instance_id)
            self._run_guards(txn, INSTANCE, instance_id)
            self._instances.delete(txn, instance_id, self._changed)
            return old
