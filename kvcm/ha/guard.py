"""What a node under the lease checks before it takes part (``kvcm serve`` with ``ha.enabled``).

The same refusals as a leader stage's start (:func:`kvcm.backends.metastore.redis.check_persistence`,
:meth:`kvcm.backends.metastore.redis.RedisStore.check_start`), made once before the node binds any port, so a
node that could never lead says why at once instead of following until it wins the lease. A
Redis that cannot be reached defers them: the node follows, and its leader stage checks again.
"""

from __future__ import annotations

import logging
import os

import redis

from kvcm.backends.metastore.redis import (
    StoreRecord,
    WriterMark,
    check_persistence,
    identity_refusal,
    redact,
    translate,
)
from kvcm.config import Config
from kvcm.errors import StartRefused, Unavailable

log = logging.getLogger("kvcm.ha")


def check_node_start(client: redis.Redis, config: Config) -> None:
    """Refuse (:class:`StartRefused`) a node whose Redis keeps no AOF (unless
    ``ha.require_aof`` is off), whose data dir's store was lost or is another deployment's, or
    whose prefix a kvcm without the lease writes."""
    cfg = config.store
    where = f"Redis {redact(cfg.redis_url)} (prefix {cfg.redis_prefix})"
    data_dir = os.path.abspath(cfg.data_dir)
    try:
        check_persistence(client, where, refuse=config.ha.require_aof)
        _check_identity(client, cfg.redis_prefix, where, data_dir)
        _check_no_writer(client, cfg.redis_prefix, where)
    except Unavailable as exc:
        log.warning("node %s: start checks deferred to the leader stage: %s", config.ha.node_id, exc.message)


def _check_identity(client: redis.Redis, prefix: str, where: str, data_dir: str) -> None:
    try:
        raw = client.get(f"{{{prefix}}}:deployment")
    except redis.RedisError as exc:
        raise translate(exc) from None
    stored = None if raw is None else raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    refusal = identity_refusal(stored, StoreRecord.read(data_dir), prefix, where, data_dir)
    if refusal is not None:
        raise refusal


def _check_no_writer(client: redis.Redis, prefix: str, where: str) -> None:
    try:
        raw = client.get(f"{{{prefix}}}:writer")
    except redis.RedisError as exc:
        raise translate(exc) from None
    if raw is None:
        return
    held = WriterMark.decode(raw)
    who = held.describe() if held is not None else str(raw)
    raise StartRefused(f"store.redis_prefix {prefix} on {where} is written by a kvcm without ha.enabled ({who}): "
                       "nodes under the lease would write beside it; stop it first (if it is gone, its mark "
                       "expires within seconds)")


__all__ = ["check_node_start"]
