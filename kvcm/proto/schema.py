"""What every request schema shares, and the one place validation errors are worded.

Every RPC's request is a ``msgspec.Struct`` deriving from :class:`RequestBase`, and every Struct
nested in one refuses unknown fields too: a misspelled field must fail the request, never fall
back to a default (a ``block_mask`` typo read as "no mask" deletes every key).

:func:`describe` turns msgspec's error (``Object contains unknown field `ofset` - at
`$.block_mask```) into one naming the dotted field path, with a "did you mean" for near-misses
(matched against the field names of the Struct at that path, found by walking the schema) and,
for fields of Tair KVCM's layout that kvcm spells differently or lacks, a pointer to kvcm's own
field. :func:`check_partial` applies the same rule to partial maps (``update_instance_group``),
which are merged before they are converted.
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Iterable
from typing import Annotated, Literal

import msgspec
import msgspec.inspect as mi

from kvcm.errors import InvalidArgument

__all__ = ["KEYS_CEILING", "LIMITED_FIELDS", "TOKENS_CEILING", "Credentials", "Flags", "Int64", "Keys", "RequestBase", "Tokens",
           "check_partial", "describe", "invalid", "suggest"]

#: Hard ceilings of list lengths in requests. msgspec checks ``max_length`` from a list's header,
#: before a single element is decoded: a 4 MiB frame holds 4 M one-byte integers, about 200 ms to
#: decode only to be refused. ``server.max_keys`` / ``server.max_tokens`` are the limits in force
#: (at most these); the ceilings only keep an over-long list from being decoded at all.
KEYS_CEILING = 1 << 17
TOKENS_CEILING = 1 << 19

#: The request fields whose length the server's limits cap before any handler runs, and the
#: limit (a field of :class:`kvcm.rpc.dispatch.Limits`, ``server.<limit>`` in the config) of each.
LIMITED_FIELDS: dict[str, Literal["max_keys", "max_tokens"]] = {
    "block_keys": "max_keys", "bool_masks": "max_keys", "success_blocks": "max_keys", "token_ids": "max_tokens",
}

Int64 = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
#: Block keys of a request, and the per-block flags of a mask.
Keys = Annotated[list[Int64], msgspec.Meta(max_length=KEYS_CEILING)]
Flags = Annotated[list[bool], msgspec.Meta(max_length=KEYS_CEILING)]
#: Token ids of a prompt.
Tokens = Annotated[list[Int64], msgspec.Meta(max_length=TOKENS_CEILING)]


class Credentials(msgspec.Struct, forbid_unknown_fields=True):
    """``"auth"`` of a request: a user and password, or a token."""

    user: str | None = None
    password: str | None = None
    token: str | None = None
    #: The end client a relay sends this request for (the HTTP side port puts the remote
    #: address here). It only splits the sender's login rate-limit bucket, so the users of one
    #: relay are limited apart; it grants nothing.
    client: Annotated[str, msgspec.Meta(max_length=64)] | None = None


class RequestBase(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields every request may carry; the dispatcher consumes ``auth`` before any handler."""

    trace_id: str = ""
    auth: Credentials | None = None


#: Longest piece of user input (a field name) quoted back in a message.
MAX_QUOTE = 100
_MAX_MESSAGE = 400

_AT = re.compile(r"(?P<text>.*) - at `(?P<path>\$[^`]*)`", re.S)
_UNKNOWN = re.compile(r"Object contains unknown field `(?P<name>.*)`", re.S)
_STEP = re.compile(r"\.([^.\[\]`]+)|\[(\d+|\.\.\.)\]")
_PLAIN = re.compile(r"[A-Za-z0-9_.-]{1,100}")

