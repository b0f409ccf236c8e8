"""Fuzz targets: each takes arbitrary bytes and fails only on a real bug.

* ``rpc`` — the bytes are one request payload, handled by the dispatcher of a real kvcm (LMDB in
  a temp dir, an instance with written blocks). Every payload must get a well-formed reply (or
  none, for a notification), and no reply may be ``INTERNAL_ERROR`` (an exception escaped a
  handler: input validation missed something) or ``IO_ERROR`` (the sandbox's disk never fails,
  so the store refused something validation should have).
* ``rpc_struct`` — the bytes *choose* a request: a method, then a value for each field of its
  request schema (mostly of the declared type, sometimes not, now and then with a field the
  schema lacks), so the handlers' own checks are reached far more often than by random msgpack.
  Same oracle as ``rpc``, plus: a request with an unknown field, at any depth, must be refused
  (INVALID_ARGUMENT, or TOO_MANY_KEYS when its size is checked first), never executed.
* ``events`` — the bytes are one KV-event payload: decoded, and when it decodes, applied to an
  engine index and matched against it. Decoding may refuse with ``EventDecodeError``; nothing
  else may raise.

The same functions serve ``scripts/fuzz`` (coverage-guided, with atheris) and
``tests/fuzz/test_fuzz.py`` (replays the seed corpus and every saved crash in the default suite), so
a crash found once stays a regression test. Nothing here needs atheris.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import msgpack
import msgspec

from kvcm.cache.keys import token_ids_to_block_keys
from kvcm.engines.index import EngineIndex
from kvcm.engines.sources import SourceSpec
from kvcm.errors import Code, InvalidArgument
from kvcm.proto import schema, wire
from kvcm.proto.kv_events import EventDecodeError, decode_batch, event_to_meaning, hash_to_u64

INSTANCE = "fuzz-inst"
BLOCK_SIZE = 4
WRITTEN_KEYS = list(range(1, 9))
#: Fields of storage records, whose specs name directories (and default to real ones, such as
#: ``/dev/shm``): a fuzzer must never make kvcm create or probe paths outside its sandbox, so
#: raw inputs naming them are parsed but not executed, and structured inputs get sandbox paths.
PATH_FIELDS = (b"root_path", b"mountpoint", b"root_dir", b"shm_dir", b"storage_spec", b"storage_type")


class FuzzBug(AssertionError):
    """The oracle's verdict: this input found a bug."""


# -- the kvcm under fuzz --------------------------------------------------------------------------


class _Kvcm:
    """One in-process kvcm (not serving a socket: the dispatcher is called directly)."""

    def __init__(self) -> None:
        from kvcm.node.app import App
        from kvcm.testing import make_test_config

        self.sandbox = tempfile.mkdtemp(prefix="kvcm-fuzz-")
        # Held refusals (server.refusal_hold_ms) stay on, at 1 ms: their path is fuzzed too, but
        # a batch does not sleep 100 ms for each big refused request it holds.
        cfg = make_test_config(os.path.join(self.sandbox, "data"), f"ipc://{self.sandbox}/rpc",
                               {"reclaim": {"enabled": False}, "events": {"enabled": False},
                                "store": {"sync": False}, "server": {"max_keys": 256, "refusal_hold_ms": 1.0}})
        self.app = App(cfg)
        self.dispatcher = self.app.dispatcher
        atexit.register(self.close)
        self._seed()
        self._registry = self.app.registry.gen_config_snapshot()

    def reseed(self) -> None:
        """Put the registry back when an input removed the instance (or its group or storage),
        so later inputs still reach the cache handlers; a failure leaves things as they are."""
        from kvcm.errors import KvcmError

        try:
            self.app.registry.get_instance(INSTANCE)
        except KvcmError:
            with contextlib.suppress(KvcmError):
                self.app.registry.load_config_snapshot(self._registry)

    def _seed(self) -> None:
        call = self.dispatcher.call
        call("register_instance", {"instance_group": "default", "instance_id": INSTANCE, "block_size": BLOCK_SIZE,
                                   "location_spec_infos": [{"name": "tp0", "size": 64}]})
        started = call("start_write_cache", {"instance_id": INSTANCE, "block_keys": WRITTEN_KEYS})
        session = msgpack.unpackb(started.data) if isinstance(started, wire.Raw) else started
        call("finish_write_cache", {"instance_id": INSTANCE, "write_session_id": session["write_session_id"],
                                    "success_blocks": {"offset": len(WRITTEN_KEYS)}})

    def close(self) -> None:
        try:
            self.app.stop()
        finally:
            shutil.rmtree(self.sandbox, ignore_errors=True)


