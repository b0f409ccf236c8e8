"""MessagePack-RPC envelopes (https://github.com/msgpack-rpc/msgpack-rpc/blob/master/spec.md).

* request      ``[0, msgid, method, params]`` — kvcm methods take one map: ``params = [{...}]``
  (``[]`` means an empty map);
* response     ``[1, msgid, error, result]`` — ``error`` is nil or ``{"code", "name", "message"}``;
* notification ``[2, method, params]`` — never answered.

Decoding is defensive: untrusted bytes never raise anything but :class:`BadEnvelope`, ext types
are refused, and container sizes are capped by the message size (msgpack's own rule) and by
``max_items``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import msgpack
import msgspec

#: What :func:`unpack` can hand back: msgpack's types with maps keyed by strings (the decoders
#: run with ``strict_map_key``; kvcm's maps are keyed by field names). Read it by narrowing
#: (``isinstance``) or by converting it into a Struct; it never needs ``Any``.
Decoded: TypeAlias = "bool | int | float | str | bytes | list[Decoded] | dict[str, Decoded] | None"
#: What a reply or request may be built from: the same values, in read-only (covariant) containers,
#: so a ``list[int]`` or a ``dict[str, str]`` is accepted as it is.
Encodable: TypeAlias = "bool | int | float | str | bytes | Sequence[Encodable] | Mapping[str, Encodable] | None"
#: A decoded map (a request's params, a reply's result map).
DecodedMap: TypeAlias = dict[str, Decoded]
#: A map a reply or request is built from.
EncodableMap: TypeAlias = Mapping[str, Encodable]

REQUEST, RESPONSE, NOTIFICATION = 0, 1, 2
MAX_MSGID = 2**32 - 1


class BadEnvelope(ValueError):
    """The payload is not a valid msgpack-RPC message. ``msgid`` is set when it could be read."""

    def __init__(self, message: str, msgid: int | None = None) -> None:
        super().__init__(message)
        self.msgid = msgid


@dataclass(frozen=True)
class Raw:
    """A result that is already msgpack bytes: spliced into the reply without repacking."""

    data: bytes


@dataclass(frozen=True)
class Request:
    msgid: int | None  # None for a notification
    method: str
    params: dict[str, Any]


def refuse_ext(code: int, data: bytes | memoryview) -> Any:
    """Ext hook for msgpack and msgspec decoders of untrusted bytes: kvcm accepts no ext types."""
    raise ValueError(f"msgpack ext type {code} is not accepted")


def unpack(payload: bytes, max_items: int = 1 << 20) -> Any:
    """Decode untrusted msgpack; any failure becomes :class:`BadEnvelope`."""
    try:
        return msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=True,
            ext_hook=refuse_ext,
            max_array_len=max_items,
            max_map_len=max_items,
        )
    except msgpack.StackError:
        raise BadEnvelope("payload is nested too deeply") from None
    except Exception as exc:  # noqa: BLE001 - msgpack raises ValueError, TypeError, ...
        raise BadEnvelope(f"payload is not valid msgpack: {type(exc).__name__}: {exc}") from None


def parse_request(payload: bytes, max_items: int = 1 << 20) -> Request:
    """Validate a request or notification envelope."""
    obj = unpack(payload, max_items)
    if not isinstance(obj, list) or not obj:
        raise BadEnvelope("message must be a msgpack-RPC array")
    kind = obj[0]
    if kind == REQUEST and len(obj) == 4:
        msgid, method, params = obj[1], obj[2], obj[3]
        if isinstance(msgid, bool) or not isinstance(msgid, int) or not 0 <= msgid <= MAX_MSGID:
            raise BadEnvelope("msgid must be an unsigned 32-bit integer")
    elif kind == NOTIFICATION and len(obj) == 3:
        msgid, method, params = None, obj[1], obj[2]
    else:
        raise BadEnvelope("expected [0, msgid, method, params] or [2, method, params]")
    if not isinstance(method, str) or not method:
        raise BadEnvelope("method must be a non-empty string", msgid)
    return Request(msgid, method, _params_map(params, msgid))


def _params_map(params: Any, msgid: int | None) -> dict[str, Any]:
    if isinstance(params, dict):  # lenient: a bare map instead of [map]
        return params
    if not isinstance(params, list) or len(params) > 1:
        raise BadEnvelope("params must be [] or [ {map} ]", msgid)
    if not params:
        return {}
    if not isinstance(params[0], dict):
        raise BadEnvelope("params must be [] or [ {map} ]", msgid)
    return params[0]


# Typed as bytes-returning: msgpack ships no type stubs.
_packer: Any = msgpack.Packer(use_bin_type=True)


def _pack(obj: Any) -> bytes:
    return bytes(_packer.pack(obj))


#: Requests are packed by msgspec: the same bytes as msgpack's packer (bin type on, smallest
#: int forms) in about a quarter of the time, which is most of a client's cost of sending a
#: long prompt's keys (20,000 keys: 0.16 ms instead of 0.6). An int beyond 64 bits is still an
#: OverflowError and an object it cannot pack a TypeError.
_request_encoder = msgspec.msgpack.Encoder()


def pack_request(msgid: int, method: str, params: dict[str, Any]) -> bytes:
    return _request_encoder.encode((REQUEST, msgid, method, (params,)))


def pack_notification(method: str, params: dict[str, Any]) -> bytes:
    return _request_encoder.encode((NOTIFICATION, method, (params,)))


_RESPONSE_HEAD = bytes(_packer.pack_array_header(4)) + _pack(RESPONSE)
_NIL = _pack(None)


def pack_response(msgid: int, error: dict[str, Any] | None, result: Any) -> bytes:
    """A response; a :class:`Raw` result is spliced in as-is (one copy of it, however large)."""
    if isinstance(result, Raw):
        err = _NIL if error is None else _packer.pack(error)
        return b"".join((_RESPONSE_HEAD, _packer.pack(msgid), err, result.data))
    return _pack([RESPONSE, msgid, error, result])


#: Responses are decoded by msgspec: about a third of msgpack's time for a reply of many small
#: maps (``match_engines``' 100 sources: 0.11 ms instead of 0.33), the same values (bin as
#: bytes, ext types refused).
_response_decoder = msgspec.msgpack.Decoder(ext_hook=refuse_ext)


def parse_response(payload: bytes) -> tuple[int, Any, Any]:
    """``(msgid, error, result)`` of a response; :class:`BadEnvelope` if malformed."""
    try:
        obj = _response_decoder.decode(payload)
    except RecursionError:
        raise BadEnvelope("payload is nested too deeply") from None
    except Exception as exc:  # noqa: BLE001 - msgspec raises DecodeError, ValueError, ...
        raise BadEnvelope(f"payload is not valid msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(obj, list) or len(obj) != 4 or obj[0] != RESPONSE or not isinstance(obj[1], int):
        raise BadEnvelope("expected [1, msgid, error, result]")
    return obj[1], obj[2], obj[3]


def pack(obj: Any) -> bytes:
    """Pack one value the way kvcm does everywhere (bin type on)."""
    return _pack(obj)


def pack_map_raw(items: dict[str, Any | Raw]) -> Raw:
    """A map result whose values may be :class:`Raw`, spliced without repacking."""
    parts = [_packer.pack_map_header(len(items))]
    for key, value in items.items():
        parts.append(_packer.pack(key))
        parts.append(value.data if isinstance(value, Raw) else _packer.pack(value))
    return Raw(b"".join(parts))


def pack_array_raw(items: list[bytes]) -> Raw:
    """An array of already packed values."""
    return Raw(_packer.pack_array_header(len(items)) + b"".join(items))


#: The routing id prefix of the sockets kvcm's HTTP side port forwards through: one such socket
#: carries many callers' requests, so a refusal one of them earned is never applied to the socket.
RELAY_ID_PREFIX = b"kvcm-relay/"


def split_request(payload: bytes) -> tuple[int, str, memoryview] | None:
    """``(msgid, method, params bytes)`` of ``[0, msgid, method, params]`` read from its first
    bytes, or None for any other shape (the full parser then explains). The params are left
    undecoded so that the method's own decoder meets them first: a schema that caps a list by
    its header refuses a multi-megabyte request without anything walking past that header."""
    view = memoryview(payload)
    if len(view) < 4 or view[0] != 0x94 or view[1] != REQUEST:
        return None
    msgid, at = _uint(view, 2)
    if msgid is None or msgid > MAX_MSGID:
        return None
    method, at = _str(view, at)
    if method is None or at >= len(view):
        return None
    return msgid, method, view[at:]


def _uint(view: memoryview, at: int) -> tuple[int | None, int]:
    """A msgpack unsigned int at ``at`` (positive fixint, uint 8/16/32) and the offset after it."""
    if at >= len(view):
        return None, at
    head = view[at]
    if head <= 0x7F:
        return head, at + 1
    width = {0xCC: 1, 0xCD: 2, 0xCE: 4}.get(head)
    if width is None or at + 1 + width > len(view):
        return None, at
    return int.from_bytes(view[at + 1:at + 1 + width], "big"), at + 1 + width


def _str(view: memoryview, at: int) -> tuple[str | None, int]:
    """A msgpack str of at most 255 bytes at ``at`` (fixstr, str 8) and the offset after it."""
    if at >= len(view):
        return None, at
    head = view[at]
    if 0xA0 <= head <= 0xBF:
        size, start = head - 0xA0, at + 1
    elif head == 0xD9 and at + 1 < len(view):
        size, start = view[at + 1], at + 2
    else:
        return None, at
    if start + size > len(view):
        return None, at
    try:
        return bytes(view[start:start + size]).decode(), start + size
    except UnicodeDecodeError:
        return None, at


def peek_msgid(payload: bytes) -> int:
    """Best-effort msgid of a request that will not (or could not) be decoded in full: 0 when
    unreadable, so that a REQ client still gets a reply."""
    try:
        unpacker = msgpack.Unpacker(max_buffer_size=64)
        unpacker.feed(payload[:32])
        unpacker.read_array_header()
        unpacker.unpack()
        msgid = unpacker.unpack()
    except Exception:  # noqa: BLE001 - truly unreadable: answer under msgid 0
        return 0
    ok = isinstance(msgid, int) and not isinstance(msgid, bool) and 0 <= msgid <= MAX_MSGID
    return msgid if ok else 0
