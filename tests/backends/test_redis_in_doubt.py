"""A commit whose outcome Redis cannot tell (the connection died around it and Redis stayed
unreachable): neither its callbacks nor its aborts run until Redis answers again, the store
refuses every write meanwhile, and then exactly the true side runs (the first read or write
that reaches Redis settles it). A real redis-server behind a
real TCP proxy the test cuts."""

from __future__ import annotations

import socket
import threading
import uuid

import pytest

from kvcm.backends.metastore.redis import InDoubt, RedisStore
from kvcm.errors import Code, Unavailable
from tests.helpers import hard_close


class CuttingProxy:
    """Forwards TCP to Redis. ``cut(at)`` arms it: the next chunk in direction ``at`` ("request":
    client to Redis, dropped; "reply": Redis to client, dropped after the request went through)
    closes every connection, and new ones are refused until ``restore()``."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.armed: str | None = None
        self.refusing = False
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self, at: str) -> None:
        self.armed = at

    def restore(self) -> None:
        self.refusing = False

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.refusing:
                client.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target))
            with self.lock:
                self.conns += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, "request"), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, "reply"), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                return
            if not data:
                return
            if self.armed == direction and (direction == "reply" or b"EVALSHA" in data or b"EVAL" in data):
                self.armed = None
                self.refusing = True
                self._close_all()
                return
            try:
                dst.sendall(data)
            except OSError:
                return

    def _close_all(self) -> None:
        with self.lock:
            conns, self.conns = self.conns, []
        for conn in conns:
            hard_close(conn)

    def close(self) -> None:
        self.listener.close()
        self._close_all()


@pytest.fixture
def proxied(redis_server):
    proxy = CuttingProxy(redis_server.port)
    store = RedisStore(f"redis://127.0.0.1:{proxy.port}/0", None, prefix=f"d{uuid.uuid4().hex[:10]}")
    with store.write() as txn:  # the commit script is loaded before any cut
        txn.put("meta", b"warm", b"1")
    yield proxy, store
    store.close()
    proxy.close()


@pytest.mark.parametrize(("cut", "applied"), [("reply", True), ("request", False)])
def test_a_commit_in_doubt_runs_its_true_side_once_redis_can_tell(proxied, cut, applied):
    proxy, store = proxied
    ran: list[str] = []
    proxy.cut(cut)
    with pytest.raises(InDoubt) as info, store.write() as txn:
        txn.on_commit(lambda: ran.append("commit"))
        txn.on_abort(lambda: ran.append("abort"))  # e.g. storage slots given back
        txn.put("blocks", b"k", b"v")
    assert info.value.code == Code.SERVICE_NOT_READY and "outcome unknown" in info.value.message
    assert ran == []  # neither side: a slot given back while Redis holds it would be handed out twice
    with pytest.raises(Unavailable, match="still in doubt"):
        store.write().__enter__()
    with pytest.raises(Unavailable, match="unavailable"), store.read() as view:  # a read that needs Redis
        view.get("blocks", b"k")
    assert ran == []
    proxy.restore()
    with store.read() as view:
        assert (view.get("blocks", b"k") == b"v") is applied
    assert ran == (["commit"] if applied else ["abort"])
    with store.write() as txn:  # and the store goes on as before
        txn.put("blocks", b"k2", b"v2")
    assert ran == (["commit"] if applied else ["abort"])


def test_a_group_opened_before_the_doubt_settles_it_before_its_own_commit(proxied):
    """Its commit would overwrite the marker that tells whether the doubtful one was applied."""
    proxy, store = proxied
    ran: list[str] = []

    def doubtful() -> None:
        proxy.cut("reply")
        with pytest.raises(InDoubt), store.write() as txn:
            txn.on_commit(lambda: ran.append("commit"))
            txn.on_abort(lambda: ran.append("abort"))
            txn.put("blocks", b"k", b"v")

    with store.group():  # opened (no write yet) before another thread's commit goes in doubt
        worker = threading.Thread(target=doubtful)
        worker.start()
        worker.join()
        proxy.restore()
        with store.write() as txn:
            txn.put("blocks", b"mine", b"1")
    assert ran == ["commit"]
    with store.read() as view:
        assert view.get("blocks", b"k") == b"v" and view.get("blocks", b"mine") == b"1"
