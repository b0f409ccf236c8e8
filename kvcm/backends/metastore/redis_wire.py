"""The Redis store's hot commands, sent on redis-py's own pooled connections without its
per-command layers.

A group commit is one ``EVALSHA``; a write transaction's reads are ``HGET`` / ``HMGET``. Through
``Redis.execute_command`` each costs about 30 µs of CPU besides the socket work (every argument
encoded on its own, observability hooks, the response-callback lookup), measured at a tenth of a
start+finish pair's CPU on a Redis node. Here the arguments are packed at once (hiredis, when
installed) and the raw reply is read back. Everything else stays redis-py's: the pool, auth, TLS,
timeouts and the connection's retry policy (a connection that fails is dropped before the retry,
as ``execute_command`` does). Replies are what ``execute_command`` returns for these commands:
they have no response callbacks and the store's connections do not decode.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.commands.core import Script

Arg = bytes | str | int


def _hiredis_packer() -> Callable[[tuple[Arg, ...]], bytes] | None:
    try:
        import hiredis
    except ImportError:
        return None
    packer: Callable[[tuple[Arg, ...]], bytes] | None = getattr(hiredis, "pack_command", None)
    return packer


_PACK = _hiredis_packer()


class Wire:
    """``command`` / ``evalsha`` on ``client``'s pool; errors are redis-py's own exceptions."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self._pool = client.connection_pool

    def command(self, *args: Arg) -> Any:
        pool = self._pool
        conn: Any = pool.get_connection()  # no command name: redis-py >= 5.3 (pyproject); typed loosely there
        try:
            packed = [_PACK(args)] if _PACK is not None else conn.pack_command(*args)
            return conn.retry.call_with_retry(lambda: _exchange(conn, packed), lambda _error: conn.disconnect())
        finally:
            pool.release(conn)

    def evalsha(self, script: Script, keys: Sequence[bytes], args: Sequence[Arg]) -> Any:
        """``script`` on its SHA; loaded first when the server does not know it (a restart
        without persistence, a failover to a replica that never saw it), as ``Script`` does."""
        try:
            return self.command(b"EVALSHA", script.sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            script.sha = self._client.script_load(script.script)
            return self.command(b"EVALSHA", script.sha, len(keys), *keys, *args)


def _exchange(conn: Any, packed: list[bytes]) -> Any:
    conn.send_packed_command(packed)
    return conn.read_response()
