"""Tair's enums: read by name or by number, printed by name, each value's kvcm equivalent.

What each Tair value means in kvcm (``ST_NFS`` is ``file``, ``POLICY_LRU`` is ``lru``) is in the
tables here.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvcm.errors import InvalidArgument
from kvcm.proto.tair.fields import show
from kvcm.proto.wire import Decoded


class Enum:
    """One Tair enum: names, numbers, and the kvcm value of each (None: no kvcm equivalent).
    ``out`` picks the Tair name for a kvcm value where several Tair names share it."""

    def __init__(self, name: str, values: Mapping[str, tuple[int, str | None]],
                 out: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.values = dict(values)
        self.by_number = {number: key for key, (number, _) in values.items()}
        self.to_kvcm_value = {key: kvcm for key, (_, kvcm) in values.items()}
        self.from_kvcm_value = {kvcm: key for key, (_, kvcm) in reversed(list(values.items())) if kvcm is not None}
        self.from_kvcm_value.update(out or {})

    def parse(self, value: Decoded, where: str) -> str:
        """The Tair name of an input value (a name or a number); null is the zero value."""
        if value is None:
            return self.by_number[0]
        if type(value) is int and value in self.by_number:
            return self.by_number[value]
        if isinstance(value, str) and value in self.values:
            return value
        raise InvalidArgument(f"{where}: {show(value)} is not a {self.name} (one of {', '.join(self.values)})")

    def to_kvcm(self, value: Decoded, where: str) -> str | None:
        """The kvcm value of an input value; None for the zero value (unset)."""
        name = self.parse(value, where)
        kvcm = self.to_kvcm_value[name]
        if kvcm is None and self.values[name][0] != 0:
            raise InvalidArgument(f"{where}: {name} is not supported by kvcm (docs/tair.md)")
        return kvcm

    def out(self, kvcm: Decoded) -> str:
        return self.from_kvcm_value.get(kvcm, self.by_number[0]) if isinstance(kvcm, str) else self.by_number[0]


#: kvcm-only values get numbers from 101 up, clear of Tair's, and a KVCM in their name.
STORAGE_TYPE = Enum("StorageType", {
    "ST_UNSPECIFIED": (0, None), "ST_3FS": (1, "3fs"), "ST_MOONCAKE": (2, "mooncake"),
    "ST_TAIRMEMPOOL": (3, "tairmempool"), "ST_NFS": (4, "file"), "ST_VCNS_3FS": (5, "3fs"),
    "ST_DUMMY": (6, None), "ST_EVENT_REPORT_L1P5": (7, None), "ST_EVENT_REPORT_L2": (8, None),
    "ST_TAIRMEMPOOL_SSD": (9, "tairmempool"), "ST_KVCM_SHM": (101, "shm"),
}, out={"3fs": "ST_3FS", "tairmempool": "ST_TAIRMEMPOOL", "unspecified": "ST_UNSPECIFIED"})

QUERY_TYPE = Enum("QueryType", {
    "QT_UNSPECIFIED": (0, None), "QT_BATCH_GET": (1, "batch_get"), "QT_PREFIX_MATCH": (2, "prefix_match"),
    "QT_REVERSE_ROLL_SW_MATCH": (3, "reverse_roll_sw_match"), "QT_PREFIX_MATCH_WITH_MAMBA": (4, None),
})

TRIM_STRATEGY = Enum("TrimStrategy", {
    "TS_UNSPECIFIED": (0, None), "TS_REMOVE_ALL_CACHE": (1, "remove_all_cache"),
    "TS_REMOVE_ALL_META": (2, "remove_all_meta"), "TS_TIMESTAMP": (3, "timestamp"),
})

RECLAIM_POLICY = Enum("ReclaimPolicy", {
    "POLICY_UNSPECIFIED": (0, None), "POLICY_LRU": (1, "lru"), "POLICY_LFU": (2, "lfu"), "POLICY_TTL": (3, "ttl"),
    "POLICY_KVCM_LEAF_LRU": (101, "leaf_lru"),
})

ACCOUNT_ROLE = Enum("AccountRole", {"ROLE_USER": (0, "user"), "ROLE_ADMIN": (1, "admin")})

#: Tair's write-placement hint; accepted and not used (kvcm writes in storage_candidates order).
CACHE_PREFER_STRATEGY = Enum("CachePreferStrategy", {name: (i, "") for i, name in enumerate((
    "CPS_UNSPECIFIED", "CPS_ALWAYS_3FS", "CPS_PREFER_3FS", "CPS_ALWAYS_MOONCAKE", "CPS_PREFER_MOONCAKE",
    "CPS_ALWAYS_TAIR_MEMPOOL", "CPS_PREFER_TAIR_MEMPOOL", "CPS_ALWAYS_VCNS_3FS", "CPS_PREFER_VCNS_3FS",
    "CPS_ALWAYS_TAIR_MEMPOOL_SSD", "CPS_PREFER_TAIR_MEMPOOL_SSD"))})

#: The kvcm ``report_events`` op of each Tair event type; adds and deletes share one (``events``).
REPORT_EVENT_TYPE = Enum("ReportEventType", {
    "EVENT_UNSPECIFIED": (0, None), "EVENT_NODE_REGISTER": (1, "register"), "EVENT_BLOCK_ADD": (2, "events"),
    "EVENT_BLOCK_DELETE": (3, "events"), "EVENT_HOST_DOWN": (4, "down"), "EVENT_HEARTBEAT": (5, "heartbeat"),
    "EVENT_BLOCK_SNAPSHOT": (6, "snapshot"),
})
