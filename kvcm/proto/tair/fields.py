"""Tair's field values, read and printed: scalars, messages, lists, and kvcm's values read back.

Input follows proto3 JSON as Tair's server parses it: int64 (and int32) as a number or a decimal
string, ``null`` as unset, field names as the protos spell them (the lowerCamel JSON names are
accepted too). Output prints int64 as a decimal string. Every error is INVALID_ARGUMENT naming
the field path.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Iterable
from typing import TypeGuard

from kvcm.errors import InvalidArgument
from kvcm.proto.wire import Decoded, DecodedMap

_INT64 = range(-(1 << 63), 1 << 63)
_INT32 = range(-(1 << 31), 1 << 31)
DECIMAL = re.compile(r"-?[0-9]{1,20}")
CAMEL = re.compile(r"(?<=[a-z0-9])([A-Z])")


def path(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


# -- scalars --------------------------------------------------------------------------------------


def _integer(value: Decoded, where: str, bounds: range, kind: str) -> int:
    if value is None:
        return 0
    number: Decoded = value
    if isinstance(value, str) and DECIMAL.fullmatch(value):
        number = int(value)
    if type(number) is float and number.is_integer():  # proto3 JSON allows 1.0 for an integer
        number = int(number)
    if type(number) is not int:
        raise InvalidArgument(f"{where}: expected {kind} (a number or a decimal string), got {show(number)}")
    if number not in bounds:
        raise InvalidArgument(f"{where}: {number} does not fit in {kind}")
    return number


def int64(value: Decoded, where: str) -> int:
    return _integer(value, where, _INT64, "int64")


def int32(value: Decoded, where: str) -> int:
    return _integer(value, where, _INT32, "int32")


def _plain_ints(values: list[Decoded]) -> TypeGuard[list[int]]:
    return all(type(v) is int for v in values)


def int64_list(value: Decoded, where: str) -> list[int]:
    """A repeated int64. Lists of plain numbers (what clients send) are returned as they are:
    kvcm's own schema checks their range."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidArgument(f"{where}: expected a list of int64, got {show(value)}")
    if _plain_ints(value):
        return value
    return [int64(element(v, f"{where}[{i}]"), f"{where}[{i}]") for i, v in enumerate(value)]


def element(value: Decoded, where: str) -> Decoded:
    """An element of a repeated field: ``null`` there is no unset value, and never 0 or ""."""
    if value is None:
        raise InvalidArgument(f"{where}: null in a list (a repeated field has no unset elements)")
    return value


def text(value: Decoded, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InvalidArgument(f"{where}: expected a string, got {show(value)}")
    return value


def texts(value: Decoded, where: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidArgument(f"{where}: expected a list of strings, got {show(value)}")
    return [text(element(v, f"{where}[{i}]"), f"{where}[{i}]") for i, v in enumerate(value)]


def boolean(value: Decoded, where: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidArgument(f"{where}: expected true or false, got {show(value)}")
    return value


def double(value: Decoded, where: str) -> float:
    if value is None:
        return 0.0
    number: Decoded = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            pass
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        raise InvalidArgument(f"{where}: expected a number, got {show(number)}")
    if isinstance(number, float) and not math.isfinite(number):  # "NaN", "inf": float() takes them
        raise InvalidArgument(f"{where}: {number} is not a finite number")
    return float(number)


def out64(value: Decoded) -> str:
    """An int64 as Tair prints it: a decimal string."""
    if isinstance(value, (list, dict)):
        raise TypeError(f"an int64 cannot be a {type(value).__name__}")
    return str(int(value or 0))


def show(value: object) -> str:
    return json.dumps(value, default=str)[:60]


# -- messages -------------------------------------------------------------------------------------


def message(value: Decoded, where: str, names: frozenset[str]) -> DecodedMap:
    """A message: an object whose keys are fields of the proto (lowerCamel JSON names too).
    Returns it with snake_case keys; an unknown key is INVALID_ARGUMENT naming its path."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where or 'body'}: expected an object, got {show(value)}")
    if value.keys() <= names:  # the usual case: nothing to rename
        return value
    out: DecodedMap = {}
    for key, item in value.items():
        name = key if key in names else CAMEL.sub(r"_\1", key).lower()
        if name not in names:
            raise unknown(where, key, names)
        if name in out:
            raise InvalidArgument(f"{path(where, name)}: given twice (as {name} and as its JSON name)")
        out[name] = item
    return out


def unknown(where: str, key: str, names: Iterable[str]) -> InvalidArgument:
    close = difflib.get_close_matches(key, list(names), n=1)
    hint = f" (did you mean {path(where, close[0])}?)" if close else ""
    return InvalidArgument(f"unknown field {path(where, key[:100])}{hint}")


def messages(value: Decoded, where: str) -> list[Decoded]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidArgument(f"{where}: expected a list, got {show(value)}")
    for i, item in enumerate(value):
        element(item, f"{where}[{i}]")
    return value


# -- kvcm's values, read back ---------------------------------------------------------------------
# A kvcm reply has kvcm's shapes (its schema made them): anything else is kvcm's own fault, a
# TypeError, as subscripting it would have raised.


def as_map(value: Decoded) -> DecodedMap:
    if not isinstance(value, dict):
        raise TypeError(f"expected a map, got {type(value).__name__}")
    return value


def as_list(value: Decoded) -> list[Decoded]:
    if not isinstance(value, list):
        raise TypeError(f"expected a list, got {type(value).__name__}")
    return value


def as_maps(value: Decoded) -> list[DecodedMap]:
    return [as_map(item) for item in as_list(value)]


def as_str(value: Decoded) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value
