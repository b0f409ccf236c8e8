"""Tair's reported events (``ReportEvent``'s items): registers, heartbeats, block adds and
deletes, snapshots, host downs, each read as its kvcm ``report_events`` op."""

from __future__ import annotations

from kvcm.errors import InvalidArgument
from kvcm.proto.tair.enums import REPORT_EVENT_TYPE
from kvcm.proto.tair.fields import int64, message, messages, path, show, text, texts
from kvcm.proto.wire import Decoded, DecodedMap

#: Tair's storage types a reporter declares (an event-report backend each); another is refused.
REPORTER_STORAGE = {"ST_EVENT_REPORT_L1P5": "L1P5", "ST_EVENT_REPORT_L2": "L2"}

#: The oneof member each event type carries its parameters in.
_PARAMS = {"EVENT_NODE_REGISTER": "node_register", "EVENT_BLOCK_ADD": "block_add",
           "EVENT_BLOCK_DELETE": "block_delete", "EVENT_HOST_DOWN": "host_down", "EVENT_HEARTBEAT": "heartbeat",
           "EVENT_BLOCK_SNAPSHOT": "block_snapshot"}
_ITEM = frozenset({"event_type", *_PARAMS.values()})
_REGISTER = frozenset({"mediums"})
_ADD = frozenset({"block_key", "uri", "medium", "specs"})
_DELETE = frozenset({"block_key", "medium", "spec_names"})
_SNAPSHOT = frozenset({"medium", "blocks"})
_SNAPSHOT_ITEM = frozenset({"block_key", "medium", "specs"})
_HEARTBEAT = frozenset({"system_status"})
_LOCATION_SPEC = frozenset({"name", "uri"})
_MAX_MEDIUM = 32  # kvcm's bound on a medium name

#: A block an event adds or removes: ``(kind, medium, key)``, kind ``add`` or ``remove``.
Block = tuple[str, str, int]


class ReportedEvent:
    """One Tair event item read: its kvcm op and, for blocks, ``(kind, medium, key)`` with kind
    ``add`` or ``remove``."""

    __slots__ = ("blocks", "name", "op")

    def __init__(self, name: str, op: str, blocks: list[Block]) -> None:
        self.name, self.op, self.blocks = name, op, blocks


def event_in(value: Decoded, where: str) -> ReportedEvent:
    """A Tair ``EventItem``: its type is required and its parameters, if given, are those of its
    type (the oneof member named after it); each block needs its key and a medium."""
    item = message(value, where, _ITEM)
    name = REPORT_EVENT_TYPE.parse(item.get("event_type"), path(where, "event_type"))
    op = REPORT_EVENT_TYPE.to_kvcm(name, path(where, "event_type"))
    if op is None:
        raise InvalidArgument(f"{where}.event_type: required (one of {', '.join(_PARAMS)})")
    member = _PARAMS[name]
    for other in _PARAMS.values():
        if other != member and item.get(other) is not None:
            raise InvalidArgument(f"{path(where, other)}: not the parameters of {name} (give {member})")
    return ReportedEvent(name, op, _params(name, item.get(member), path(where, member)))


def _params(name: str, params: Decoded, at: str) -> list[Block]:
    """The blocks of an event's parameters, once they are checked."""
    if name == "EVENT_NODE_REGISTER":
        texts(message(params, at, _REGISTER).get("mediums"), path(at, "mediums"))  # kvcm's blocks name theirs
    elif name == "EVENT_HEARTBEAT":
        _status_map(message(params, at, _HEARTBEAT).get("system_status"), path(at, "system_status"))
    elif name == "EVENT_HOST_DOWN":
        message(params, at, frozenset())
    elif name == "EVENT_BLOCK_ADD":
        add = _required(params, at, _ADD)
        text(add.get("uri"), path(at, "uri"))
        _specs(add.get("specs"), path(at, "specs"))
        return [("add", _medium(add.get("medium"), path(at, "medium")),
                 _block_key(add.get("block_key"), path(at, "block_key")))]
    elif name == "EVENT_BLOCK_DELETE":
        delete = _required(params, at, _DELETE)
        texts(delete.get("spec_names"), path(at, "spec_names"))  # kvcm drops the block, whatever the specs
        return [("remove", _medium(delete.get("medium"), path(at, "medium")),
                 _block_key(delete.get("block_key"), path(at, "block_key")))]
    else:
        return _snapshot(_required(params, at, _SNAPSHOT), at)
    return []


def _snapshot(snapshot: DecodedMap, where: str) -> list[Block]:
    """The snapshot's blocks; a key twice on one medium is refused (the same key on two is two
    holdings). The deprecated snapshot-wide ``medium`` is the medium of blocks that name none."""
    legacy = text(snapshot.get("medium"), path(where, "medium"))
    out: list[Block] = []
    seen: set[tuple[str, int]] = set()
    for i, raw in enumerate(messages(snapshot.get("blocks"), path(where, "blocks"))):
        at = f"{where}.blocks[{i}]"
        block = message(raw, at, _SNAPSHOT_ITEM)
        _specs(block.get("specs"), path(at, "specs"))
        medium = _medium(block.get("medium") or legacy, path(at, "medium"))
        key = _block_key(block.get("block_key"), path(at, "block_key"))
        if (medium.upper(), key) in seen:
            raise InvalidArgument(f"{at}.block_key: {key} is listed twice on medium {medium!r}")
        seen.add((medium.upper(), key))
        out.append(("add", medium, key))
    return out


def _required(value: Decoded, where: str, names: frozenset[str]) -> DecodedMap:
    if value is None:
        raise InvalidArgument(f"{where}: required by its event_type")
    return message(value, where, names)


def _block_key(value: Decoded, where: str) -> int:
    """A block key: Tair's proto spells it an int64 in a string; a JSON number is taken too."""
    if value is None or value == "":
        raise InvalidArgument(f"{where}: required (an int64 as a decimal string)")
    return int64(value, where)


def _medium(value: Decoded, where: str) -> str:
    medium = text(value, where)
    if not medium:
        raise InvalidArgument(f"{where}: required (the cache tier holding the block: gpu, hbm, mem, disk...)")
    if len(medium) > _MAX_MEDIUM:
        raise InvalidArgument(f"{where}: longer than {_MAX_MEDIUM} characters")
    return medium


def _specs(value: Decoded, where: str) -> None:
    """The block's LocationSpecs, checked and not kept: kvcm counts the blocks a host holds and
    hands out no engine-side URIs."""
    for i, raw in enumerate(messages(value, where)):
        spec = message(raw, f"{where}[{i}]", _LOCATION_SPEC)
        text(spec.get("name"), f"{where}[{i}].name")
        text(spec.get("uri"), f"{where}[{i}].uri")


def _status_map(value: Decoded, where: str) -> None:
    """``map<string, string>``: opaque observability data, checked and not kept (Tair keeps none either)."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where}: expected an object of strings, got {show(value)}")
    for key, item in value.items():
        text(item, f"{where}.{key[:100]}")
