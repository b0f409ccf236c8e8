"""What the Redis store keeps in Redis: its keys, and the Lua scripts that read and change them.

Each named database is a hash of values (``{P}:h:<db>``) plus a sorted set of its keys with
every score 0 (``{P}:z:<db>``), so ``ZRANGEBYLEX`` walks them in byte order for ``scan``.
``{P}:epoch`` is the fencing epoch and ``{P}:commit`` the id of the last commit. Every key
carries one hash tag ``{P}`` (``store.redis_prefix``), so a Redis Cluster keeps all of one
kvcm's keys on one slot (multi-key scripts need that) and deployments with different prefixes
share one Redis.

A commit is ONE script call: Redis runs a script atomically, and the script checks the fencing
token, the deployment and the type of every key it will touch *before* its first write,
because Redis does not undo the writes of a script that fails midway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from kvcm.backends.metastore.base import DATABASES

# KEYS: epoch, commit marker, versions, deployment, then (hash, zset) per database touched.
# ARGV: fencing token ("" = none), commit id, deployment id ("" = unchecked), then per database:
# #puts, #deletes, k, v, ..., k, ...
# Each database touched counts one more version (field: its hash key), so a follower knows what
# it must reload or forget with one HMGET. The deployment key is checked like the fencing token:
# a Redis that lost it (restarted without persistence, flushed) lost this kvcm's metadata, and a
# write there would build a second, partial store under the same prefix.
COMMIT = """
local token = ARGV[1]
if token ~= '' then
  local epoch = tonumber(redis.call('GET', KEYS[1]) or '0')
  if epoch == nil or epoch > tonumber(token) then
    return redis.error_reply('KVCMFENCED ' .. tostring(redis.call('GET', KEYS[1])))
  end
end
if ARGV[3] ~= '' then
  local stored = redis.call('GET', KEYS[4])
  if stored ~= ARGV[3] then
    return redis.error_reply('KVCMLOST ' .. (stored or ''))
  end
end
for i = 5, #KEYS, 2 do
  local h = redis.call('TYPE', KEYS[i])['ok']
  local z = redis.call('TYPE', KEYS[i + 1])['ok']
  if (h ~= 'none' and h ~= 'hash') or (z ~= 'none' and z ~= 'zset') then
    return redis.error_reply('KVCMTYPE ' .. KEYS[i] .. ' is ' .. h .. ', ' .. KEYS[i + 1] .. ' is ' .. z)
  end
end
local a = 4
for i = 5, #KEYS, 2 do
  local h, z = KEYS[i], KEYS[i + 1]
  redis.call('HINCRBY', KEYS[3], h, 1)
  local nput, ndel = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  a = a + 2
  for j = a, a + 2 * nput - 1, 2 do
    redis.call('HSET', h, ARGV[j], ARGV[j + 1])
    redis.call('ZADD', z, 0, ARGV[j])
  end
  a = a + 2 * nput
  for j = a, a + ndel - 1 do
    redis.call('HDEL', h, ARGV[j])
    redis.call('ZREM', z, ARGV[j])
  end
  a = a + ndel
end
redis.call('SET', KEYS[2], ARGV[2])
return 1
"""

# KEYS: zset, hash. ARGV: min, max, count. One round trip for a page of keys and their values.
SCAN = """
local keys = redis.call('ZRANGEBYLEX', KEYS[1], ARGV[1], ARGV[2], 'LIMIT', 0, tonumber(ARGV[3]))
if #keys == 0 then return {{}, {}} end
return {keys, redis.call('HMGET', KEYS[2], unpack(keys))}
"""

# KEYS: zset, hash. ARGV: ranks. The members at those ranks (all scores are 0: rank = byte order).
AT_RANKS = """
local keys = {}
for i = 1, #ARGV do
  local got = redis.call('ZRANGE', KEYS[1], ARGV[i], ARGV[i])
  if got[1] then keys[#keys + 1] = got[1] end
end
if #keys == 0 then return {{}, {}} end
return {keys, redis.call('HMGET', KEYS[2], unpack(keys))}
"""

# KEYS: deployment, writer mark. ARGV: deployment id, this process's writer mark ("" = not the
# writer), the mark's TTL in ms. {stored deployment, the mark now held}. The mark is refreshed only
# while the store is still this deployment's: a lost store gets no new key from a watcher.
WATCH = """
local stored = redis.call('GET', KEYS[1]) or ''
if ARGV[2] == '' or stored ~= ARGV[1] then return {stored, ''} end
local held = redis.call('GET', KEYS[2])
if not held or held == ARGV[2] then
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
  return {stored, ARGV[2]}
end
return {stored, held}
"""

# KEYS: writer mark. ARGV: this process's mark. Compare-and-delete (a clean stop).
DROP_MARK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

#: One transaction's changes to one database: key -> new value, or None to delete it.
Layer: TypeAlias = dict[bytes, bytes | None]
#: A write transaction's changes, per database name.
Overlay: TypeAlias = dict[str, Layer]


@dataclass(frozen=True)
class Keys:
    """Every key of one prefix ``P`` (see the module docstring)."""

    hash: dict[str, bytes]  # database name -> {P}:h:<db>
    zset: dict[str, bytes]  # database name -> {P}:z:<db>
    epoch: bytes
    commit: bytes
    versions: bytes
    deployment: bytes
    writer: bytes
    leader: bytes  # the lease's (kvcm.ha.lease), read here only

    @classmethod
    def of(cls, prefix: str) -> Keys:
        tag = "{" + prefix + "}"
        return cls(
            hash={name: f"{tag}:h:{name}".encode() for name in DATABASES},
            zset={name: f"{tag}:z:{name}".encode() for name in DATABASES},
            epoch=f"{tag}:epoch".encode(), commit=f"{tag}:commit".encode(),
            versions=f"{tag}:versions".encode(), deployment=f"{tag}:deployment".encode(),
            writer=f"{tag}:writer".encode(), leader=f"{tag}:leader".encode(),
        )


def commit_input(keys: Keys, overlay: Overlay) -> tuple[list[bytes], list[bytes | int]]:
    """The :data:`COMMIT` script's KEYS and ARGV past its fixed ones, for ``overlay``."""
    script_keys: list[bytes] = []
    args: list[bytes | int] = []
    for db, layer in overlay.items():
        if not layer:
            continue
        puts, dels = _flatten(layer)
        script_keys += (keys.hash[db], keys.zset[db])
        args += (len(puts) // 2, len(dels), *puts, *dels)
    return script_keys, args


def _flatten(layer: Layer) -> tuple[list[bytes], list[bytes]]:
    puts: list[bytes] = []
    dels: list[bytes] = []
    for key, value in layer.items():
        if value is None:
            dels.append(key)
        else:
            puts += (key, value)
    return puts, dels


def upper(prefix: bytes) -> bytes | None:
    """The first key past every key with ``prefix`` (None: no such key, the range is open)."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return None
    return stripped[:-1] + bytes([stripped[-1] + 1])
