"""``kvcm events``: record a live engine's KV-event stream, and decode a recording.

``kvcm events record SOURCE --out FILE`` subscribes to SOURCE (a ZMQ endpoint such as
``tcp://10.0.0.5:5557`` / ``ipc:///run/vllm.pub``, or ``host[:port]``) and writes one JSON line
per PUB message, the format :mod:`kvcm.optimizer.vllm_capture` reads::

    {"ts": <receive time>, "source": str, "seq": int, "topic": str, "payload_b64": str}

With ``--replay ENDPOINT`` it first asks the engine's replay ROUTER for everything buffered
(from seq 0), so a recording can start with the engine's recent history.

``kvcm events decode FILE`` prints each recorded batch decoded (events as JSON), or the error.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import time
from typing import IO, Any

import zmq

from kvcm.engines.sources import tcp_endpoint
from kvcm.proto.kv_events import EventDecodeError, decode_batch, event_to_meaning

END_SEQ = b"\xff" * 8


def add_events_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``events`` (with ``record`` and ``decode``) to an argparse subparsers object."""
    p: argparse.ArgumentParser = subparsers.add_parser("events", help="record or decode vLLM KV-event streams")
    sub = p.add_subparsers(dest="events_cmd", required=True)
    rec = sub.add_parser("record", help="record a live source's raw batches as JSON lines")
    rec.add_argument("source", help="PUB endpoint (tcp://, ipc://) or host[:port] (default port 5557)")
    rec.add_argument("--out", "-o", required=True, help="output file ('-' = stdout)")
    rec.add_argument("--topic", default="", help="SUB topic prefix (default: all)")
    rec.add_argument("--name", help="source name written in each line (default: SOURCE)")
    rec.add_argument("--replay", metavar="ENDPOINT", help="replay ROUTER to fetch buffered batches from first")
    rec.add_argument("--count", type=int, default=0, help="stop after N messages (0 = no limit)")
    rec.add_argument("--duration", type=float, default=0.0, help="stop after S seconds (0 = no limit)")
    rec.add_argument("--replay-timeout", type=float, default=5.0, help="seconds to wait for the replay")
    dec = sub.add_parser("decode", help="print a recording's batches decoded")
    dec.add_argument("file")
    p.set_defaults(func=run_events)
    return p


def run_events(args: argparse.Namespace) -> int:
    if args.events_cmd == "decode":
        return _decode(args.file)
    return _record(args)


def _endpoint(source: str) -> str:
    if "://" in source:
        return source
    host, _, port = source.rpartition(":") if source.count(":") == 1 else (source, "", "")
    return tcp_endpoint(host or source, int(port) if port else 5557)


def _record(args: argparse.Namespace) -> int:
    endpoint = _endpoint(args.source)
    name = args.name or args.source
    out: IO[str] = sys.stdout if args.out == "-" else open(args.out, "a", encoding="utf-8")  # noqa: SIM115
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.IPV6, 1)
    sub.setsockopt(zmq.SUBSCRIBE, args.topic.encode())
    sub.connect(endpoint)
    written = 0
    deadline = time.monotonic() + args.duration if args.duration > 0 else None
    try:
        if args.replay:
            written += _replayed(ctx, args.replay, name, out, args.replay_timeout)
        while (not args.count or written < args.count) and (deadline is None or time.monotonic() < deadline):
            if not sub.poll(100):
                continue
            frames = sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                continue
            _line(out, name, frames[0], frames[1], frames[2])
            written += 1
    except KeyboardInterrupt:
        pass
    finally:
        sub.close(linger=0)
        ctx.term()
        if out is not sys.stdout:
            out.close()
    print(f"recorded {written} batches from {endpoint}", file=sys.stderr)
    return 0


def _replayed(ctx: zmq.Context[Any], endpoint: str, name: str, out: IO[str], timeout: float) -> int:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    n = 0
    try:
        while dealer.poll(int(timeout * 1000)):
            frames = dealer.recv_multipart()[1:]
            topic, rest = (frames[0], frames[1:]) if len(frames) == 3 else (b"", frames)
            if len(rest) != 2 or rest[0] == END_SEQ or not rest[1]:
                break
            _line(out, name, topic, rest[0], rest[1])
            n += 1
    finally:
        dealer.close(linger=0)
    return n


def _line(out: IO[str], name: str, topic: bytes, seq: bytes, payload: bytes) -> None:
    record = {
        "ts": time.time(),
        "source": name,
        "seq": int.from_bytes(seq, "big"),
        "topic": topic.decode("utf-8", "replace"),
        "payload_b64": base64.b64encode(payload).decode(),
    }
    out.write(json.dumps(record) + "\n")
    out.flush()


def _decode(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            try:
                batch = decode_batch(base64.b64decode(rec["payload_b64"]))
                body: dict[str, Any] = {"events": [event_to_meaning(e) for e in batch.events], "errors": batch.errors,
                                        "ts": batch.ts, "data_parallel_rank": batch.data_parallel_rank}  # fmt: skip
            except EventDecodeError as exc:
                body = {"error": str(exc)}
            print(json.dumps({"line": lineno, "source": rec.get("source"), "seq": rec.get("seq"), **body}, default=_hex))
    return 0


def _hex(value: Any) -> Any:
    return value.hex() if isinstance(value, bytes) else str(value)