_kvcm: _Kvcm | None = None


def kvcm() -> _Kvcm:
    global _kvcm
    if _kvcm is None:
        _kvcm = _Kvcm()
    return _kvcm


def check_rpc(data: bytes) -> None:
    """Oracle for one request payload."""
    k = kvcm()
    if any(field in data for field in PATH_FIELDS):
        k.dispatcher._parse(data)  # decode and route only: executing could touch any path
        return
    _check_reply(data, k.dispatcher.handle(data))


def _check_reply(request: bytes, reply: bytes | None) -> None:
    if reply is None:
        return  # a notification (or a request the dispatcher may drop): nothing to answer
    try:
        msgid, err, _ = wire.parse_response(reply)
    except Exception as exc:  # any failure to parse is the finding
        raise FuzzBug(f"malformed reply {reply[:80]!r} to {request[:80]!r}: {exc}") from exc
    if not isinstance(msgid, int) or msgid < 0:
        raise FuzzBug(f"bad msgid {msgid!r} in reply to {request[:80]!r}")
    if err is None:
        return
    if not isinstance(err, dict) or err.get("code") not in set(Code):
        raise FuzzBug(f"error without a known code: {err!r}")
    if err["code"] in (Code.INTERNAL_ERROR, Code.IO_ERROR):  # the sandbox's disk never fails
        raise FuzzBug(f"{Code(err['code']).name} ({err.get('message')}) for {request[:200]!r}")


# -- structured requests --------------------------------------------------------------------------


