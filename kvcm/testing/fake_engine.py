"""A fake vLLM KV-event publisher with real sockets, for router and subscriber tests.

:class:`FakeEnginePublisher` binds a PUB socket and (optionally) a replay ROUTER exactly as
vLLM's ``ZmqEventPublisher`` does: ``[topic, seq(8B BE), payload]`` messages, replay answered with
``[topic, seq, payload]`` frames (or the legacy 2-frame ``[seq, payload]``) and the ``-1`` end
marker. On top of that it can be scripted: drop messages (they still enter the replay buffer, so
a subscriber must heal the gap by replay), die and come back on the same endpoints, restart like
a new engine process (seq back to 0, empty buffer), send garbage, or never answer replay.

Example::

    with FakeEnginePublisher() as pub:          # tcp://127.0.0.1:<random> PUB + ROUTER
        pub.store([1, 2], token_ids=list(range(32)), block_size=16)
        pub.remove([2])

Thread ownership: the public methods may be called from any thread; a small daemon thread
serves replay requests. Both use the sockets under one lock (ZMQ sockets may move between
threads across a full memory barrier, which the lock provides).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import zmq

from kvcm.proto.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    ExternalBlockHash,
    encode_batch,
)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
REPLAY_STYLES = ("topic", "legacy", "silent")


class FakeEnginePublisher:
    """A scriptable vLLM-compatible publisher (see the module docstring).

    :param endpoint: PUB endpoint to bind; ``None`` binds ``tcp://127.0.0.1:*``.
    :param replay_endpoint: ROUTER endpoint; ``None`` binds a random TCP port, ``""`` disables replay.
    :param encoding: ``map`` (default), ``array`` or ``mixed`` (see ``kvcm.proto.kv_events``).
    :param replay_style: ``topic`` (3-frame replies, vLLM >= 0.26), ``legacy`` (2-frame), or
        ``silent`` (requests are read and never answered).
    """

    def __init__(
        self,
        endpoint: str | None = None,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        encoding: str = "map",
        replay_style: str = "topic",
        data_parallel_rank: int | None = 0,
        buffer_steps: int = 10_000,
    ) -> None:
        if replay_style not in REPLAY_STYLES:
            raise ValueError(f"replay_style must be one of {REPLAY_STYLES}")
        self.topic = topic.encode()
        self.encoding = encoding
        self.replay_style = replay_style
        self.data_parallel_rank = data_parallel_rank
        self._want_endpoint = endpoint or "tcp://127.0.0.1:*"
        self._want_replay = "tcp://127.0.0.1:*" if replay_endpoint is None else replay_endpoint
        self.endpoint = ""
        self.replay_endpoint = ""
        self.seq = 0
        self.replay_requests: list[int] = []
        self._drop = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._ctx = zmq.Context()
        self._lock = threading.Lock()
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.Socket[bytes] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.start()

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> FakeEnginePublisher:
        """Bind (again, on the same endpoints after :meth:`stop`) and serve replay."""
        with self._lock:
            if self._pub is not None:
                return self
            self._pub = self._bind(zmq.PUB, self.endpoint or self._want_endpoint)
            self.endpoint = self._last_endpoint(self._pub)
            if self._want_replay:
                self._router = self._bind(zmq.ROUTER, self.replay_endpoint or self._want_replay)
                self.replay_endpoint = self._last_endpoint(self._router)
        self._stop.clear()
        self._thread = threading.Thread(target=self._serve, name="fake-engine-replay", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Die: close the sockets, keep seq and buffer (``start()`` brings the same engine back)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        with self._lock:
            for sock in (self._pub, self._router):
                if sock is not None:
                    sock.close(linger=0)
            self._pub = self._router = None

    def restart(self) -> None:
        """Restart like a new engine process: seq back to 0, empty replay buffer, same endpoints."""
        self.stop()
        self.seq = 0
        self._buffer.clear()
        self.start()

    def close(self) -> None:
        self.stop()
        self._ctx.term()

    def __enter__(self) -> FakeEnginePublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- publishing -------------------------------------------------------------------------------

    def drop_next(self, n: int) -> None:
        """The next ``n`` batches get a seq and enter the replay buffer but are not sent (a gap)."""
        self._drop += n

    def publish(self, events: Sequence[Event], *, ts: float | None = None) -> int:
        """Publish one batch; returns its seq."""
        payload = encode_batch(
            events, time.time() if ts is None else ts, self.data_parallel_rank, self.encoding
        )
        return self.publish_raw(payload)

    def publish_raw(self, payload: bytes) -> int:
        """Publish any bytes as a batch payload (for garbage tests); returns its seq."""
        with self._lock:
            seq = self.seq
            self.seq += 1
            self._buffer.append((seq, payload))
            if self._drop > 0:
                self._drop -= 1
            elif self._pub is not None:
                self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def store(
        self,
        block_hashes: Sequence[ExternalBlockHash],
        token_ids: Sequence[int] = (),
        *,
        parent: ExternalBlockHash | None = None,
        block_size: int = 16,
        medium: str | None = "GPU",
        lora_name: str | None = None,
        group_idx: int | None = None,
        extra_keys: Sequence[object] | None = None,
        **extra: Any,
    ) -> int:
        """Publish one ``BlockStored`` (a batch of one event). ``extra_keys``: one entry per
        block, as vLLM sends them: None, or a tuple such as ``("my-lora", ("<image hash>", -6),
        "<salt>")`` (:func:`kvcm.proto.extra_keys.derive` makes them by vLLM's rule). Without them, a
        ``lora_name`` is sent as vLLM did before it sent extra keys."""
        event = BlockStored(
            list(block_hashes), parent, list(token_ids), block_size, medium=medium, lora_name=lora_name,
            extra_keys=None if extra_keys is None else list(extra_keys), group_idx=group_idx, **extra,
        )  # fmt: skip
        return self.publish([event])

    def remove(
        self, block_hashes: Sequence[ExternalBlockHash], medium: str | None = "GPU", group_idx: int | None = None
    ) -> int:
        return self.publish([BlockRemoved(list(block_hashes), medium, group_idx)])

    def clear(self) -> int:
        return self.publish([AllBlocksCleared()])

    # --- replay -----------------------------------------------------------------------------------

    def _serve(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                router = self._router
                if router is None:
                    return
                if router.poll(0):
                    self._answer(router.recv_multipart())
                    continue
            time.sleep(0.005)

    def _answer(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            return  # vLLM logs "Invalid replay request" and ignores it
        start = int.from_bytes(frames[2], "big")
        self.replay_requests.append(start)
        if self.replay_style == "silent" or self._router is None:
            return
        ident = frames[0]
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._router.send_multipart(self._frame(ident, seq.to_bytes(8, "big"), payload))
        self._router.send_multipart(self._frame(ident, END_SEQ, b""))

    def _frame(self, ident: bytes, seq: bytes, payload: bytes) -> list[bytes]:
        if self.replay_style == "legacy":
            return [ident, b"", seq, payload]
        return [ident, b"", self.topic if payload else b"", seq, payload]

    # --- helpers ------------------------------------------------------------------------------------

    def _bind(self, kind: int, endpoint: str) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if endpoint.startswith("tcp://[") or "::" in endpoint:
            sock.setsockopt(zmq.IPV6, 1)
        # libzmq closes sockets asynchronously: rebinding the port we just closed (stop/start,
        # restart) can briefly fail with EADDRINUSE.
        deadline = time.monotonic() + 5.0
        while True:
            try:
                sock.bind(endpoint)
                return sock
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    sock.close(linger=0)
                    raise
                time.sleep(0.02)

    @staticmethod
    def _last_endpoint(sock: zmq.Socket[bytes]) -> str:
        raw = sock.getsockopt(zmq.LAST_ENDPOINT)
        return raw.decode() if isinstance(raw, bytes) else str(raw)
