"""Tair's ReportEvent as kvcm ``report_events`` ops, run in Tair's order.

Tair applies a ReportEvent's items by kind, whatever their order in the call: registrations
first, then heartbeats, then the blocks, then a host down. Its reporters rely on that: its own
ReportEvent test sends an add and a heartbeat in one call, its cache subscriber sends a host down
before it registers, and an empty call is a no-op. kvcm's ``report_events`` takes one op per
call, so one Tair call becomes the ops its items need, in that order:

- ``register`` if any item registers (several are one; kvcm's register is idempotent);
- the blocks in the order given: a run of adds and deletes is one ``events`` op (unsequenced,
  keyed), a snapshot one ``snapshot`` op (one per call, as Tair has it);
- ``heartbeat`` if the call heartbeats and no other op hears the source already (each does);
- ``down`` last if any item is a host down; a host kvcm does not know is down already, as in
  Tair, where the down of an unregistered host answers OK.

Every item is checked before any op runs, so a malformed call changes nothing. An op refused at
run time (the host is not registered, another tenant's, the instance unknown) ends the call with
its error; the ops before it stay applied, as Tair applies items one by one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvcm.errors import Code, InvalidArgument, KvcmError
from kvcm.proto import tair as s
from kvcm.proto.tair.events import Block
from kvcm.proto.wire import Decoded, DecodedMap, Encodable
from kvcm.tair.requests import reporter_source_id

#: ``(kvcm method, params) -> result``, as :data:`kvcm.tair.translate.Forward`.
Forward = Callable[[str, dict[str, Encodable]], Decoded]

#: kvcm's bound on a source id, which a reporter's identity becomes.
_MAX_SOURCE_ID = 200
#: What every op of one Tair call carries from it.
_CALL = ("trace_id", "auth")


def report_event_in(body: DecodedMap) -> dict[str, Encodable]:
    """Tair's ReportEvent, checked whole: the reporter's push source and the ops to run on it."""
    instance_id = s.text(body.get("instance_id"), "instance_id")
    host = s.text(body.get("host_ip_port"), "host_ip_port")
    if not host:
        raise InvalidArgument("host_ip_port: required (the reporter's host, its pod in kvcm)")
    storage = s.STORAGE_TYPE.parse(body.get("storage_type"), "storage_type")
    if storage not in s.REPORTER_STORAGE:
        raise InvalidArgument(f"storage_type: {storage} is not an event-report storage type "
                              f"({' or '.join(s.REPORTER_STORAGE)})")
    source_id = reporter_source_id(instance_id, storage, host)
    if len(source_id) > _MAX_SOURCE_ID:
        raise InvalidArgument(f"host_ip_port: instance_id and host_ip_port together are too long "
                              f"(kvcm's source id {source_id[:40]!r}... exceeds {_MAX_SOURCE_ID} characters)")
    items = [s.event_in(raw, f"events[{i}]") for i, raw in enumerate(s.messages(body.get("events"), "events"))]
    snapshots = [i for i, item in enumerate(items) if item.op == "snapshot"]
    if len(snapshots) > 1:
        raise InvalidArgument(f"events[{snapshots[1]}]: one EVENT_BLOCK_SNAPSHOT per call")
    kinds = {item.op for item in items}
    ops: list[Encodable] = []
    if "register" in kinds:
        ops.append({"op": "register", "instance_id": instance_id, "pod": host})
    ops.extend(_block_ops(items))
    if "heartbeat" in kinds and not ops:
        ops.append({"op": "heartbeat"})
    if "down" in kinds:
        ops.append({"op": "down"})
    return {"source_id": source_id, "ops": ops}


def _block_ops(items: Iterable[s.ReportedEvent]) -> list[Encodable]:
    """The blocks' ops in the order given: a run of adds and deletes is one ``events`` op."""
    ops: list[Encodable] = []
    run: list[Block] = []
    for item in items:
        if item.op == "events":
            run.extend(item.blocks)
        elif item.op == "snapshot":
            if run:
                ops.append({"op": "events", "events": _batched(run)})
                run = []
            ops.append({"op": "snapshot", "events": _batched(item.blocks)})
    if run:
        ops.append({"op": "events", "events": _batched(run)})
    return ops


def _batched(blocks: Iterable[Block]) -> list[Encodable]:
    """kvcm events of Tair's blocks, in order: a run of one kind on one medium is one event
    (keyed adds have no chain to keep, so a run holds any keys)."""
    runs: list[tuple[str, str, list[int]]] = []
    for kind, medium, key in blocks:
        if runs and runs[-1][0] == kind and runs[-1][1] == medium:
            runs[-1][2].append(key)
        else:
            runs.append((kind, medium, [key]))
    return [{"type": kind, "keyed": True, "medium": medium, "block_hashes": keys} for kind, medium, keys in runs]


def run(forward: Forward, params: dict[str, Encodable]) -> Decoded:
    """Run the ops of :func:`report_event_in` in turn; the result ``report_events`` would give
    for the whole call: ``resync`` if any op asks for a snapshot."""
    call = {key: params[key] for key in _CALL if key in params}
    ops = params["ops"]
    assert isinstance(ops, list)
    resync = False
    for op in ops:
        assert isinstance(op, dict)
        try:
            result = forward("report_events", {"source_id": params["source_id"], **op, **call})
        except KvcmError as exc:
            if op["op"] == "down" and exc.code is Code.NOT_FOUND:
                continue  # not registered (or not the caller's): down already, and nothing is told
            raise
        resync = resync or bool(s.as_map(result).get("resync"))
    return {"resync": resync}
