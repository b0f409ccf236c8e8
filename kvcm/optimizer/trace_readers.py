"""Trace readers: one small converter per format, a registry by name, all streaming.

==================  ==========================================================================
format              input
==================  ==========================================================================
``mooncake``        JSONL ``{timestamp (ms), input_length, output_length, hash_ids}``, one
                    request per line, ``hash_ids`` one per 512-token block (Mooncake traces)
``qwen_bailian``    the same fields with ``timestamp`` in seconds and 16-token blocks
                    (Alibaba Bailian traces, Tair's ``qwen_bailian``)
``kvcm_events``     kvcm's JSON-lines event log (:mod:`kvcm.optimizer.kvcm_events`)
``vllm_events``     a capture of vLLM KV-event batches (:mod:`kvcm.optimizer.vllm_capture`)
``kvcm_schema``     kvcm's normalized trace (below), which ``--dump-schema`` writes for any format
==================  ==========================================================================

``hash_ids`` are per-block ids where equal ids at the same position mean an equal prefix; they
are chained with Tair's ``ApplyPrefixHash`` (:func:`kvcm.cache.keys.chain_hash_ids`) into
prefix-dependent keys, so two requests share a key only if they share the whole prefix.

``kvcm_schema`` is JSON lines: an optional header ``{"kvcm_schema": 1, "block_size": 16,
"instances": {"<id>": {"block_size": 512}}}`` then one :class:`~kvcm.optimizer.trace.Record`
per line: ``{"ts": s, "instance": str, "op": "turn|read|write|remove|clear|pin|unpin", "keys":
[int], "parent": int, "mask": int | [bool], "tokens": int, "output_tokens": int, "ttl": s}`` (all
but ``ts``, ``instance`` and ``op`` optional; ``ttl``, a pin's length, is required by and only
allowed with ``pin``).

Every reader raises :class:`~kvcm.optimizer.trace.TraceError` with ``path:line:`` on a bad
line, and counts what it skipped in :attr:`Trace.counts`.
"""

from __future__ import annotations

import inspect
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import IO

from kvcm.backends.migrations import TRACE
from kvcm.cache.keys import chain_hash_ids
from kvcm.optimizer import kvcm_events, vllm_capture
from kvcm.optimizer.trace import OPS, LineContext, Record, Trace, TraceError, json_lines

SCHEMA_VERSION = TRACE.current
Progress = Callable[[int], object]


ReadFn = Callable[..., Iterator[Record]]


@dataclass(frozen=True)
class Reader:
    """A registered converter: ``read(path, trace, progress, **options)`` yields records."""

    name: str
    read: ReadFn
    block_size: int
    description: str

    def options(self) -> dict[str, object]:
        """The reader's options and their defaults."""
        params = list(inspect.signature(self.read).parameters.values())[3:]
        return {p.name: p.default for p in params}


def read_hash_ids(
    path: str,
    trace: Trace,
    progress: Progress | None = None,
    instance: str = "instance",
    time_scale: float = 0.001,
) -> Iterator[Record]:
    """Mooncake-style requests: one ``turn`` per line, keys = chained ``hash_ids``.

    ``time_scale`` converts ``timestamp`` to seconds (0.001 for Mooncake's milliseconds).
    """
    for lineno, obj in json_lines(path, progress):
        line = LineContext(path, lineno, obj)
        hash_ids = line.ints("hash_ids")
        input_length = int(line.number("input_length"))
        if input_length < 0:
            raise line.fail(f"input_length is negative ({input_length})")
        yield Record(
            ts=line.number("timestamp") * time_scale,
            instance=instance,
            op="turn",
            keys=chain_hash_ids(hash_ids),
            tokens=input_length,
            output_tokens=int(line.number("output_length", 0)),
        )


def read_bailian(
    path: str,
    trace: Trace,
    progress: Progress | None = None,
    instance: str = "instance",
    time_scale: float = 1.0,
) -> Iterator[Record]:
    """Bailian requests: Mooncake's fields with timestamps in seconds."""
    return read_hash_ids(path, trace, progress, instance, time_scale)


def read_schema(path: str, trace: Trace, progress: Progress | None = None) -> Iterator[Record]:
    """kvcm's normalized trace, as written by :func:`dump_schema`."""
    for lineno, obj in json_lines(path, progress):
        line = LineContext(path, lineno, obj)
        if "kvcm_schema" in obj:
            _read_header(line, trace)
            continue
        yield _schema_record(line)


def _read_header(line: LineContext, trace: Trace) -> None:
    if (problem := TRACE.refusal(line.get("kvcm_schema", int))) is not None:
        raise line.fail(problem)
    trace.block_size = int(line.number("block_size", trace.block_size))
    for instance, spec in line.get("instances", dict, {}).items():
        if not isinstance(spec, dict) or type(spec.get("block_size")) is not int:
            raise line.fail(f"instance {instance!r} needs an integer block_size")
        trace.block_sizes[instance] = spec["block_size"]


