"""Exact, format-agnostic splitting of a URI into a *skeleton* and the integers it carries.

Storages name their slots with numbers inside otherwise constant text (``.../00000012.kv?blkid=3``,
``pace://pool/81920?...``, a uuid in a mooncake key). Block records store the skeleton once, in a
table, and per block only the integers (:mod:`kvcm.cache.locations`); no storage's URI format is
assumed here.

A skeleton is a ``%``-format string: the URI's text with every number replaced by a placeholder
that remembers how it was written, so ``skeleton % tuple(ints)`` gives the URI back byte for byte:

* a run of decimal digits is ``%d``, or ``%0<w>d`` when it starts with ``0`` (zero padding);
* a run of lower-case hex digits holding at least one digit and one letter ``a-f`` is ``%x``
  or ``%0<w>x`` (uuids and hex ids);
* a run longer than 18 decimal or 16 hex digits is cut into fixed-width chunks, so every
  integer fits 64 bits (a msgpack int);
* a literal ``%`` is ``%%``.

:func:`split` checks the round trip itself and answers None for any URI that does not come back
exactly: the caller then stores that URI verbatim.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import lru_cache

NUMBER = re.compile(r"([0-9a-f]*[0-9][0-9a-f]*)")  # a maximal lower-case hex run holding a digit
_MAX = {"d": 18, "x": 16}  # digits per integer: below 2**64 either way


def split(uri: str) -> tuple[str, list[int]] | None:
    """``(skeleton, ints)`` with ``skeleton % tuple(ints) == uri``, or None."""
    pieces = NUMBER.split(uri)  # text, number, text, ..., text
    parts = [pieces[0].replace("%", "%%")]
    ints: list[int] = []
    for i in range(1, len(pieces), 2):
        run = pieces[i]
        base = "d" if run.isdigit() else "x"
        if len(run) <= _MAX[base]:
            parts.append(f"%0{len(run)}{base}" if run[0] == "0" and len(run) > 1 else "%" + base)
            ints.append(int(run, 10 if base == "d" else 16))
        else:
            _chunks(run, base, parts, ints)
        parts.append(pieces[i + 1].replace("%", "%%"))
    skeleton = "".join(parts)
    try:
        if skeleton % tuple(ints) != uri:
            return None
    except (TypeError, ValueError):
        return None
    return skeleton, ints


def join(skeleton: str, ints: list[int] | tuple[int, ...]) -> str:
    return skeleton % tuple(ints)


def _chunks(run: str, base: str, parts: list[str], ints: list[int]) -> None:
    """A run too long for one integer: fixed-width chunks, so every zero is kept."""
    most = _MAX[base]
    for start in range(0, len(run), most):
        chunk = run[start : start + most]
        parts.append(f"%0{len(chunk)}{base}")
        ints.append(int(chunk, 10 if base == "d" else 16))


PLACEHOLDER = re.compile(r"(%%|%0[0-9]+[dx]|%[dx])")
Matcher = Callable[[str], "list[int] | None"]


@lru_cache(maxsize=1024)
def matcher(skeleton: str) -> Matcher:
    """A function giving the ints of a URI that has this skeleton (or None): one anchored regex,
    much cheaper than :func:`split`. Each group only matches text its placeholder writes back
    exactly (``%d``: no leading zero; ``%08d``: eight digits), so no check is needed."""
    pattern, bases = [], []
    for i, piece in enumerate(PLACEHOLDER.split(skeleton)):
        if i % 2 == 0:
            pattern.append(re.escape(piece))
        elif piece == "%%":
            pattern.append("%")
        else:
            base = piece[-1]
            digits = "[0-9]" if base == "d" else "[0-9a-f]"
            if piece[1] == "0":
                pattern.append(f"({digits}{{{int(piece[2:-1])}}})")
            else:
                first = "[1-9]" if base == "d" else "[1-9a-f]"
                pattern.append(f"(0|{first}{digits}{{0,{_MAX[base] - 1}}})")
            bases.append(10 if base == "d" else 16)
    fullmatch = re.compile("".join(pattern), re.DOTALL).fullmatch
    if all(b == 10 for b in bases):
        def decimal(uri: str) -> list[int] | None:
            found = fullmatch(uri)
            return None if found is None else list(map(int, found.groups()))
        return decimal

    def mixed(uri: str) -> list[int] | None:
        found = fullmatch(uri)
        return None if found is None else [int(g, b) for g, b in zip(found.groups(), bases)]
    return mixed