# Fields of Tair KVCM's records that kvcm lays out differently or does not have, by the kvcm
# Struct they were sent in. ``{at}`` is the path of that Struct (with a trailing dot).
_TAIR_REPLACES = "no per-group setting in kvcm: "
_FOREIGN: dict[str, dict[str, str]] = {
    "InstanceGroup": {
        "cache_config": (
            "Tair's layout; kvcm's is {at}reclaim_strategy, with trigger_strategy.used_percentage as "
            "{at}reclaim_strategy.used_percentage (used_size as {at}reclaim_strategy.used_bytes) and "
            "meta_indexer_config.max_key_count as {at}max_block_count; data_storage_strategy has no kvcm setting"
        ),
        "data_storage_strategy": _TAIR_REPLACES + "writes go to the first usable storage of {at}storage_candidates",
        "cache_prefer_strategy": _TAIR_REPLACES + "writes go to the first usable storage of {at}storage_candidates",
        "meta_indexer_config": "Tair's layout; kvcm's bound on indexed blocks is {at}max_block_count "
        "(the metadata lives in the server's store, the store.* settings)",
        "extra_info": "not a kvcm field; opaque text goes in {at}user_data",
    },
    "ReclaimStrategy": {
        "trigger_strategy": (
            "Tair's layout; kvcm's is {at}used_percentage, with trigger_strategy.used_size as {at}used_bytes"
        ),
        "used_size": "kvcm's name is {at}used_bytes (the watermark in bytes)",
        "max_key_count": "kvcm's is instance_group.max_block_count",
        "trigger_period_seconds": _TAIR_REPLACES + "the reclaimer runs every reclaim.interval_s (server setting)",
        "reclaim_step_size": _TAIR_REPLACES + "a round stops below the watermark minus reclaim.hysteresis, "
        "at most reclaim.max_victims_per_round blocks (server settings)",
        "reclaim_step_percentage": _TAIR_REPLACES + "a round stops below the watermark minus reclaim.hysteresis "
        "(server setting)",
        "storage_unique_name": _TAIR_REPLACES + "a group's strategy covers all its storages",
    },
    "Storage": {
        **{
            spec: "Tair's per-type spec; kvcm takes {at}storage_type and the spec's fields in {at}storage_spec"
            for spec in ("local", "threefs", "mooncake", "tair_mem_pool", "nfs", "vcnsthreefs", "dummy", "vineyard")
        },
        "check_storage_available_when_open": "no kvcm setting: every storage is probed in the background "
        "(cache.storage_health_interval_s)",
    },
}


def invalid(method: str, kind: type, exc: msgspec.ValidationError) -> InvalidArgument:
    """The INVALID_ARGUMENT for ``exc``, raised decoding a request of ``method`` into ``kind``."""
    return InvalidArgument(f"{method}: {describe(kind, exc)}")


def describe(kind: type, exc: msgspec.ValidationError, where: str = "") -> str:
    """``exc`` in words, its field path dotted and put under ``where`` (e.g. ``config_snapshot``)."""
    text, steps = _split(str(exc), kind)
    path = _dotted(where, steps)
    unknown = _UNKNOWN.fullmatch(text)
    if unknown is not None:
        parent = _walk(_info(kind), steps)
        return unknown_field(_structs(parent) if parent is not None else [], path, unknown["name"])
    message = f"{text} - at `{path}`" if path else text
    return message if len(message) <= _MAX_MESSAGE else message[:_MAX_MESSAGE] + "..."


def unknown_field(structs: Iterable[mi.StructType], parent: str, name: str) -> str:
    """``unknown field <path>`` with a Tair pointer or a "did you mean" when there is one."""
    structs = list(structs)
    at = parent + "." if parent else ""
    message = f"unknown field {at}{_quote(name)}"
    for struct in structs:
        foreign = _FOREIGN.get(struct.cls.__name__, {}).get(name)
        if foreign is not None:
            return f"{message} ({foreign.format(at=at)})"
    names = [f.encode_name for s in structs for f in s.fields]
    guess = suggest(name, names)
    if guess is not None:
        return f"{message} (did you mean {at}{guess}?)"
    return message


