"""Storage specs read strictly: every error names the field, unknown fields are refused, and
the result is the complete, normalized spec the registry stores."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeAlias, TypeVar

from kvcm.errors import InvalidArgument
from kvcm.proto.schema import suggest

#: One field of a normalized spec: plain builtins only.
SpecValue: TypeAlias = str | int | bool
#: A normalized storage spec: what ``read_spec`` returns and the registry stores.
Spec: TypeAlias = dict[str, SpecValue]

T = TypeVar("T", bound=SpecValue)


class SpecReader:
    """Reads one storage spec strictly: every error names the field, unknown fields are refused
    (a typo such as ``key_count_perfile`` must fail at add_storage, not silently use a default).

    It also records what it read, defaults filled in: :meth:`finish` returns that complete,
    normalized spec as plain builtins (the form the registry stores and ``list_storage`` shows).
    An unset optional text reads as ``None`` and is recorded as ``""`` (Tair's "unset"), so
    reading a normalized spec again gives the same spec."""

    def __init__(self, type_name: str, name: str, spec: Mapping[str, object] | None) -> None:
        if spec is not None and not isinstance(spec, Mapping):
            raise InvalidArgument(f"storage {name!r}: storage_spec must be a map, got {type(spec).__name__}")
        self._where = f"storage {name!r} ({type_name})"
        self._spec = dict(spec or {})
        self._seen: set[str] = set()
        self._values: Spec = {}

    def integer(self, key: str, default: int | None = None, minimum: int = 0) -> int:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._bad(key, f"must be an integer, got {value!r}")
        if value < minimum:
            raise self._bad(key, f"must be >= {minimum}, got {value}")
        return self._keep(key, value)

    def text(self, key: str, default: str | None = None) -> str:
        value = self._get(key, default)
        if not isinstance(value, str) or not value:
            raise self._bad(key, f"must be a non-empty string, got {value!r}")
        return self._keep(key, value)

    def optional_text(self, key: str) -> str | None:
        if self._spec.get(key) in (None, ""):
            self._seen.add(key)
            self._keep(key, "")
            return None
        return self.text(key)

    def boolean(self, key: str, default: bool) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise self._bad(key, f"must be true or false, got {value!r}")
        return self._keep(key, value)

    def fail(self, key: str, why: str) -> InvalidArgument:
        """An error naming ``storage_spec.<key>``, for checks beyond the type (raise it)."""
        return self._bad(key, why)

    def finish(self) -> Spec:
        """Refuse fields nobody read; return the normalized spec (every field read, in order)."""
        unknown = sorted(set(self._spec) - self._seen)
        if unknown:
            guess = suggest(unknown[0], sorted(self._seen))
            hint = f"did you mean storage_spec.{guess}? " if guess else ""
            raise self._bad(unknown[0], f"unknown field ({hint}valid: {', '.join(sorted(self._seen))})")
        return dict(self._values)

    def _get(self, key: str, default: object) -> object:
        self._seen.add(key)
        # None and "" both mean unset, as in Tair's protos (the registry stores "" defaults).
        if self._spec.get(key) not in (None, ""):
            return self._spec[key]
        if default is None:
            raise self._bad(key, "is required")
        return default

    def _keep(self, key: str, value: T) -> T:
        self._values[key] = value
        return value

    def _bad(self, key: str, why: str) -> InvalidArgument:
        return InvalidArgument(f"{self._where}: storage_spec.{key} {why}")


def check_component(where: str, value: str) -> str:
    """A single path component safe to join under a directory (no "/", "..", NUL)."""
    if not value or "/" in value or "\0" in value or value in (".", ".."):
        raise InvalidArgument(f"{where}: {value!r} is not a valid file name")
    return value


def spec_int(spec: Mapping[str, SpecValue], key: str) -> int:
    """Field ``key`` of a normalized spec, an integer (``read_spec`` checked it)."""
    value = spec[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"storage_spec.{key} is {value!r}, not an integer")
    return value


def spec_text(spec: Mapping[str, SpecValue], key: str) -> str:
    """Field ``key`` of a normalized spec, a string (``read_spec`` checked it)."""
    value = spec[key]
    if not isinstance(value, str):
        raise TypeError(f"storage_spec.{key} is {value!r}, not a string")
    return value


def spec_flag(spec: Mapping[str, SpecValue], key: str) -> bool:
    """Field ``key`` of a normalized spec, true or false (``read_spec`` checked it)."""
    value = spec[key]
    if not isinstance(value, bool):
        raise TypeError(f"storage_spec.{key} is {value!r}, not true or false")
    return value
