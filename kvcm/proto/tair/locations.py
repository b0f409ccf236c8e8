"""Tair's block masks and cache locations, both ways."""

from __future__ import annotations

from kvcm.errors import InvalidArgument
from kvcm.proto.tair.enums import STORAGE_TYPE
from kvcm.proto.tair.fields import int32, message, path, show
from kvcm.proto.wire import Decoded, DecodedMap, Encodable

_MASK = frozenset({"offset", "bool_masks"})
_BOOL_MASKS = frozenset({"values"})


def mask_in(value: Decoded, where: str) -> dict[str, Encodable] | None:
    """``{"offset": n}`` or ``{"bool_masks": {"values": [...]}}`` (a oneof); ``{}`` stays ``{}``,
    which kvcm reads as "mask nothing" and refuses where it would widen a delete."""
    if value is None:
        return None
    mask = message(value, where, _MASK)
    if "offset" in mask and "bool_masks" in mask:
        raise InvalidArgument(f"{where}: offset and bool_masks are a oneof; give one")
    if "offset" in mask:
        return {"offset": int32(mask["offset"], path(where, "offset"))}
    if "bool_masks" in mask:
        flags = message(mask["bool_masks"], path(where, "bool_masks"), _BOOL_MASKS).get("values")
        if flags is None:
            return {"bool_masks": []}
        if not isinstance(flags, list):
            raise InvalidArgument(f"{where}.bool_masks.values: expected a list of booleans, got {show(flags)}")
        return {"bool_masks": flags}
    return {}


def mask_out(mask: DecodedMap) -> dict[str, Encodable]:
    if "bool_masks" in mask:
        return {"bool_masks": {"values": mask["bool_masks"]}}
    return {"offset": mask.get("offset", 0)}


def locations_out(locations: list[DecodedMap]) -> list[DecodedMap]:
    """kvcm's locations (``{type, spec_size, location_specs}``, their URIs already Tair's:
    :mod:`kvcm.tair.uris`) in Tair's shape, changed in place: a forwarded reply is the call's
    own, and a lookup's reply has a location per key."""
    out = STORAGE_TYPE.out
    for loc in locations:
        loc["type"] = out(loc["type"])
    return locations
