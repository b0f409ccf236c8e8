"""kvcm's own block events, published exactly like a vLLM engine publishes its KV events.

Any consumer of vLLM KV events (Dynamo, llm-d, AIBrix, kvcm's own subscriber) can subscribe to
kvcm: PUB frames ``[topic, seq(8B BE), payload]`` with ``KVEventBatch`` payloads (map shape by
default, ``array``/``mixed`` on request) and a replay ROUTER answering ``[b"", start_seq]`` with
``[topic, seq, payload]`` frames and the ``[b"", -1, b""]`` end marker (vLLM >= 0.26).

What is published: storage-tier blocks becoming ``serving`` (``BlockStored``), removed or trimmed
(``BlockRemoved``), and an instance wiped (``AllBlocksCleared``). Block hashes are kvcm's block
keys as unsigned 64-bit ints (vLLM's int mode), ``medium`` is what the caller names (the storage
type, e.g. ``FILE``), and each map-shaped event carries an extra ``instance_id`` key (unknown keys
are ignored by vLLM-style decoders). Note that a consumer treating kvcm as one "engine" applies
``AllBlocksCleared`` to everything it got from kvcm; filter on ``instance_id`` to avoid that.

If the queue between the data plane and this thread is full, events are dropped, counted, and
one sequence number is skipped, so consumers see a gap instead of silently diverging.

CURVE: given ``context`` (the server's CURVE context, whose ZAP handler decides which client keys
get in) and ``socket_setup`` (which makes a socket a CURVE server), both sockets are encrypted;
the context then belongs to the caller and is not terminated here.

Thread ownership: the sink methods (:meth:`block_stored`, :meth:`block_removed`,
:meth:`all_cleared`) only enqueue and may be called from any thread; the sockets belong to the
thread running :meth:`poll_once` (the publisher thread started by :meth:`start`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import zmq
from prometheus_client import CollectorRegistry, Counter

from kvcm.proto.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, Event, encode_batch

log = logging.getLogger("kvcm.publish.publisher")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_M64 = (1 << 64) - 1
_MAX_BATCH = 1024  # events per published batch


class EventPublisher:
    """PUB + replay ROUTER for kvcm's storage-tier events (see the module docstring)."""

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:5567",
        replay_endpoint: str | None = "tcp://127.0.0.1:5568",
        *,
        topic: str = "kvcm",
        buffer_steps: int = 10_000,
        encoding: str = "map",
        max_queue: int = 100_000,
        registry: CollectorRegistry | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        socket_setup: Callable[[zmq.Socket[bytes]], None] | None = None,
    ) -> None:
        self.topic = topic.encode()
        self.encoding = encoding
        self.seq = 0
        self._queue: queue.Queue[tuple[Event, str]] = queue.Queue(max_queue)
        self._dropped = 0
        self._drop_lock = threading.Lock()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._own_ctx = context is None
        self._ctx = zmq.Context() if context is None else context
        self._socket_setup = socket_setup
        self._pub = self._bind(zmq.PUB, endpoint)
        self._router = self._bind(zmq.ROUTER, replay_endpoint) if replay_endpoint else None
        self.endpoint = _last(self._pub)
        self.replay_endpoint = _last(self._router) if self._router is not None else None
        r = registry if registry is not None else CollectorRegistry()
        self.published = Counter("kvcm_publisher_events", "Block events published, by type", ["event_type"], registry=r)
        self.dropped = Counter("kvcm_publisher_dropped_events", "Events dropped (queue full)", registry=r)
        self.replays = Counter("kvcm_publisher_replays", "Replay requests answered", registry=r)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _bind(self, kind: int, endpoint: str) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if "[" in endpoint or "::" in endpoint:
            sock.setsockopt(zmq.IPV6, 1)
        try:
            if self._socket_setup is not None:
                self._socket_setup(sock)
            sock.bind(endpoint)
        except zmq.ZMQError:
            sock.close(linger=0)
            self._pub_close_all()
            raise
        return sock

    def _pub_close_all(self) -> None:
        """A failed bind in the constructor: close what exists so the context can terminate."""
        for name in ("_pub", "_router"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close(linger=0)
        if self._own_ctx:
            self._ctx.term()

    # --- the sink (any thread) ------------------------------------------------------------------

    def block_stored(
        self,
        instance_id: str,
        keys: Sequence[int],
        parent: int | None = None,
        token_ids: Sequence[int] = (),
        block_size: int = 0,
        medium: str | None = "STORAGE",
    ) -> None:
        """Blocks became serving: ``keys`` consecutive, ``parent`` the key before them (or None)."""
        if keys:
            hashes: list[int | bytes] = [k & _M64 for k in keys]
            event = BlockStored(hashes, None if parent is None else parent & _M64, list(token_ids), block_size, None, medium, None)
            self._put(event, instance_id)

    def block_removed(self, instance_id: str, keys: Sequence[int], medium: str | None = "STORAGE") -> None:
        if keys:
            self._put(BlockRemoved([k & _M64 for k in keys], medium), instance_id)

    def all_cleared(self, instance_id: str) -> None:
        self._put(AllBlocksCleared(), instance_id)

    def _put(self, event: Event, instance_id: str) -> None:
        try:
            self._queue.put_nowait((event, instance_id))
        except queue.Full:
            with self._drop_lock:
                self._dropped += 1
            self.dropped.inc()

    # --- the loop (publisher thread) --------------------------------------------------------------

    def poll_once(self, timeout: float = 0.01) -> int:
        """Answer pending replay requests, then publish what was queued; returns events published."""
        if self._router is not None and self._router.poll(int(timeout * 1000)):
            self._serve_replays()
        elif self._router is None and timeout > 0:
            self._stop.wait(timeout)
        return self._publish_queued()

    def _publish_queued(self) -> int:
        total = 0
        while True:
            items: list[tuple[Event, str]] = []
            while len(items) < _MAX_BATCH:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if not items:
                return total
            self._send([e for e, _ in items], [{"instance_id": i} for _, i in items])
            total += len(items)

    def _send(self, events: list[Event], extras: list[dict[str, Any]]) -> None:
        with self._drop_lock:
            dropped, self._dropped = self._dropped, 0
        if dropped:
            self.seq += 1  # a visible gap: consumers must not assume they saw everything
        payload = encode_batch(events, time.time(), 0, self.encoding, extras)  # one "rank", like vLLM
        seq = self.seq
        self.seq += 1
        self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        self._buffer.append((seq, payload))
        for event in events:
            self.published.labels(type(event).__name__).inc()

    def _serve_replays(self) -> None:
        assert self._router is not None
        for _ in range(64):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                continue  # like vLLM: an invalid replay request gets no answer
            ident, start = frames[0], int.from_bytes(frames[2], "big")
            self.replays.inc()
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._router.send_multipart([ident, b"", self.topic, seq.to_bytes(8, "big"), payload])
            self._router.send_multipart([ident, b"", b"", END_SEQ, b""])

    # --- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvcm-publisher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once(0.01)
            except Exception:
                log.exception("event publisher iteration failed")
                self._stop.wait(0.1)

    def stop(self, timeout: float = 5.0) -> None:
        """Idempotent: publish what is queued, close the sockets."""
        if self._stop.is_set() and self._pub.closed:
            return
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)
        if not self._pub.closed:
            self._publish_queued()
            for sock in (self._pub, self._router):
                if sock is not None:
                    sock.close(linger=0)
            if self._own_ctx:
                self._ctx.term()


def _last(sock: zmq.Socket[bytes] | None) -> str:
    if sock is None:
        return ""
    raw = sock.getsockopt(zmq.LAST_ENDPOINT)
    return raw.decode() if isinstance(raw, bytes) else str(raw)