def suggest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate ``name`` most likely meant (closest spelling, case aside), or None."""
    if len(name) > MAX_QUOTE:
        return None  # not a typo, and difflib is quadratic
    close = difflib.get_close_matches(name.lower(), list(candidates), n=1, cutoff=0.7)
    return close[0] if close else None


def check_partial(data: object, kind: type, where: str) -> None:
    """Refuse any key of the partial map ``data``, at any depth, that is not a field of ``kind``
    (nested Structs, lists of them and maps of them are followed); values are left to the full
    conversion that follows the merge. Raises InvalidArgument naming the path under ``where``."""
    _check_value(data, _info(kind), where)


# -- helpers -------------------------------------------------------------------------------------


@functools.cache
def _info(kind: type) -> mi.Type:
    return mi.type_info(kind)


def _split(message: str, kind: type) -> tuple[str, list[tuple[str, str]]]:
    """msgspec's message without its path, and the path's steps (``("field", name)`` /
    ``("index", "3" or "...")``). A path that the schema cannot follow (a field name that
    itself contains ``- at `$...```) is left in the text."""
    found = _AT.fullmatch(message)
    if found is None:
        return message, []
    steps = _steps(found["path"][1:])
    if steps is None or _walk(_info(kind), steps) is None:
        return message, []
    return found["text"], steps


def _steps(path: str) -> list[tuple[str, str]] | None:
    steps: list[tuple[str, str]] = []
    pos = 0
    while pos < len(path):
        step = _STEP.match(path, pos)
        if step is None:
            return None
        steps.append(("field", step[1]) if step[1] is not None else ("index", step[2]))
        pos = step.end()
    return steps


def _dotted(where: str, steps: list[tuple[str, str]]) -> str:
    out = where
    for kind, value in steps:
        out = f"{out}[{value}]" if kind == "index" else f"{out}.{value}" if out else value
    return out


def _alternatives(info: mi.Type) -> list[mi.Type]:
    """The types a value of ``info`` may be (a union's members, Optional's None included)."""
    while isinstance(info, mi.Metadata):
        info = info.type
    if isinstance(info, mi.UnionType):
        return [t for member in info.types for t in _alternatives(member)]
    return [info]


def _structs(info: mi.Type) -> list[mi.StructType]:
    return [t for t in _alternatives(info) if isinstance(t, mi.StructType)]


def _walk(info: mi.Type, steps: list[tuple[str, str]]) -> mi.Type | None:
    current: mi.Type | None = info
    for kind, value in steps:
        if current is None:
            return None
        current = _field_type(current, value) if kind == "field" else _item_type(current, value)
    return current


def _field_type(info: mi.Type, name: str) -> mi.Type | None:
    for struct in _structs(info):
        for field in struct.fields:
            if field.encode_name == name:
                return field.type
    return None


def _item_type(info: mi.Type, index: str) -> mi.Type | None:
    for t in _alternatives(info):
        if index == "..." and isinstance(t, mi.DictType):
            return t.value_type
        if index != "..." and isinstance(t, (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
            return t.item_type
        if index != "..." and isinstance(t, mi.TupleType) and int(index) < len(t.item_types):
            return t.item_types[int(index)]
    return None


def _check_value(value: object, info: mi.Type, path: str) -> None:
    if isinstance(value, dict):
        structs = _structs(info)
        if structs:
            _check_map(value, structs, path)
            return
        inner = _item_type(info, "...")
        if inner is not None and _structs(inner):
            for item in value.values():
                _check_value(item, inner, f"{path}[...]")
    elif isinstance(value, list):
        inner = _item_type(info, "0")
        if inner is not None and _structs(inner):
            for i, item in enumerate(value):
                _check_value(item, inner, f"{path}[{i}]")


def _check_map(data: dict[object, object], structs: list[mi.StructType], path: str) -> None:
    fields = {f.encode_name: f for s in structs for f in s.fields}
    for key, value in data.items():
        if not isinstance(key, str):
            raise InvalidArgument(f"{path}: field names must be strings, got {_quote(key)}")
        field = fields.get(key)
        if field is None:
            raise InvalidArgument(unknown_field(structs, path, key))
        _check_value(value, field.type, f"{path}.{key}" if path else key)


def _quote(value: object) -> str:
    """A piece of user input fit for a message: short, and plain or repr'd."""
    if isinstance(value, str) and _PLAIN.fullmatch(value):
        return value
    text = repr(value[: MAX_QUOTE + 1] if isinstance(value, (str, bytes)) else value)
    return text if len(text) <= MAX_QUOTE else text[:MAX_QUOTE] + "..."