def _schema_record(line: LineContext) -> Record:
    op = line.get("op", str)
    if op not in OPS:
        raise line.fail(f"unknown op {op!r}; valid: {', '.join(OPS)}")
    mask = line.get("mask", (int, list), 0)
    if isinstance(mask, list) and not all(isinstance(m, bool) for m in mask):
        raise line.fail("mask must be an int offset or a list of booleans")
    parent = line.get("parent", int, None)
    tokens = line.get("tokens", int, None)
    ttl = line.number("ttl", 0.0)
    if (op == "pin") != (ttl > 0) or not math.isfinite(ttl):
        raise line.fail("ttl: a pin needs a finite ttl > 0 seconds, and only a pin has one")
    return Record(
        ts=line.number("ts"),
        instance=line.get("instance", str),
        op=op,
        keys=line.ints("keys", []),
        parent=parent,
        mask=mask,
        tokens=tokens,
        output_tokens=line.get("output_tokens", int, 0),
        ttl=ttl,
    )


def dump_schema(trace: Trace, out: IO[str] | str | os.PathLike[str]) -> int:
    """Write ``trace`` as ``kvcm_schema`` (header first); returns the number of records.

    Block sizes learnt while reading are known only at the end, so the header is written last
    when ``out`` is a path (records are spooled to a temporary file first).
    """
    if not isinstance(out, (str, os.PathLike)):
        return _write_schema(trace, trace.records, out, header_first=True)
    tmp = f"{os.fspath(out)}.tmp"
    with open(tmp, "w", encoding="utf-8") as body:
        n = _write_schema(trace, trace.records, body, header_first=False)
    with open(out, "w", encoding="utf-8") as f, open(tmp, encoding="utf-8") as body:
        f.write(json.dumps(_header(trace)) + "\n")
        f.writelines(body)
    os.remove(tmp)
    return n


def _write_schema(trace: Trace, records: Iterable[Record], f: IO[str], header_first: bool) -> int:
    if header_first:
        f.write(json.dumps(_header(trace)) + "\n")
    n = 0
    for record in records:
        f.write(json.dumps(record.to_json(), separators=(",", ":")) + "\n")
        n += 1
    return n


def _header(trace: Trace) -> dict[str, object]:
    instances = {i: {"block_size": bs} for i, bs in sorted(trace.block_sizes.items())}
    return {"kvcm_schema": SCHEMA_VERSION, "block_size": trace.block_size, "instances": instances}


READERS: dict[str, Reader] = {
    r.name: r
    for r in (
        Reader("mooncake", read_hash_ids, 512, "Mooncake JSONL: timestamp ms, hash_ids"),
        Reader("qwen_bailian", read_bailian, 16, "Bailian JSONL: timestamp s, hash_ids"),
        Reader("kvcm_events", kvcm_events.read_events, 16, "kvcm's JSON-lines event log"),
        Reader("vllm_events", vllm_capture.read_capture, 16, "captured vLLM KV-event batches"),
        Reader("kvcm_schema", read_schema, 16, "kvcm's normalized trace"),
    )
}


def get_reader(fmt: str) -> Reader:
    """The reader registered as ``fmt``; the error lists the valid names."""
    reader = READERS.get(fmt)
    if reader is None:
        raise ValueError(f"unknown trace format {fmt!r}; valid: {', '.join(READERS)}")
    return reader


def read_trace(
    path: str | os.PathLike[str],
    fmt: str,
    *,
    block_size: int | None = None,
    progress: Progress | None = None,
    **options: object,
) -> Trace:
    """Open ``path`` as format ``fmt``; iterate the result for records (streamed, once).

    :raises ValueError: unknown format or option. :raises TraceError: on a bad line.
    """
    reader = get_reader(fmt)
    unknown = sorted(set(options) - set(reader.options()))
    if unknown:
        valid = ", ".join(reader.options()) or "none"
        raise ValueError(f"format {fmt!r} has no option {', '.join(unknown)}; options: {valid}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"trace not found: {path}")
    trace = Trace(os.fspath(path), fmt, block_size or reader.block_size)
    trace.records = reader.read(os.fspath(path), trace, progress, **options)
    return trace


def parse_options(fmt: str, items: Iterable[str]) -> dict[str, object]:
    """``["key=value", ...]`` -> reader options, each converted to its default's type."""
    defaults = get_reader(fmt).options()
    out: dict[str, object] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep or name not in defaults:
            valid = ", ".join(defaults) or "none"
            raise ValueError(f"bad trace option {item!r} for {fmt}; options: {valid}")
        out[name] = _convert(raw, defaults[name], name)
    return out


def _convert(raw: str, default: object, name: str) -> bool | int | float | str:
    try:
        if isinstance(default, bool):
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
        if isinstance(default, (int, float)):
            return type(default)(raw)
    except ValueError:
        raise ValueError(f"trace option {name}: bad value {raw!r}") from None
    return raw


__all__ = [
    "READERS",
    "Reader",
    "Record",
    "Trace",
    "TraceError",
    "dump_schema",
    "get_reader",
    "parse_options",
    "read_trace",
]
