"""The normalized trace record every reader produces and the replay consumes.

A trace is a stream of :class:`Record` in time order. ``op`` says what happened:

========  =====================================================================================
``turn``  a request that reads, then writes: prefix-match ``keys`` (after the ``mask``), then
          store every block of ``keys`` (Mooncake / Bailian requests, vLLM ``BlockStored``)
``read``  a prefix-match lookup only (kvcm ``GetCacheLocation``)
``write`` blocks stored (kvcm ``FinishWriteCache`` successes)
``remove`` blocks removed by the source (vLLM ``BlockRemoved``, applied reclaims)
``clear`` every block of the instance removed (vLLM ``AllBlocksCleared``)
``pin``   ``keys`` pinned for ``ttl`` seconds of trace time from ``ts`` (kvcm ``PinCache``): the
          replay never evicts them while it lasts; a re-pin sets a new end
``unpin`` the pins of ``keys`` dropped (kvcm ``UnpinCache``)
========  =====================================================================================

Keys are prefix-dependent block keys: a key identifies its whole prefix, as kvcm's own keys do
(readers of per-block hash ids chain them first). ``parent`` is the key before ``keys[0]``
(``None``: ``keys[0]`` starts a sequence). ``mask`` marks blocks already on the device (an
offset or one bool per key, as in kvcm's read masks); masked blocks are internal hits and are
not looked up. ``tokens`` is the prompt length of a read in tokens (``None``: ``len(keys) *
block_size``), so token hit rates can cap the last, partial block.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

Op = Literal["turn", "read", "write", "remove", "clear", "pin", "unpin"]
OPS: tuple[str, ...] = ("turn", "read", "write", "remove", "clear", "pin", "unpin")
Mask = int | list[bool]


class TraceError(ValueError):
    """A trace line that cannot be read; the message starts with ``path:line:``."""


@dataclass(slots=True)
class Record:
    """One trace event, normalized (see the module docstring)."""

    ts: float
    instance: str
    op: str
    keys: list[int] = field(default_factory=list)
    parent: int | None = None
    mask: Mask = 0
    tokens: int | None = None
    output_tokens: int = 0
    ttl: float = 0.0  # a pin's length in seconds (op "pin" only)

    def to_json(self) -> dict[str, object]:
        """The ``kvcm_schema`` line for this record (defaults omitted)."""
        out: dict[str, object] = {"ts": self.ts, "instance": self.instance, "op": self.op}
        if self.keys:
            out["keys"] = self.keys
        if self.parent is not None:
            out["parent"] = self.parent
        if self.mask:
            out["mask"] = self.mask
        if self.tokens is not None:
            out["tokens"] = self.tokens
        if self.output_tokens:
            out["output_tokens"] = self.output_tokens
        if self.ttl:
            out["ttl"] = self.ttl
        return out


def open_text(path: str | os.PathLike[str]) -> IO[str]:
    """Open a trace for reading as text; ``.gz`` files are decompressed on the fly."""
    p = Path(path)
    if p.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(p, "rb"), encoding="utf-8")
    return open(p, encoding="utf-8")


def json_lines(
    path: str | os.PathLike[str], progress: Callable[[int], object] | None = None
) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for each non-blank line of a JSON-lines file.

    ``progress`` is called with the byte length of every line read (for a progress bar).
    :raises TraceError: a line is not a JSON object (with its path and line number).
    """
    with open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if progress is not None:
                progress(len(line))
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            yield lineno, obj


class LineContext:
    """Field access that turns a bad value into a :class:`TraceError` naming the line."""

    __slots__ = ("obj", "where")

    def __init__(self, path: str | os.PathLike[str], lineno: int, obj: dict[str, Any]) -> None:
        self.where = f"{path}:{lineno}"
        self.obj = obj

    def fail(self, message: str) -> TraceError:
        return TraceError(f"{self.where}: {message}")

    def get(self, name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
        """Field ``name`` checked against ``kind``; missing is an error unless ``default`` given."""
        value = self.obj.get(name, default)
        if value is ...:
            raise self.fail(f"missing field {name!r}")
        if value is default and default is not ...:
            return value
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise self.fail(f"field {name!r} has type {type(value).__name__}")
        return value

    def number(self, name: str, default: Any = ...) -> float:
        return float(self.get(name, (int, float), default))

    def ints(self, name: str, default: Any = ...) -> list[int]:
        """A list of ints (block keys or hash ids)."""
        value = self.get(name, list, default)
        if value is default:
            return value  # type: ignore[no-any-return]
        if not all(type(v) is int for v in value):
            raise self.fail(f"field {name!r} must be a list of integers")
        return value  # type: ignore[no-any-return]


@dataclass
class Trace:
    """A trace being read: its records (an iterator, consumed once) and what was learnt."""

    path: str
    format: str
    block_size: int
    records: Iterator[Record] = field(default_factory=lambda: iter(()))
    block_sizes: dict[str, int] = field(default_factory=dict)
    counts: Counter[str] = field(default_factory=Counter)

    def __iter__(self) -> Iterator[Record]:
        return self.records

    def block_size_of(self, instance: str) -> int:
        """Tokens per block for ``instance`` (the trace's default if not stated per instance)."""
        return self.block_sizes.get(instance, self.block_size)