class _Reader:
    """Turns fuzz bytes into choices; reads zeros once the bytes run out."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def byte(self) -> int:
        if self.pos >= len(self.data):
            return 0
        self.pos += 1
        return self.data[self.pos - 1]

    def pick(self, options: list[Any] | tuple[Any, ...]) -> Any:
        return options[self.byte() % len(options)]


_INTS = (0, 1, 2, 3, 4, 8, 16, 64, 65, 257, -1, -2, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, 1, 5, 7)
_FLOATS = (0.0, 0.001, 1.5, -1.0, 1e9, 1e308, math.inf, -math.inf, math.nan)
_WRONG = (None, -1, 2**64 - 1, "", "x" * 300, b"\x00\xff", [], {}, 1.5, True, [None], {"": None})
_WORDS = ("", INSTANCE, "default", "tp0", "tp1", "file", "shm", "3fs", "mooncake", "tairmempool", "prefix_match",
          "batch_get", "reverse_roll_sw_match", "remove_all_cache", "remove_all_meta", "timestamp", "lru", "lfu",
          "ttl", "leaf_lru", "GPU", "CPU", "admin", "x" * 70, "\u00fc\u00df", "a/b", "..", "tcp://127.0.0.1:1",
          "ipc:///nonexistent/x", "0" * 32, "default-file", "fuzz-inst-2", "[" * 3000,
          '{"format": "kvcm-registry"}')


def _value(r: _Reader, info: Any, sandbox: str, depth: int = 0) -> Any:
    """A value for a field of type ``info`` (a msgspec.inspect type): usually of that type."""
    ti = msgspec.inspect
    if depth > 4 or r.byte() % 11 == 0:
        return r.pick(_WRONG)
    if isinstance(info, ti.UnionType):
        return _value(r, r.pick(info.types), sandbox, depth)
    if isinstance(info, ti.LiteralType):
        return r.pick(info.values)
    if isinstance(info, ti.BoolType):
        return bool(r.byte() & 1)
    if isinstance(info, ti.IntType):
        return r.pick(_INTS) if r.byte() & 1 else r.byte() - 8
    if isinstance(info, ti.FloatType):
        return r.pick(_FLOATS)
    if isinstance(info, ti.StrType):
        return r.pick(_WORDS)
    if isinstance(info, ti.BytesType):
        return bytes(r.byte() for _ in range(r.byte() % 8))
    if isinstance(info, (ti.ListType, ti.VarTupleType, ti.SetType, ti.FrozenSetType)):
        return [_value(r, info.item_type, sandbox, depth + 1) for _ in range(_length(r))]
    if isinstance(info, ti.DictType):
        return {_key(_value(r, info.key_type, sandbox, depth + 1)): _value(r, info.value_type, sandbox, depth + 1)
                for _ in range(r.byte() % 4)}
    if isinstance(info, ti.StructType):
        return _struct(r, info, sandbox, depth + 1)
    if isinstance(info, ti.NoneType):
        return None
    return _any(r, sandbox, depth + 1)


def _key(value: Any) -> Any:
    """A map key msgpack can carry that Python can hash (a wrong-typed list or map becomes text)."""
    return value if value is None or isinstance(value, (int, float, str, bytes)) else repr(value)


def _length(r: _Reader) -> int:
    n = r.byte()
    return n % 9 if n < 250 else 257 + n  # now and then past max_keys (256 here)


def _any(r: _Reader, sandbox: str, depth: int) -> Any:
    kind = r.byte() % 6
    if kind == 0 or depth > 4:
        return r.pick(_INTS)
    if kind == 1:
        return r.pick(_WORDS)
    if kind == 2:
        return [_any(r, sandbox, depth + 1) for _ in range(r.byte() % 4)]
    if kind == 3:
        return {r.pick(_WORDS): _any(r, sandbox, depth + 1) for _ in range(r.byte() % 4)}
    return r.pick(_WRONG)


#: Values that make a field *mean* something to the seeded kvcm (an existing instance, written
#: keys, a live session), used for three out of four fields so named: random words would almost
#: never name the instance, and every cache request would stop at INSTANCE_NOT_EXIST.
_HINTS: dict[str, Callable[[_Reader], Any]] = {
    "instance_id": lambda r: INSTANCE,
    "block_keys": lambda r: [r.pick([*WRITTEN_KEYS, 100, 101, -5]) for _ in range(_length(r))],
    "token_ids": lambda r: [r.byte() % 4 for _ in range(_length(r) * BLOCK_SIZE)],
    "write_session_id": lambda r: r.pick(_recent_sessions or ["0" * 32]),
    "query_type": lambda r: r.pick(("prefix_match", "batch_get", "reverse_roll_sw_match")),
    "strategy": lambda r: r.pick(("remove_all_cache", "remove_all_meta", "timestamp")),
}
_recent_sessions: list[str] = []


def _struct(r: _Reader, info: Any, sandbox: str, depth: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for field in info.fields:
        if field.required or r.byte() & 1:
            hint = _HINTS.get(field.encode_name)
            use_hint = hint is not None and r.byte() % 4 != 0
            out[field.encode_name] = hint(r) if hint is not None and use_hint else _value(r, field.type, sandbox, depth)
    if r.byte() % 7 == 0:
        out[r.pick(_WORDS)] = _any(r, sandbox, depth)  # usually a field the schema lacks: refused
    if any(field.encode_name == "storage_spec" for field in info.fields):
        _sandboxed(out, sandbox)
    return out


#: The spec field naming a directory, per storage type; left out, each defaults to a real
#: system path (``shm`` to ``/dev/shm``), so it is always set into the sandbox.
_PATH_FIELD = {"file": "root_path", "shm": "shm_dir", "3fs": "mountpoint"}


def _sandboxed(params: dict[str, Any], sandbox: str) -> None:
    """A storage record's directory goes into the sandbox, whatever the fuzz bytes chose."""
    spec = params.setdefault("storage_spec", {})
    kind = params.get("storage_type")
    if not isinstance(spec, dict) or not isinstance(kind, str):
        return  # refused by validation before any backend opens
    field = _PATH_FIELD.get(kind)
    if field is not None:
        spec[field] = os.path.join(sandbox, "st", str(spec.get(field, ""))[:8].replace("/", "_") or "x")
    spec.pop("root_dir", None)  # relative to the mountpoint, but ".." would climb out


def structured_request(data: bytes) -> bytes:
    """The request payload ``data`` chooses (deterministic, so saved inputs replay exactly)."""
    return _structured(data)[0]


def _structured(data: bytes) -> tuple[bytes, bool]:
    """The payload, and whether it names a field its schema lacks (so must be refused)."""
    k = kvcm()
    r = _Reader(data)
    method = r.pick(sorted(k.dispatcher.methods))
    kind = k.dispatcher.methods[method].request
    if kind is None:
        params = {r.pick(_WORDS): _any(r, k.sandbox, 0) for _ in range(r.byte() % 3)}
    else:
        params = _struct(r, msgspec.inspect.type_info(kind), k.sandbox, 0)
    msgid = r.pick(_INTS[:8])
    if r.byte() % 16 == 0:
        return wire.pack_notification(method, params), False
    return wire.pack_request(msgid, method, params), kind is not None and _has_unknown_field(params, kind)


