"""``/api`` request bodies, read strictly: a JSON object with no key twice, finite numbers,
integers within 64 bits and nesting of at most 32 levels; a refusal names the path of what it
refuses (:func:`parse_body`)."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from kvcm.errors import InvalidArgument
from kvcm.proto.wire import Decoded, DecodedMap

# -- request bodies -------------------------------------------------------------------------------

_MAX_DEPTH = 32
_INT_MIN, _INT_END = -(1 << 63), 1 << 64  # what msgpack, and so the RPC front door, can carry
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")  # a member name an error message shows as it is
_MAX_PATH = 200


class NotJson(InvalidArgument):
    """A body that is not a JSON object at all (Tair's server answers it 400 and ``{}``)."""


class _DuplicateKey(Exception):
    """Raised out of the parser at an object with a key twice (its path is found afterwards)."""


class _Members(list[tuple[str, object]]):
    """An object's members in order, a repeated key kept: only to name where it repeats."""


def parse_body(raw: bytes) -> DecodedMap:
    """A request body: a JSON object whose keys are unique in every object (the last of two would
    win silently), nested at most 32 levels, with integers in int64/uint64 and only finite
    numbers (Python's parser takes NaN, Infinity and 1e400). Every refusal is INVALID_ARGUMENT
    naming the path of what it refuses; :class:`NotJson` when the body is no JSON object at all."""
    try:
        body = json.loads(raw or b"{}", object_pairs_hook=_unique)
    except _DuplicateKey:
        raise InvalidArgument(f"{_repeated_key(raw)}: given twice in one JSON object") from None
    except (ValueError, RecursionError) as exc:
        raise NotJson(f"body is not JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(body, dict):
        raise NotJson("body must be a JSON object")
    if not _plain(body):
        raise InvalidArgument(_fault(body))
    return body


def _unique(members: list[tuple[str, Decoded]]) -> DecodedMap:
    # The parser's hook for every object: building the dict here costs ~20% of the parse, and a
    # length check finds a repeated key.
    obj = dict(members)
    if len(obj) != len(members):
        raise _DuplicateKey
    return obj


def _plain(body: DecodedMap) -> bool:
    """True when nothing in ``body`` is refused; :func:`_fault` says where, when it is not. A pass
    over whole levels checking exact types: the hot path, several times faster than walking values
    one by one with their depth (a 52,000-event report is a few hundred thousand values)."""
    level: list[Any] = [body]
    for _ in range(_MAX_DEPTH - 1):  # the values of containers at depths 1..31 (depths 2..32)
        nested: list[Any] = []
        for container in level:
            for value in container.values() if type(container) is dict else container:
                kind = type(value)
                if kind is str:
                    continue
                if kind is dict or kind is list:
                    nested.append(value)
                elif kind is int:
                    if not _INT_MIN <= value < _INT_END:
                        return False
                elif kind is float and not math.isfinite(value):
                    return False
        if not nested:
            return True
        level = nested
    return not any(level)  # a value inside a container at depth 32 would be at depth 33


def _fault(body: DecodedMap) -> str:
    """The first refused value of ``body`` in document order, named by its path (the slow walk,
    run only once :func:`_plain` has found something)."""
    stack: list[tuple[Decoded, str, int]] = [(body, "", 1)]
    while stack:
        value, where, depth = stack.pop()
        at = where[:_MAX_PATH] or "body"
        if depth > _MAX_DEPTH:
            return f"{at}: nests deeper than {_MAX_DEPTH} levels"
        if type(value) is int and not _INT_MIN <= value < _INT_END:
            return f"{at}: integer {str(value)[:40]} does not fit in 64 bits"
        if type(value) is float and not math.isfinite(value):
            return f"{at}: {value} is not a finite number"
        if type(value) is dict:
            stack.extend((v, _member(where, k), depth + 1) for k, v in reversed(value.items()))
        elif type(value) is list:
            stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in reversed(list(enumerate(value))))
    return "body: refused"


def _repeated_key(raw: bytes) -> str:
    """The path of the first key that repeats within one object (parsed again keeping every member)."""
    stack: list[tuple[object, str]] = [(json.loads(raw, object_pairs_hook=_Members), "")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, _Members):
            seen: set[str] = set()
            for key, _ in value:
                if key in seen:
                    return _member(where, key)[:_MAX_PATH]
                seen.add(key)
            stack.extend((v, _member(where, k)) for k, v in reversed(value))
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{i}]") for i, v in reversed(list(enumerate(value))))
    return "body"


def _member(where: str, key: str) -> str:
    """``where.key``; a key that is not a plain name is not echoed (the reply is no place for it)."""
    name = key if _KEY.fullmatch(key) else "<key>"
    return f"{where}.{name}" if where else name


def jsonable(value: object) -> str:
    if isinstance(value, bytes):
        return value.hex()
    raise TypeError(f"cannot encode {type(value).__name__}")
