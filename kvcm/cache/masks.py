"""Block masks (Tair ``BlockMask``): which keys of a data-plane request a client skips or wrote.

A mask is ``{"offset": n}``, ``{"bool_masks": [..]}`` or absent (= mask nothing); a present mask
that sets neither (``{}``) reads as absent, except on a deletion, where it is refused: there a
malformed mask must never widen to "every key". On reads,
``masked(i)`` means "the client already has block i, skip it": ``i < offset``, or
``bool_masks[i]`` (indices past the vector are not masked). In ``finish_write_cache`` the same
shape means the opposite, "block i was written": there the mask must cover the session's
blocks exactly (``offset <= n``, ``len(bool_masks) == n``).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from kvcm.errors import InvalidArgument
from kvcm.proto.wire import Encodable


class BlockMask(msgspec.Struct, omit_defaults=True):
    """The wire mask. Both fields set is refused; neither set = no mask."""

    offset: int | None = None
    bool_masks: list[bool] | None = None


def check_mask(mask: BlockMask | None, n: int, field: str = "block_mask",
               destructive: bool = False) -> BlockMask | None:
    """Validate a mask against ``n`` keys (Tair's ``valid(mask, n)``). ``destructive``: the mask
    limits a deletion, so an empty one (``{}``) is refused rather than read as "no mask"."""
    if mask is None:
        return None
    if mask.offset is None and mask.bool_masks is None:
        if destructive:
            raise InvalidArgument(f"{field}: give offset or bool_masks (leave {field} out to mean every key)")
        return None
    if mask.offset is not None and mask.bool_masks is not None:
        raise InvalidArgument(f"{field}: give either offset or bool_masks, not both")
    if mask.offset is not None and not 0 <= mask.offset <= n:
        raise InvalidArgument(f"{field}.offset: {mask.offset} is outside 0..{n} (the number of blocks)")
    if mask.bool_masks is not None and len(mask.bool_masks) != n:
        raise InvalidArgument(f"{field}.bool_masks: has {len(mask.bool_masks)} entries for {n} blocks")
    return mask


def masked_flags(mask: BlockMask | None, n: int) -> list[bool] | None:
    """Per-index "masked" flags, or None when nothing is masked."""
    if mask is None:
        return None
    if mask.offset is not None:
        return [i < mask.offset for i in range(n)] if mask.offset else None
    assert mask.bool_masks is not None
    return list(mask.bool_masks) if any(mask.bool_masks) else None


def unmasked_indices(mask: BlockMask | None, n: int) -> list[int]:
    """Indices a read must look at, in order (prefix match compacts to these)."""
    if mask is None:
        return list(range(n))
    if mask.offset is not None:
        return list(range(mask.offset, n))
    assert mask.bool_masks is not None
    return [i for i, m in enumerate(mask.bool_masks) if not m]


def success_flags(mask: BlockMask | None, n: int) -> list[bool]:
    """``finish_write_cache``: which of the session's ``n`` blocks were written.

    Validated *before* the session is consumed (Tair consumed it first and leaked)."""
    if mask is None or (mask.offset is None and mask.bool_masks is None):
        raise InvalidArgument("success_blocks: required ({\"offset\": n} or {\"bool_masks\": [...]})")
    check_mask(mask, n, "success_blocks")
    if mask.offset is not None:
        return [i < mask.offset for i in range(n)]
    assert mask.bool_masks is not None
    return list(mask.bool_masks)


def write_mask(exists: Sequence[bool]) -> dict[str, Encodable]:
    """``start_write_cache``'s mask over the request keys (true / ``< offset`` = already there).

    A pure prefix of existing keys becomes ``{"offset": p}``, anything else ``{"bool_masks"}``,
    as Tair KVCM answers."""
    p = 0
    while p < len(exists) and exists[p]:
        p += 1
    if not any(exists[p:]):
        return {"offset": p}
    return {"bool_masks": list(exists)}
