"""Configuration: frozen dataclasses with every default in one place.

Sources, lowest precedence first: the defaults below < a TOML file (``--config``) < environment
variables ``KVCM_<SECTION>_<KEY>`` (e.g. ``KVCM_SERVER_ENDPOINT``) < command-line overrides
(``--set section.key=value`` and the dedicated flags of ``kvcm serve``). This module is the only
place that reads ``os.environ`` for settings. Unknown keys and bad values fail at start-up with a
:class:`ConfigError` that names the key.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias, TypedDict
from urllib.parse import urlsplit

from kvcm.proto.schema import KEYS_CEILING, TOKENS_CEILING

if TYPE_CHECKING:
    from typing_extensions import Unpack

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


class ConfigError(ValueError):
    """A setting is unknown or has a bad value; the message names it."""


@dataclass(frozen=True)
class ServerConfig:
    endpoint: str = "tcp://127.0.0.1:6381"  # the msgpack-RPC ROUTER endpoint (tcp:// or ipc://)
    max_message_bytes: int = 4 << 20  # larger requests get MESSAGE_TOO_LARGE
    max_keys: int = 131072  # keys per request (block_keys, or token_ids / block_size); more gets TOO_MANY_KEYS
    max_tokens: int = 524288  # token_ids per request; more gets TOO_MANY_KEYS
    max_reply_bytes: int = 16 << 20  # a request whose reply would be larger gets TOO_LARGE
    turn_budget_ms: float = 50.0  # work per loop turn before heavy requests wait for the next turn
    defer_timeout_s: float = 30.0  # a request carried over loop turns this long is answered TIMEOUT
    refusal_hold_ms: float = 100.0  # a refused request of 16 KB or more (its sender's fault) is answered this much later; 0 = at once
    curve_secret_key_file: str = ""  # CURVE: this server's key pair (kvcm keys generate); "" = plaintext
    curve_allowed_clients_dir: str = ""  # CURVE: directory of allowed client public keys ("" = any key)
    drain_max: int = 256  # requests handled per wake-up (they share one commit)
    poll_ms: int = 100  # poll timeout: bounds timer lag and shutdown latency
    group_commit: bool = True  # share one LMDB commit among the requests of one wake-up
    hash_kernel: str = "python"  # python | numba: hash token ids into block keys compiled (pip install 'kvcm[fast]')
    shutdown_grace_s: float = 10.0  # SIGTERM: time allowed to drain in-flight requests
    live_after_s: float = 10.0  # /livez fails once the RPC loop has not turned for this long
    sndhwm: int = 10000  # per-peer reply queue; a peer over it loses replies (counted)
    access_log: bool = False  # one log line per request at INFO
    standby: bool = False  # shorthand: ha.enabled on one host, ha.coordination = file://<store.data_dir>


@dataclass(frozen=True)
class HttpConfig:
    enabled: bool = True  # serve the side HTTP port
    host: str = "127.0.0.1"  # bind address of the side HTTP port
    port: int = 6382  # /metrics, /livez, /readyz, POST /api/<method>; 0 picks a free port
    allowed_hosts: tuple[str, ...] = ()  # extra Host names ("name" any port, "name:port") besides the bound address
    read_timeout_s: float = 10.0  # a whole request (line, headers, body) must arrive within this
    idle_timeout_s: float = 5.0  # a kept-alive connection with no new request is closed after this
    max_connections: int = 64  # open connections (one thread each); more get 503 and are closed
    max_connections_per_peer: int = 16  # open connections from one remote address; more get 503 and are closed
    max_unauthenticated_body_bytes: int = 65536  # auth on: a larger /api body needs Authorization: Bearer (checked before reading)
    suspect_after_failures: int = 10  # refusals for credentials within a second that make an address a suspect (10 s)
    suspect_connections_per_s: float = 5.0  # a suspect address's new connections are served at most this often
    allow_unauthenticated_with_curve: bool = False  # serve with auth off although a CURVE allow-list guards the RPC port
    admin_port: int = -1  # a second HTTP port serving only Tair's admin RPCs (Tair uses 6492); -1 = off, 0 picks a free port


@dataclass(frozen=True)
class StoreConfig:
    backend: str = "lmdb"  # lmdb | memory | redis
    data_dir: str = "./kvcm-data"  # LMDB metadata, the default file storage, the engine index
    map_size: int = 256 << 20  # initial LMDB map; grows by doubling up to map_size_max
    map_size_max: int = 64 << 30  # past this, writes get CAPACITY_EXHAUSTED
    sync: bool = True  # fsync every commit: an acknowledged write survives power loss
    max_readers: int = 126  # LMDB reader slots (stale ones are cleared at start and when full)
    lock_shards: int = 64  # in-memory lock shards; a power of two
    search_cache_size: int = 65536  # entries of the lookup LRU cache; 0 disables it
    redis_url: str = "redis://127.0.0.1:6379/0"  # backend redis: redis://host:port/db, rediss://..., unix://path
    redis_password_file: str = ""  # backend redis: a file holding the password ("" = none, or in the URL)
    redis_prefix: str = "kvcm"  # backend redis: the hash tag of every key ({kvcm}:...); one per deployment
    redis_wait_replicas: int = 0  # backend redis: a commit is acknowledged once on this many replicas (WAIT)
    redis_wait_timeout_ms: int = 1000  # backend redis: a commit not on redis_wait_replicas by then is an error


@dataclass(frozen=True)
class StorageConfig:
    allowed_roots: tuple[str, ...] = ()  # where storages may live (never set over RPC); empty = the data dir, plus /dev/shm for shm
    orphans: str = "keep"  # a root taken over from a data dir proven gone: "keep" its containers unindexed, or "delete" them


@dataclass(frozen=True)
class CacheConfig:
    write_timeout_seconds: float = 30.0  # default write-session lifetime
    max_write_timeout_seconds: float = 600.0  # longest lifetime a request may ask for; more is refused
    max_open_sessions_per_instance: int = 1024  # open write sessions per instance; more starts are refused
    max_writing_bytes_per_instance: int = 16 << 30  # bytes in writing per instance; more starts are refused
    session_check_ms: int = 200  # how often expired write sessions are swept
    delete_poll_ms: int = 100  # deleter thread wake-up interval
    storage_health_interval_s: float = 5.0  # how often each storage is probed
    lost_scan_s: float = 60.0  # how often file/shm containers are checked for vanished bytes (0 = never)
    runs: bool = True  # keep run records: prefix lookups read one record per written sequence
    # memory for location bytes rebuilt from compact records (0 disables): a hot set, not the
    # whole store (32 MiB is 34 B per block at 1 M blocks; docs/capacity.md#server-memory-per-block)
    wire_cache_bytes: int = 32 << 20
    max_pins_per_instance: int = 4096  # soft pins an instance may hold; more pins are refused
    max_pin_ttl_s: float = 86400.0  # longest pin a request may ask for; more is refused


@dataclass(frozen=True)
class ReclaimConfig:
    enabled: bool = True  # run the reclaimer thread
    interval_s: float = 1.0  # seconds between reclaim rounds
    hysteresis: float = 0.05  # reclaim until usage < watermark - hysteresis
    sample_size: int = 0  # 0 = exact victim choice; >0 = sampled choice of this many candidates
    max_victims_per_round: int = 10000  # bounds one round's work; the next round continues
    duty_cycle: float = 0.5  # largest share of a core the reclaimer uses while evicting (sleeps between chunks)
    compact_lru: bool = True  # exact lru in flat arrays (~37 B per block) rather than an OrderedDict (~130 B, less CPU)
    journal_interval_s: float = 0.25  # how often recency is journalled between rounds (what a kill -9 can lose)
    inline: bool = True  # a write meeting its group's quota evicts in-line, not QUOTA_EXCEEDED
    inline_max_blocks: int = 4096  # most victims one write may evict in-line


@dataclass(frozen=True)
class EventsConfig:
    enabled: bool = True  # run the engine-event subscriber thread
    pub_port: int = 5557  # default engine PUB port when a source gives a host only
    replay_port: int = 5558  # default engine replay ROUTER port
    poll_ms: int = 100  # subscriber poll timeout
    replay_timeout_s: float = 5.0  # a replay that does not finish in time counts as failed
    backoff_initial_s: float = 1.0  # first reconnect delay after a failure
    backoff_max_s: float = 30.0  # reconnect delay cap
    backoff_factor: float = 2.0  # reconnect delay growth per failure
    max_payload_bytes: int = 64 << 20  # larger engine batches are counted and dropped
    max_held: int = 100_000  # live batches held per source during a replay (older ones dropped, counted)
    rcvhwm: int = 100_000  # SUB receive queue per source
    sync: bool = False  # fsync engine-index commits (it can be rebuilt from the engines by replay)
    sources: tuple[str, ...] = ()  # static sources, JSON objects as given to add_event_source (report_mode too)
    max_sources: int = 128  # sources followed at most, static ones included (each: 4 ZeroMQ sockets, ~6 fds)
    probe_interval_s: float = 5.0  # a source silent this long is probed through its replay ROUTER
    stale_after_s: float = 30.0  # a source not heard this long is stale: left out of match_engines
    expire_after_s: float = 600.0  # a source not heard this long loses its blocks (0 = never)
    tier_weights: str = "GPU=1.0,CPU=0.8,DISK=0.6,STORAGE=0.5,*=0.5"  # match_engines' score weight per medium (* = any other)
    speculative_weight: float = 0.9  # score weight of a block note_routed says is on its way to a source
    speculative_max_entries: int = 1000  # note_routed entries kept at most (the oldest dropped, counted)
    speculative_max_ttl_s: float = 60.0  # the longest ttl_s note_routed accepts
    max_blocks_per_source: int = 262_144  # engine blocks one source holds at most; past it its oldest are dropped
    max_blocks: int = 4_194_304  # engine blocks of all sources together at most; past it the largest lose their oldest
    max_sources_per_account: int = 16  # push sources one non-admin account may register (auth on)
    reserved_admin_sources: int = 16  # source slots of max_sources that only admins' sources may take (auth on)
    push_budget_ms_per_s: float = 200.0  # estimated report work one account (auth off: one source) may cost per second


@dataclass(frozen=True)
class PublisherConfig:
    enabled: bool = False  # publish kvcm's own storage-tier events in vLLM's format
    endpoint: str = "tcp://127.0.0.1:5567"  # PUB socket of kvcm's own events
    replay_endpoint: str = "tcp://127.0.0.1:5568"  # replay ROUTER ("" = no replay)
    topic: str = "kvcm"  # topic frame of every published batch
    buffer_steps: int = 10000  # batches kept for replay
    encoding: str = "map"  # map | array (vLLM's legacy array_like shape)
    event_log: str = ""  # JSON-lines event log path ("" = off)
    curve: bool = False  # CURVE-encrypt PUB and replay with the server's keys, admitting the server's client keys


@dataclass(frozen=True)
class AuthConfig:
    enabled: bool = False  # when on, every request needs "auth": {"user", "password"} or {"token"}
    admin_user: str = "admin"  # bootstrap admin account created on first start when auth is on
    admin_password: str = ""  # its password (set it with KVCM_AUTH_ADMIN_PASSWORD, not in a file)
    verdict_cache_s: float = 60.0  # a verified password is trusted this long without another scrypt
    failed_cache_s: float = 10.0  # a wrong password is answered from memory this long (no scrypt)
    max_pending_checks: int = 32  # password checks queued for the checker thread; more get RATE_LIMITED
    max_pending_per_peer: int = 2  # of those, at most this many from one connection
    max_pending_per_user: int = 4  # ... and for one user name
    failed_login_limit: int = 10  # failed logins per connection per window; then RATE_LIMITED
    failed_login_limit_per_user: int = 30  # failed logins per user name per window; then RATE_LIMITED
    failed_login_window_s: float = 60.0  # the window of both failed-login limits


@dataclass(frozen=True)
class LogConfig:
    level: str = "INFO"  # DEBUG, INFO, WARNING or ERROR


@dataclass(frozen=True)
class HaConfig:
    enabled: bool = False  # one leader, the others follow (on the Redis store, or see coordination)
    coordination: str = ""  # "" = elect on the Redis store; "file:///dir" = a lock file, one host, shared LMDB data dir
    node_id: str = ""  # this node's name in the lease; required when enabled, unique per node
    advertise_endpoint: str = ""  # the RPC endpoint clients are sent to when this node leads ("" = server.endpoint)
    lease_ms: int = 3000  # a leader that does not renew within this is replaced
    renew_ms: int = 1000  # renew (leader) or contend (follower) this often; below lease_ms / 2
    follower_reads: bool = True  # followers answer the read RPCs from the shared store
    campaign_delay_ms: int = 5000  # a leader that stepped down (leader_demote) contends again after this
    require_aof: bool = True  # refuse to start on a Redis whose AOF (appendonly) is off or unreadable; false: warn


@dataclass(frozen=True)
class ShardConfig:
    directory: str = ""  # "" = not sharded; else the shard directory's name in Redis (docs/shards.md)
    name: str = ""  # this deployment's shard name in that directory; required with directory
    max_lookups_per_s: int = 2000  # directory lookups of names this shard does not hold, per second; then RATE_LIMITED


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    reclaim: ReclaimConfig = field(default_factory=ReclaimConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    publisher: PublisherConfig = field(default_factory=PublisherConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    log: LogConfig = field(default_factory=LogConfig)
    ha: HaConfig = field(default_factory=HaConfig)
    shard: ShardConfig = field(default_factory=ShardConfig)

    def to_dict(self) -> dict[str, dict[str, object]]:
        return dataclasses.asdict(self)

    def replace(self, **sections: Unpack[Sections]) -> Config:
        return dataclasses.replace(self, **sections)


class Sections(TypedDict, total=False):
    """The sections :meth:`Config.replace` may swap, each a whole section dataclass."""

    server: ServerConfig
    http: HttpConfig
    store: StoreConfig
    storage: StorageConfig
    cache: CacheConfig
    reclaim: ReclaimConfig
    events: EventsConfig
    publisher: PublisherConfig
    auth: AuthConfig
    log: LogConfig
    ha: HaConfig
    shard: ShardConfig


#: Settings by section as a layer gives them (TOML values, environment text, ``--set`` text or
#: flags), before each is checked against its field's type.
Layer: TypeAlias = Mapping[str, Mapping[str, object]]
#: A setting's value once checked: the types the config dataclasses hold.
Setting: TypeAlias = "str | int | float | bool | tuple[str, ...]"


def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


def _coerce(key: str, kind: object, value: object) -> Setting:
    """Convert ``value`` (from TOML, env text or CLI text) to ``kind`` or raise ConfigError."""
    origin = typing.get_origin(kind)
    if origin is tuple:
        if isinstance(value, str):
            value = _parse_text_list(key, value)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return tuple(v if isinstance(v, str) else json.dumps(v) for v in value)
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if kind is int or kind is float:
        return _number(key, int if kind is int else float, value)
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported setting type {kind!r}")  # pragma: no cover


def _number(key: str, kind: type[int] | type[float], value: object) -> int | float:
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    try:
        number = kind(value) if isinstance(value, str) else value
    except ValueError:
        raise ConfigError(f"{key}: expected {kind.__name__}, got {value!r}") from None
    if kind is int and isinstance(number, float) and not number.is_integer():
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if not isinstance(number, (int, float)):
        raise ConfigError(f"{key}: expected {kind.__name__}, got {value!r}")
    return kind(number)


def _parse_text_list(key: str, text: str) -> list[object]:
    text = text.strip()
    if not text:
        return []
    if text.startswith("["):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{key}: bad JSON list: {exc}") from None
        if not isinstance(parsed, list):
            raise ConfigError(f"{key}: expected a JSON list")
        return parsed
    return [part.strip() for part in text.split(",") if part.strip()]


def _merge(layers: list[tuple[str, Layer]]) -> dict[str, dict[str, Setting]]:
    sections = _sections()
    merged: dict[str, dict[str, Setting]] = {name: {} for name in sections}
    for origin, layer in layers:
        for section, values in layer.items():
            if section not in sections:
                raise ConfigError(f"unknown config section {section!r} ({origin}); valid: {', '.join(sections)}")
            if not isinstance(values, Mapping):
                raise ConfigError(f"{section}: expected a table of settings ({origin})")
            hints = typing.get_type_hints(sections[section])
            for key, value in values.items():
                if key not in hints:
                    valid = ", ".join(hints)
                    raise ConfigError(f"unknown config key {section}.{key} ({origin}); valid keys: {valid}")
                merged[section][key] = _coerce(f"{section}.{key}", hints[key], value)
    return merged


#: ``KVCM_*`` variables that are no server settings: ``kvcm call`` reads them (credentials).
CLIENT_ENV = ("KVCM_PASSWORD", "KVCM_TOKEN")


def _env_layer(environ: Mapping[str, str]) -> dict[str, dict[str, str]]:
    layer: dict[str, dict[str, str]] = {}
    sections = _sections()
    for name, value in environ.items():
        if not name.startswith("KVCM_") or name.startswith(("KVCM_TEST_", "KVCM_STATE_DIR")) or name in CLIENT_ENV:
            continue
        rest = name[5:].lower()
        section = next((s for s in sections if rest.startswith(s + "_")), None)
        key = rest[len(section) + 1 :] if section else ""
        if section is None or key not in typing.get_type_hints(sections[section]):
            raise ConfigError(f"unknown config environment variable {name}")
        layer.setdefault(section, {})[key] = value
    return layer


def overrides_from_pairs(pairs: list[str]) -> dict[str, dict[str, object]]:
    """``["server.endpoint=ipc:///tmp/k"]`` -> ``{"server": {"endpoint": "ipc:///tmp/k"}}``."""
    layer: dict[str, dict[str, object]] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot:
            raise ConfigError(f"bad override {pair!r}: expected section.key=value")
        layer.setdefault(section, {})[name] = value
    return layer


def load(
    path: str | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Layer | None = None,
) -> Config:
    """Build the effective config from file, environment and overrides, validated."""
    layers: list[tuple[str, Layer]] = []
    if path:
        try:
            with open(path, "rb") as fh:
                layers.append((path, tomllib.load(fh)))
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    layers.append(("environment", _env_layer(os.environ if environ is None else environ)))
    if overrides:
        layers.append(("command line", overrides))
    merged = _merge(layers)
    built = {name: kind(**merged[name]) for name, kind in _sections().items()}
    config = Config(**built)
    validate(config)
    return config


# A Host header value: name, IPv4 or [IPv6], optional port (no scheme, no path).
_HOST_ENTRY = re.compile(r"(?:[a-z0-9_.-]{1,253}|\[[0-9a-f:.]{2,45}\])(?::[0-9]{1,5})?")


def validate(config: Config) -> None:
    """Cross-field and range checks; raise ConfigError naming the key."""
    for section in (_store_server_checks, _http_checks, _cache_reclaim_checks, _auth_checks, _events_checks,
                    _misc_checks, _ha_checks, _shard_checks):
        for ok, message in section(config):
            if not ok:
                raise ConfigError(message)
    _check_redis(config.store)
    _check_curve(config)


def _store_server_checks(config: Config) -> list[tuple[bool, str]]:
    """Store and RPC server limits."""
    return [
        (config.store.lock_shards > 0 and config.store.lock_shards & (config.store.lock_shards - 1) == 0,
         "store.lock_shards must be a power of two"),
        (config.store.backend in ("lmdb", "memory", "redis"), "store.backend must be one of: lmdb, memory, redis"),
        (config.store.map_size >= 64 << 10, "store.map_size must be at least 64 KiB"),
        (config.server.max_message_bytes >= 1024, "server.max_message_bytes must be at least 1024"),
        (0 < config.server.max_keys <= KEYS_CEILING, f"server.max_keys must be in 1..{KEYS_CEILING}"),
        (0 < config.server.max_tokens <= TOKENS_CEILING, f"server.max_tokens must be in 1..{TOKENS_CEILING}"),
        (config.server.max_reply_bytes >= 1024, "server.max_reply_bytes must be at least 1024"),
        (config.server.turn_budget_ms > 0, "server.turn_budget_ms must be positive"),
        (config.server.defer_timeout_s > 0, "server.defer_timeout_s must be positive"),
        (0 <= config.server.refusal_hold_ms <= 1000, "server.refusal_hold_ms must be in [0, 1000]"),
        (config.server.drain_max > 0, "server.drain_max must be positive"),
        (config.server.poll_ms > 0, "server.poll_ms must be positive"),
        (config.server.live_after_s > config.server.poll_ms / 1000,
         "server.live_after_s must be longer than one poll (server.poll_ms)"),
    ]


def _http_checks(config: Config) -> list[tuple[bool, str]]:
    """The side HTTP port."""
    return [
        (0 <= config.http.port < 65536, "http.port must be in 0..65535"),
        (-1 <= config.http.admin_port < 65536, "http.admin_port must be -1 (off) or in 0..65535"),
        (config.http.admin_port in (-1, 0) or config.http.admin_port != config.http.port,
         "http.admin_port must differ from http.port"),
        (0 < config.http.read_timeout_s <= 3600, "http.read_timeout_s must be in (0, 3600]"),
        (0 < config.http.idle_timeout_s <= 3600, "http.idle_timeout_s must be in (0, 3600]"),
        (0 < config.http.max_connections <= 10000, "http.max_connections must be in 1..10000"),
        (0 < config.http.max_connections_per_peer <= 10000, "http.max_connections_per_peer must be in 1..10000"),
        (0 < config.http.suspect_after_failures <= 1_000_000, "http.suspect_after_failures must be in 1..1000000"),
        (0 < config.http.suspect_connections_per_s <= 10000, "http.suspect_connections_per_s must be in (0, 10000]"),
        (config.http.max_unauthenticated_body_bytes >= 0, "http.max_unauthenticated_body_bytes must not be negative"),
        (all(_HOST_ENTRY.fullmatch(h.strip().lower()) for h in config.http.allowed_hosts),
         "http.allowed_hosts: each entry must be a host name, an IP address or [IPv6], with an optional :port"),
    ]


def _cache_reclaim_checks(config: Config) -> list[tuple[bool, str]]:
    """Writes, pins and reclaim."""
    return [
        (config.cache.write_timeout_seconds > 0, "cache.write_timeout_seconds must be positive"),
        (config.cache.write_timeout_seconds <= config.cache.max_write_timeout_seconds <= 7 * 86400,
         "cache.max_write_timeout_seconds must be in [cache.write_timeout_seconds, 604800]"),
        (config.cache.lost_scan_s >= 0, "cache.lost_scan_s must not be negative"),
        (config.cache.max_open_sessions_per_instance > 0, "cache.max_open_sessions_per_instance must be positive"),
        (config.cache.max_writing_bytes_per_instance > 0, "cache.max_writing_bytes_per_instance must be positive"),
        (config.cache.max_pins_per_instance >= 0, "cache.max_pins_per_instance must not be negative"),
        (0 < config.cache.max_pin_ttl_s <= 366 * 86400, "cache.max_pin_ttl_s must be in (0, 31622400]"),
        (0 <= config.reclaim.hysteresis < 1, "reclaim.hysteresis must be in [0, 1)"),
        (config.reclaim.interval_s > 0, "reclaim.interval_s must be positive"),
        (0 < config.reclaim.duty_cycle <= 1, "reclaim.duty_cycle must be in (0, 1]"),
        (config.reclaim.journal_interval_s > 0, "reclaim.journal_interval_s must be positive"),
        (config.reclaim.max_victims_per_round > 0, "reclaim.max_victims_per_round must be positive"),
        (config.reclaim.inline_max_blocks > 0, "reclaim.inline_max_blocks must be positive"),
        (config.reclaim.sample_size >= 0, "reclaim.sample_size must not be negative"),
        (config.events.backoff_initial_s > 0, "events.backoff_initial_s must be positive"),
    ]


def _auth_checks(config: Config) -> list[tuple[bool, str]]:
    """Credentials checks and their caches."""
    return [
        # A deferred request finds its verdict in these caches when it is retried a turn later.
        (config.auth.verdict_cache_s >= 1, "auth.verdict_cache_s must be at least 1"),
        (config.auth.failed_cache_s >= 1, "auth.failed_cache_s must be at least 1"),
        (config.auth.max_pending_checks > 0, "auth.max_pending_checks must be positive"),
        (config.auth.max_pending_per_peer > 0, "auth.max_pending_per_peer must be positive"),
        (config.auth.max_pending_per_user > 0, "auth.max_pending_per_user must be positive"),
        (config.auth.failed_login_limit > 0, "auth.failed_login_limit must be positive"),
        (config.auth.failed_login_limit_per_user > 0, "auth.failed_login_limit_per_user must be positive"),
        (config.auth.failed_login_window_s > 0, "auth.failed_login_window_s must be positive"),
    ]


def _events_checks(config: Config) -> list[tuple[bool, str]]:
    """The engine tier."""
    return [
        (1 <= config.events.max_sources <= 16000, "events.max_sources must be in 1..16000"),
        (config.events.probe_interval_s > 0, "events.probe_interval_s must be positive"),
        # A live source is probed at least once before it can be called stale.
        (config.events.stale_after_s > config.events.probe_interval_s,
         "events.stale_after_s must be greater than events.probe_interval_s"),
        (config.events.expire_after_s == 0 or config.events.expire_after_s >= config.events.stale_after_s,
         "events.expire_after_s must be 0 (never) or at least events.stale_after_s"),
        (0 <= config.events.speculative_weight <= 1000, "events.speculative_weight must be in 0..1000"),
        (1 <= config.events.speculative_max_entries <= 10_000_000, "events.speculative_max_entries must be in 1..10000000"),
        (0 < config.events.speculative_max_ttl_s <= 3600, "events.speculative_max_ttl_s must be in (0, 3600]"),
        (1 <= config.events.max_blocks_per_source <= config.events.max_blocks <= 1 << 32,
         "events.max_blocks_per_source must be at least 1 and at most events.max_blocks, which is at most 4294967296"),
        (0 <= config.events.max_sources_per_account <= 16000, "events.max_sources_per_account must be in 0..16000"),
        (0 <= config.events.reserved_admin_sources <= 16000, "events.reserved_admin_sources must be in 0..16000"),
        (0 < config.events.push_budget_ms_per_s <= 1000, "events.push_budget_ms_per_s must be in (0, 1000]"),
    ]


def _misc_checks(config: Config) -> list[tuple[bool, str]]:
    """Kernel, storage roots and orphans, logging."""
    return [
        (config.server.hash_kernel in ("python", "numba"), "server.hash_kernel must be python or numba"),
        (all(os.path.isabs(r) and r.isprintable() for r in config.storage.allowed_roots),
         "storage.allowed_roots: each entry must be an absolute path without control characters"),
        (config.storage.orphans in ("keep", "delete"), "storage.orphans must be keep or delete"),
        (config.log.level.upper() in ("DEBUG", "INFO", "WARNING", "ERROR"), "log.level must be DEBUG, INFO, WARNING or ERROR"),
    ]


_NODE_ID = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def _ha_checks(config: Config) -> list[tuple[bool, str]]:
    """The leader election."""
    ha = config.ha
    return [
        (not config.server.standby or config.store.backend == "lmdb", 'server.standby (--standby) shares one host\'s '
         'LMDB data dir; with store.backend = "redis" use ha.enabled (docs/ha.md)'),
        (not ha.coordination or (ha.coordination.startswith("file:///") and ha.coordination.isprintable()),
         'ha.coordination must be "" (the Redis store) or file:///dir'),
        (100 <= ha.lease_ms <= 600_000, "ha.lease_ms must be in 100..600000"),
        (ha.renew_ms > 0 and 2 * ha.renew_ms < ha.lease_ms, "ha.renew_ms must be positive and below ha.lease_ms / 2"),
        (0 <= ha.campaign_delay_ms <= 3_600_000, "ha.campaign_delay_ms must be in 0..3600000"),
        (not ha.node_id or bool(_NODE_ID.fullmatch(ha.node_id)), "ha.node_id must be 1 to 64 of A-Z a-z 0-9 _ . : -"),
        (not ha.advertise_endpoint or ha.advertise_endpoint.startswith(("tcp://", "ipc://")),
         "ha.advertise_endpoint must be a tcp:// or ipc:// endpoint"),
        (not ha.enabled or bool(ha.node_id), "ha.node_id is required when ha.enabled"),
        (not ha.enabled or config.store.backend == ("lmdb" if ha.coordination else "redis"),
         'ha.enabled requires store.backend = "redis", or "lmdb" with ha.coordination = "file:///dir"'),
    ]


def _shard_checks(config: Config) -> list[tuple[bool, str]]:
    """Sharding: a shard is an HA deployment on the Redis store, named in one directory."""
    shard = config.shard
    if not shard.directory and not shard.name:
        return []
    return [
        (bool(shard.directory) and bool(shard.name), "shard.directory and shard.name go together"),
        (bool(_NODE_ID.fullmatch(shard.directory)), "shard.directory must be 1 to 64 of A-Z a-z 0-9 _ . : -"),
        (bool(re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", shard.name)) and "/" not in shard.name,
         "shard.name must be 1 to 64 of A-Z a-z 0-9 _ . : -"),
        (0 < shard.max_lookups_per_s <= 1_000_000, "shard.max_lookups_per_s must be in 1..1000000"),
        (config.store.backend == "redis" and config.ha.enabled and not config.ha.coordination,
         'a shard (shard.directory) runs on store.backend = "redis" with ha.enabled (a shard of one node is one '
         "HA node): the directory lives in that Redis"),
    ]


#: ``store.redis_url`` of a Redis Cluster: seeds, comma-separated (the deployment's slot's master
#: is found from them, docs/shards.md).
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
_SEED = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})")


def _check_cluster_url(url: str) -> None:
    rest = url.split("://", 1)[1]
    hosts = rest.rsplit("@", 1)[-1]
    hosts, _, path = hosts.partition("/")
    seeds = [s.strip() for s in hosts.split(",") if s.strip()]
    ports = [int(m.group(2)) for m in map(_SEED.fullmatch, seeds) if m is not None]
    if (not seeds or len(seeds) > 16 or len(ports) < len(seeds) or not all(0 < p < 65536 for p in ports)
            or path not in ("", "0")):
        raise ConfigError("store.redis_url of a cluster must be redis+cluster://host:port[,host:port...] "
                          "(1 to 16 seeds, database 0 only)")


_REDIS_PREFIX = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def _check_redis(store: StoreConfig) -> None:
    """The Redis keys are checked whatever the backend, so a typo fails before it is used."""
    if store.redis_url.startswith(CLUSTER_SCHEMES):
        _check_cluster_url(store.redis_url)
        store = dataclasses.replace(store, redis_url="redis://cluster/0")  # the seeds are checked: the rest as usual
    try:
        url = urlsplit(store.redis_url)
        url.port  # noqa: B018 - parses the port: a bad one raises ValueError
    except ValueError as exc:
        raise ConfigError(f"store.redis_url is not a URL: {exc}") from None
    checks = [
        (url.scheme in ("redis", "rediss", "unix") and bool(url.hostname if url.scheme != "unix" else url.path),
         "store.redis_url must be redis://host:port/db, rediss://host:port/db or unix:///path/to/socket"),
        (not (store.redis_password_file and url.password),
         "store.redis_password_file and a password in store.redis_url: give the password once"),
        (not store.redis_password_file or os.path.isfile(store.redis_password_file),
         "store.redis_password_file: no such file"),
        (bool(_REDIS_PREFIX.fullmatch(store.redis_prefix)),
         "store.redis_prefix must be 1 to 64 of A-Z a-z 0-9 _ . : - (no braces: it becomes the hash tag)"),
        (0 <= store.redis_wait_replicas <= 64, "store.redis_wait_replicas must be in 0..64"),
        (0 < store.redis_wait_timeout_ms <= 600_000, "store.redis_wait_timeout_ms must be in 1..600000"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def _check_curve(config: Config) -> None:
    """The CURVE files exist and hold what they should (read now, so start-up fails, not a client)."""
    server = config.server
    if not server.curve_secret_key_file:
        if server.curve_allowed_clients_dir:
            raise ConfigError("server.curve_allowed_clients_dir needs server.curve_secret_key_file")
        if config.publisher.curve:
            raise ConfigError("publisher.curve uses the server's keys: set server.curve_secret_key_file")
        return
    from kvcm.errors import InvalidArgument
    from kvcm.rpc.curve import allowed_keys, load_keypair

    try:
        load_keypair(server.curve_secret_key_file)
    except InvalidArgument as exc:
        raise ConfigError(f"server.curve_secret_key_file: {exc.message}") from None
    if server.curve_allowed_clients_dir:
        try:
            allowed_keys(server.curve_allowed_clients_dir)
        except InvalidArgument as exc:
            raise ConfigError(f"server.curve_allowed_clients_dir: {exc.message}") from None


def to_toml(config: Config) -> str:
    """The effective config as TOML text (``kvcm config show``)."""
    lines: list[str] = []
    for section, values in config.to_dict().items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)

