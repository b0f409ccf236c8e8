"""Checks a request passes before anything is done with it: the lengths the server's limits cap
(``server.max_keys`` / ``server.max_tokens``, :data:`kvcm.proto.schema.LIMITED_FIELDS`), and the
conversion of a params map into its method's Struct, with the one wording of their errors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from kvcm.errors import Code, InvalidArgument, KvcmError, error
from kvcm.proto import schema

if TYPE_CHECKING:
    from kvcm.rpc.methods import Limits, Method


class SizeCheck:
    """``max_keys`` / ``max_tokens`` of the requests' list fields (the schema's ceilings are
    checked by the decoder)."""

    def __init__(self, limits: Limits) -> None:
        self._limits = limits
        self._sized: dict[type, tuple[tuple[str, int], ...]] = {}  # request type -> its list fields under a limit

    def check(self, params: object) -> None:
        if isinstance(params, dict):  # a method without a Struct: its raw map
            for name, limit in self._limited(tuple(schema.LIMITED_FIELDS)):
                _check_size(name, params.get(name), limit)
            return
        # Every request passes here: the Struct type's limited fields are looked up once, and
        # only a list over its limit costs more than a length read.
        for name, limit in self._sized_fields(type(params)):
            value = getattr(params, name)
            if isinstance(value, list) and len(value) > limit:
                _check_size(name, value, limit)

    def _sized_fields(self, kind: type) -> tuple[tuple[str, int], ...]:
        fields = self._sized.get(kind)
        if fields is None:
            names = getattr(kind, "__struct_fields__", ())
            fields = self._sized[kind] = self._limited(tuple(n for n in schema.LIMITED_FIELDS if n in names))
        return fields

    def _limited(self, names: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
        """``(field, its length limit)`` of each name."""
        limits = self._limits
        return tuple((n, limits.max_tokens if schema.LIMITED_FIELDS[n] == "max_tokens" else limits.max_keys)
                     for n in names)


def _check_size(name: str, value: object, limit: int) -> None:
    if not isinstance(value, list) or len(value) <= limit:
        return
    raise error(Code.TOO_MANY_KEYS, f"{name} has {len(value)} entries; the limit is {limit} "
                                    f"(server.{schema.LIMITED_FIELDS[name]})")


class RequestDecoder:
    """Params maps into their method's Struct (strict), one converter per Struct type."""

    def __init__(self) -> None:
        self._decoders: dict[type, Callable[[object], object]] = {}

    def decode(self, method: Method, params: object) -> object:
        kind = method.request
        assert kind is not None  # internal: only Struct requests are decoded
        decode = self._decoders.get(kind)
        if decode is None:
            decode = self._decoders[kind] = _struct_decoder(kind)
        try:
            return decode(params)
        except msgspec.ValidationError as exc:
            raise schema_error(method, exc) from None


def _struct_decoder(kind: type) -> Callable[[object], object]:
    def decode(params: object) -> object:
        return msgspec.convert(params, kind, strict=True)

    return decode


def schema_error(method: Method, exc: msgspec.ValidationError) -> KvcmError:
    """The request's validation error; a list over the schema's ceiling is TOO_MANY_KEYS."""
    assert method.request is not None  # internal: only Struct requests are validated
    refused = schema.invalid(method.name, method.request, exc)
    if "Expected `array` of length <=" in str(exc):
        return error(Code.TOO_MANY_KEYS, refused.message)
    return refused


def decode_failure(exc: Exception) -> KvcmError:
    """A request that could not be decoded at all, as its own error."""
    if isinstance(exc, KvcmError):
        return exc
    if isinstance(exc, RecursionError):
        return InvalidArgument("request is nested too deeply")
    return InvalidArgument(f"request cannot be decoded: {type(exc).__name__}")