def _has_unknown_field(params: dict[str, Any], kind: type) -> bool:
    try:
        schema.check_partial(params, kind, "")
    except InvalidArgument:
        return True
    return False


#: What a request with an unknown field may get: refused by validation, or by its size first.
_REFUSALS = (Code.INVALID_ARGUMENT, Code.TOO_MANY_KEYS)


def check_rpc_struct(data: bytes) -> None:
    k = kvcm()
    request, must_refuse = _structured(data)
    reply = k.dispatcher.handle(request)
    _check_reply(request, reply)
    if must_refuse:
        _check_refused(request, reply)
    _remember_session(reply)
    k.reseed()


def _check_refused(request: bytes, reply: bytes | None) -> None:
    if reply is None:
        return  # no reply to judge (the base oracle allows a drop)
    err = wire.parse_response(reply)[1]
    if not isinstance(err, dict) or err.get("code") not in _REFUSALS:
        raise FuzzBug(f"a request with an unknown field was not refused ({err!r}): {request[:200]!r}")


def _remember_session(reply: bytes | None) -> None:
    """Keep the last few write sessions, so finish_write_cache can name a live one."""
    if reply is None or b"write_session_id" not in reply:
        return
    result = wire.parse_response(reply)[2]
    if isinstance(result, dict) and isinstance(result.get("write_session_id"), str):
        _recent_sessions.append(result["write_session_id"])
        del _recent_sessions[:-8]


# -- KV events -------------------------------------------------------------------------------------


class _Events:
    def __init__(self) -> None:
        self.index = EngineIndex(None, lambda _: 16)
        self.generation = self.index.add_source(SourceSpec("fuzz", INSTANCE, "tcp://127.0.0.1:5557")).generation
        self.seq = 0


_events: _Events | None = None


def check_events(data: bytes) -> None:
    """Oracle for one KV-event payload."""
    global _events
    if _events is None:
        _events = _Events()
    try:
        batch = decode_batch(data)
    except EventDecodeError:
        return
    for event in batch.events:
        event_to_meaning(event)
        for h in getattr(event, "block_hashes", ()):
            hash_to_u64(h)
    _events.seq += 1
    _events.index.apply("fuzz", _events.generation, _events.seq, batch)
    tokens = [t for e in batch.events for t in getattr(e, "token_ids", ())]
    _events.index.match(INSTANCE, token_ids_to_block_keys(tokens[:1024], 16))


# -- seeds ----------------------------------------------------------------------------------------


def seeds(target: str) -> dict[str, bytes]:
    """The seed corpus of a target, by file name (``scripts/fuzz --write-seeds``)."""
    if target == "events":
        import base64
        import json

        golden = os.path.join(os.path.dirname(os.path.dirname(__file__)), "golden", "vllm_events.jsonl")
        with open(golden) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return {f"golden-{row['name']}": base64.b64decode(row["payload_b64"]) for row in rows}
    if target == "rpc":
        return {f"{i:02d}-{method}": wire.pack_request(i + 1, method, params)
                for i, (method, params) in enumerate(_VALID_REQUESTS)}
    if target == "batch":
        raw = [b"\x01" + wire.pack_request(i + 1, m, p) for i, (m, p) in enumerate(_VALID_REQUESTS)]
        poison = [b"\x01" + b"\x91" * 5000 + b"\xc0", b"\x01\xdd\xff\xff\xff\xff",
                  b"\x01\x94\x00\x07\xaccheck_health\x91" + b"\x91" * 3000 + b"\xc0",
                  b"\x01\x94\x00\x08\xb2finish_write_cache\x91\x81\xa9locations" + b"\x91" * 200_000 + b"\xc0"]
        out = {f"pair{i:02d}": raw[i] + BATCH_SEPARATOR + raw[(i + 3) % len(raw)] for i in range(len(raw))}
        out.update({f"poison{i}": p + BATCH_SEPARATOR + raw[0] for i, p in enumerate(poison)})
        out["structured"] = b"\x00" + bytes(range(64)) + BATCH_SEPARATOR + b"\x02" + bytes(range(64, 128))
        return out
    # rpc_struct: the first byte picks the method, the rest its field choices
    count = len(kvcm().dispatcher.methods)
    return {f"method{i:02d}-{fill}": bytes([i]) + bytes([fill]) * 63 for i in range(count) for fill in (1, 3)}


