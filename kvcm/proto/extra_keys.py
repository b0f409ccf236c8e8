"""Extra keys: what besides its token ids makes a block of KV the block it is.

An engine mixes more than token ids into a block's hash: vLLM adds, per block, the LoRA adapter
of the request, the multimodal inputs that overlap the block (image placeholders are one token id
repeated, so two images give equal token ids), the request's ``cache_salt`` (first block only)
and a digest of the block's prompt embeddings. ``BlockStored.extra_keys`` carries that tuple per
block (None for a block without any). kvcm mixes a digest of the same tuple into its own key of
the block (:mod:`kvcm.cache.keys`), so two prompts that differ only there never share a key.

This module turns one block's extra keys into that digest and derives them from what a router has
at hand (``mm_features``, ``lora_name``, ``cache_salt``) by vLLM's rule
(``generate_block_hash_extra_keys`` in ``vllm/v1/core/kv_cache_utils.py``):

* the LoRA name on every block;
* for each multimodal input overlapping the block ``[start, end)``: ``(identifier, offset -
  start)``, the offset negative when the input began in an earlier block;
* the salt on the block that starts at token 0, when it is not empty;

in that order, and no extra keys at all (None) when the list is empty.

**Canonical form.** An entry is a list (or tuple: the same) of strings, bytes, ints, bools, None
and such lists. Its canonical bytes are its msgpack encoding in the shortest form of each value
(what msgspec writes), tuples as arrays; two entries digest alike exactly when those bytes are
equal, so ``"1"``, ``1`` and ``True`` stay three different keys. A float, a map or any other value
is refused (:class:`ExtraKeysError`): a value with two spellings would give one block two keys,
or two blocks one key. The digest is BLAKE2b-64 of the canonical bytes under kvcm's own
personalisation, as a signed 64-bit int.

**Bounds.** An entry is hostile input like any other: at most :data:`MAX_DEPTH` lists deep,
:data:`MAX_BLOCK_ITEMS` values and :data:`MAX_BLOCK_BYTES` canonical bytes per block, and
:data:`MAX_TOTAL_ITEMS` values and :data:`MAX_TOTAL_BYTES` bytes per request or event.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec

from kvcm.errors import Code, InvalidArgument
from kvcm.proto.schema import KEYS_CEILING

#: Lists nested in one block's entry at most (vLLM's: the entry, and its multimodal tuples).
MAX_DEPTH = 4
#: Values (lists included) of one block's entry at most.
MAX_BLOCK_ITEMS = 128
#: Canonical bytes of one block's entry at most.
MAX_BLOCK_BYTES = 8192
#: Values of all blocks of one request or event at most.
MAX_TOTAL_ITEMS = 1 << 16
#: Canonical bytes of all blocks of one request or event at most.
MAX_TOTAL_BYTES = 1 << 20
#: Multimodal inputs of one request at most, and the length of an identifier.
MAX_MM_FEATURES = 4096
MAX_IDENTIFIER = 512
#: Characters of a ``cache_salt`` at most.
MAX_SALT = 1024

_PERSON = b"kvcm-extra-keys1"  # BLAKE2b personalisation (16 bytes): no other kvcm digest shares it
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1  # what msgpack can carry
_ENCODE = msgspec.msgpack.Encoder().encode


class ExtraKeysError(InvalidArgument):
    """Extra keys kvcm cannot canonicalise, past a bound, or not matching the blocks they are for.
    ``INVALID_ARGUMENT``, or ``TOO_LARGE`` for a bound."""


# --- request fields (the API's Structs take these) ---------------------------------------------


class MmFeature(msgspec.Struct, forbid_unknown_fields=True):
    """One multimodal input of a prompt: vLLM's ``mm_feature.identifier`` and its placeholder's
    ``offset`` and ``length`` in tokens."""

    identifier: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_IDENTIFIER)]
    offset: Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
    length: Annotated[int, msgspec.Meta(ge=1, le=1 << 40)]


#: ``extra_keys`` of a request: one entry per block (None, or a list).
ExtraKeys = Annotated[list[Any], msgspec.Meta(max_length=KEYS_CEILING)]
MmFeatures = Annotated[list[MmFeature], msgspec.Meta(max_length=MAX_MM_FEATURES)]
CacheSalt = Annotated[str, msgspec.Meta(max_length=MAX_SALT)]
#: A LoRA adapter's name (the engine index keys its namespace by it, at most 256 characters).
LoraName = Annotated[str, msgspec.Meta(max_length=256)]


# --- one block ---------------------------------------------------------------------------------


def canonical(entry: Any, where: str = "extra_keys") -> bytes | None:
    """The canonical bytes of one block's extra keys; None for a block without any (None or an
    empty list). :class:`ExtraKeysError` for anything else than a list of the values the module
    docstring names, or past a per-block bound."""
    found = _canonical(entry, where)
    return None if found is None else found[0]


def _canonical(entry: Any, where: str) -> tuple[bytes, int] | None:
    """:func:`canonical`, and the number of values in the entry."""
    if entry is None:
        return None
    kind = type(entry)
    if kind is not list and kind is not tuple:
        raise ExtraKeysError(f"{where}: a block's extra keys are a list (or null), got {_name(entry)}")
    if not entry:
        return None
    items = _check(entry, where)
    try:
        data = _ENCODE(entry)
    except (TypeError, ValueError, OverflowError) as exc:  # a str that is not UTF-8 (lone surrogates)
        raise ExtraKeysError(f"{where}: cannot be encoded: {str(exc)[:100]}") from None
    if len(data) > MAX_BLOCK_BYTES:
        raise ExtraKeysError(
            f"{where}: {len(data)} bytes, over the {MAX_BLOCK_BYTES} a block's extra keys may take", Code.TOO_LARGE
        )
    return data, items


def _check(entry: list[Any] | tuple[Any, ...], where: str) -> int:
    """The number of values in ``entry`` (itself included); raises past the bounds or on a value
    with no canonical form."""
    items = 0
    stack: list[tuple[Any, int]] = [(entry, 1)]
    while stack:
        value, depth = stack.pop()
        items += 1
        kind = type(value)
        if kind is list or kind is tuple:
            if depth > MAX_DEPTH:
                raise ExtraKeysError(f"{where}: nested over {MAX_DEPTH} lists deep")
            if items + len(stack) + len(value) > MAX_BLOCK_ITEMS:
                raise ExtraKeysError(
                    f"{where}: over {MAX_BLOCK_ITEMS} values in one block's extra keys", Code.TOO_LARGE
                )
            stack.extend(zip(value, [depth + 1] * len(value)))
        elif kind is int:
            if not _INT_MIN <= value <= _INT_MAX:
                raise ExtraKeysError(f"{where}: the int {str(value)[:40]} does not fit in 64 bits")
        elif kind is not str and kind is not bytes and kind is not bool and value is not None:
            raise ExtraKeysError(
                f"{where}: {_name(value)} has no canonical form (extra keys are lists of "
                f"strings, bytes, ints, bools and null)"
            )
    return items


def _name(value: Any) -> str:
    kind = type(value)
    if kind is float:
        return "a float"
    if kind is dict:
        return "a map"
    return f"a {kind.__name__}"


def digest(data: bytes) -> int:
    """The signed 64-bit digest of canonical bytes (what is mixed into the block's key)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=_PERSON).digest(), "little", signed=True)


def entry_digest(entry: Any, where: str = "extra_keys") -> int | None:
    """:func:`digest` of one block's entry; None for a block without extra keys."""
    data = canonical(entry, where)
    return None if data is None else digest(data)


class _Total:
    """Values and bytes of one request's or event's blocks so far, against the totals."""

    __slots__ = ("bytes", "items", "memo")

    def __init__(self) -> None:
        self.items = 0
        self.bytes = 0
        self.memo: dict[bytes, int] = {}  # canonical bytes -> digest (an adapter's name repeats per block)

    def digest(self, entry: Any, where: str) -> int | None:
        found = _canonical(entry, where)
        if found is None:
            return None
        data, items = found
        self.items += items
        self.bytes += len(data)
        if self.items > MAX_TOTAL_ITEMS or self.bytes > MAX_TOTAL_BYTES:
            raise ExtraKeysError(
                f"extra_keys: over {MAX_TOTAL_ITEMS} values or {MAX_TOTAL_BYTES} bytes in one request or event",
                Code.TOO_LARGE,
            )
        known = self.memo.get(data)
        if known is None:
            if len(self.memo) >= 256:
                self.memo.clear()
            known = self.memo[data] = digest(data)
        return known


# --- vLLM's rule -------------------------------------------------------------------------------


def check_features(features: Sequence[MmFeature], tokens: int) -> None:
    """Refuse multimodal inputs vLLM could not have: not sorted by offset, overlapping, or past
    the prompt's ``tokens``."""
    end = 0
    for i, f in enumerate(features):
        if f.offset < end:
            raise ExtraKeysError(
                f"mm_features[{i}]: offset {f.offset} is before the end ({end}) of the input "
                f"before it (give them sorted by offset, not overlapping)"
            )
        end = f.offset + f.length
        if end > tokens:
            raise ExtraKeysError(f"mm_features[{i}]: ends at token {end}, past the {tokens} token_ids")


class _Rule:
    """vLLM's extra keys of consecutive blocks, block by block (the multimodal input the last
    block stopped at is where the next one starts looking, as vLLM's ``curr_mm_idx``)."""

    __slots__ = ("block_size", "features", "lora", "next_mm", "salt")

    def __init__(
        self, block_size: int, features: Sequence[MmFeature], lora_name: str | None, cache_salt: str | None
    ) -> None:
        self.block_size = block_size
        self.features = features
        self.lora: list[Any] = [lora_name] if lora_name else []
        self.salt = cache_salt
        self.next_mm = 0

    def entry(self, block: int) -> tuple[Any, ...] | None:
        start = block * self.block_size
        end = start + self.block_size
        keys: list[Any] = list(self.lora)
        features, i = self.features, self.next_mm
        while i < len(features):
            f = features[i]
            if end <= f.offset:
                break  # this block has not reached the input
            if start >= f.offset + f.length:
                i += 1  # the block is past the input
                continue
            keys.append((f.identifier, f.offset - start))
            if end >= f.offset + f.length:
                i += 1  # the input ends in this block: the next one may start in it too
            else:
                break  # the input goes on past this block
        self.next_mm = i
        if start == 0 and self.salt:
            keys.append(self.salt)
        return tuple(keys) if keys else None


def derive(
    blocks: int,
    block_size: int,
    mm_features: Sequence[MmFeature] = (),
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> list[tuple[Any, ...] | None]:
    """The extra keys of each of a prompt's first ``blocks`` blocks, by vLLM's rule (module
    docstring). ``mm_features`` must be sorted by offset and not overlap."""
    rule = _Rule(block_size, mm_features, lora_name, cache_salt)
    return [rule.entry(b) for b in range(blocks)]


# --- a request's or an event's blocks ----------------------------------------------------------


class BlockExtras:
    """The digests of one prompt's blocks, made in block order as the hashing reaches them (a
    long prompt is hashed a slice at a time: its extra keys are checked and digested alike)."""

    __slots__ = ("_entries", "_rule", "_total", "blocks")

    def __init__(self, blocks: int, entries: Sequence[Any] | None = None, rule: _Rule | None = None) -> None:
        self.blocks = blocks
        self._entries = entries
        self._rule = rule
        self._total = _Total()

    def digests(self, start: int, stop: int) -> list[int | None]:
        """Digests of blocks ``start .. stop - 1`` (None: the block has no extra keys); called
        for consecutive ranges. Raises :class:`ExtraKeysError`."""
        stop = min(stop, self.blocks)
        total = self._total
        if self._entries is not None:
            entries = self._entries
            return [total.digest(entries[b], f"extra_keys[{b}]") for b in range(start, stop)]
        assert self._rule is not None  # internal: one of the two is given
        rule = self._rule
        return [total.digest(rule.entry(b), f"block {b}") for b in range(start, stop)]


def request_extras(
    *,
    tokens: int,
    block_size: int,
    extra_keys: Sequence[Any] | None = None,
    mm_features: Sequence[MmFeature] | None = None,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> BlockExtras | None:
    """The extra keys of a request whose keys come from ``tokens`` token ids: its per-block
    ``extra_keys`` (one entry per whole block, used as given; ``lora_name`` then only names the
    adapter), else those vLLM's rule derives from ``mm_features``, ``lora_name`` and
    ``cache_salt``. None when no block has any (the keys are the plain chained hash)."""
    blocks = tokens // block_size
    if extra_keys is not None:
        if mm_features or cache_salt:
            raise ExtraKeysError("extra_keys, or mm_features and cache_salt: give one form of a prompt's extra keys")
        if len(extra_keys) != blocks:
            raise ExtraKeysError(
                f"extra_keys has {len(extra_keys)} entries; the {tokens} token_ids make {blocks} "
                f"blocks of {block_size} (one entry per block, null for none)"
            )
        if extra_keys.count(None) == blocks:
            return None
        return BlockExtras(blocks, entries=extra_keys)
    features = mm_features or ()
    if not (features or lora_name or cache_salt):
        return None
    check_features(features, tokens)
    return BlockExtras(blocks, rule=_Rule(block_size, features, lora_name, cache_salt))


def check_request(has_tokens: bool, extra_keys: Any, mm_features: Any, cache_salt: Any) -> None:
    """A request whose keys are not derived from token ids (``block_keys`` given, or no
    ``token_ids``) cannot take extra keys: they would be silently left out."""
    if not has_tokens and (extra_keys is not None or mm_features or cache_salt):
        raise ExtraKeysError(
            "extra_keys, mm_features and cache_salt enter keys derived from token_ids; "
            "block_keys are used as given (send token_ids, and no block_keys)"
        )


def event_digests(extra_keys: Sequence[Any] | None, lora_name: str | None, blocks: int) -> list[int | None] | None:
    """Per block of a ``BlockStored`` event, the digest of its extra keys; None when no block has
    any. An event without ``extra_keys`` but with a ``lora_name`` (vLLM before it sent extra
    keys) has ``[lora_name]`` on every block, as newer vLLM sends. Raises
    :class:`ExtraKeysError` (a list whose length is not the event's blocks included)."""
    if extra_keys is None:
        if not lora_name:
            return None
        return [digest(_lora_bytes(lora_name))] * blocks
    if type(extra_keys) is not list or len(extra_keys) != blocks:
        size = len(extra_keys) if type(extra_keys) is list else _name(extra_keys)
        raise ExtraKeysError(f"extra_keys: {size} entries for {blocks} blocks")
    if extra_keys.count(None) == blocks:
        return None
    total = _Total()
    return [total.digest(e, f"extra_keys[{i}]") for i, e in enumerate(extra_keys)]


def lora_digest(lora_name: str) -> int:
    """The digest of a block whose only extra key is the adapter's name."""
    return digest(_lora_bytes(lora_name))


def _lora_bytes(lora_name: str) -> bytes:
    data = canonical([lora_name], "lora_name")
    assert data is not None  # internal: a one-element list
    return data


__all__ = [
    "MAX_BLOCK_BYTES",
    "MAX_BLOCK_ITEMS",
    "MAX_DEPTH",
    "MAX_IDENTIFIER",
    "MAX_MM_FEATURES",
    "MAX_SALT",
    "MAX_TOTAL_BYTES",
    "MAX_TOTAL_ITEMS",
    "BlockExtras",
    "CacheSalt",
    "ExtraKeys",
    "ExtraKeysError",
    "LoraName",
    "MmFeature",
    "MmFeatures",
    "canonical",
    "check_features",
    "check_request",
    "derive",
    "digest",
    "entry_digest",
    "event_digests",
    "lora_digest",
    "request_extras",
]