_VALID_REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("check_health", {}),
    ("get_instance_info", {"instance_id": INSTANCE}),
    ("list_storage", {}),
    ("get_instance_group", {"name": "default"}),
    ("register_instance", {"instance_group": "default", "instance_id": "fuzz-inst-2", "block_size": 16,
                           "location_spec_infos": [{"name": "tp0", "size": 1024}]}),
    ("get_cache_location", {"instance_id": INSTANCE, "query_type": "prefix_match", "block_keys": WRITTEN_KEYS}),
    ("get_cache_location", {"instance_id": INSTANCE, "query_type": "batch_get", "block_keys": [1, 99, 3],
                            "block_mask": {"bool_masks": [True, False, False]}}),
    ("get_cache_location", {"instance_id": INSTANCE, "query_type": "reverse_roll_sw_match", "sw_size": 2,
                            "token_ids": list(range(32))}),
    ("get_cache_meta", {"instance_id": INSTANCE, "block_keys": [1, 2], "detail_level": 2}),
    ("start_write_cache", {"instance_id": INSTANCE, "block_keys": [1, 2, 100, 101], "write_timeout_seconds": 5}),
    ("finish_write_cache", {"instance_id": INSTANCE, "write_session_id": "0" * 32, "success_blocks": {"offset": 1}}),
    ("remove_cache", {"instance_id": INSTANCE, "block_keys": [7], "block_mask": {"offset": 0}}),
    ("trim_cache", {"instance_id": INSTANCE, "strategy": "timestamp", "begin_timestamp": 0, "end_timestamp": 1}),
    ("match_engines", {"instance_id": INSTANCE, "block_keys": [1, 2]}),
    ("list_event_sources", {}),
    ("get_metrics", {}),
    ("pin_cache", {"instance_id": INSTANCE, "block_keys": [1, 2, -5], "ttl_seconds": 30.5}),
    ("unpin_cache", {"instance_id": INSTANCE, "block_keys": [2, 77]}),
]


# -- batch: poisoned requests drained together with good ones ----------------------------------------

#: Methods that can unregister the instance the good requests of a batch ask about.
_REMOVALS = (b"remove_instance", b"load_config_snapshot")
#: Splits a batch input into its requests.
BATCH_SEPARATOR = b"\xc1\xc1"
_SENTINEL_ID = 4_000_000_000  # msgids of the good requests: above any the fuzz input picks


def check_batch(data: bytes) -> None:
    """Several fuzzed requests (raw bytes, or built field by field when a piece starts with an
    even byte) drained in one batch between known-good ones: every good one gets its own correct
    reply, and every reply is well formed — one request's failure is never another's."""
    k = kvcm()
    pieces = [p for p in data.split(BATCH_SEPARATOR)[:8] if p]
    requests = [_structured(p[1:])[0] if p[0] % 2 == 0 else p[1:] for p in pieces]
    # Requests that may legitimately take the good requests' instance away are left out: the
    # oracle is about isolation, not about what a removal does.
    requests = [r for r in requests if r and not any(field in r for field in (*PATH_FIELDS, *_REMOVALS))]
    batch: list[bytes] = []
    good: dict[int, int] = {}  # index in the batch -> msgid
    for i, request in enumerate([*requests, b""]):
        good[len(batch)] = _SENTINEL_ID + i
        batch.append(wire.pack_request(_SENTINEL_ID + i, "get_instance_info", {"instance_id": INSTANCE}))
        if request:
            batch.append(request)
    replies = k.dispatcher.handle_batch(batch, [bytes([i % 3]) for i in range(len(batch))])
    for index, (request, reply) in enumerate(zip(batch, replies)):
        if index not in good:
            _check_reply(request, reply)
            continue
        if reply is None:
            raise FuzzBug(f"a good request got no reply in a batch with {requests!r}")
        msgid, err, result = wire.parse_response(reply)
        if msgid != good[index] or err is not None or result.get("instance_info", {}).get("instance_id") != INSTANCE:
            raise FuzzBug(f"a good request was answered {err!r} in a batch with {[r[:80] for r in requests]!r}")
    k.reseed()


TARGETS: dict[str, Callable[[bytes], None]] = {"rpc": check_rpc, "rpc_struct": check_rpc_struct, "events": check_events,
                                               "batch": check_batch}
