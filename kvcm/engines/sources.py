"""Event sources: one engine endpoint (one DP rank of one pod) bound to a kvcm instance.

A :class:`SourceSpec` is what ``add_event_source`` and the ``[events]`` config section describe;
:class:`SubscriberSettings` holds the subscriber-wide defaults (AIBrix's: PUB port 5557, replay
port 5558, poll 100 ms, replay timeout 5 s, reconnect backoff 1 s doubling to 30 s).

DP ranks follow vLLM's ``offset_endpoint_port``: rank *r* of a pod publishes on ``port + r`` for
both PUB and replay ROUTER (``ipc://``/``inproc://`` endpoints get a ``_dp{r}`` suffix). Explicit
endpoints are taken as given, since vLLM >= #55844 may bind OS-assigned ports per rank.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvcm.config import ConfigError, EventsConfig
from kvcm.engines.hybrid import INCREMENTAL, REPORT_MODES
from kvcm.engines.scoring import DEFAULT_TIER_WEIGHTS
from kvcm.errors import InvalidArgument
from kvcm.proto.schema import suggest

_SCHEMES = ("tcp://", "ipc://", "inproc://")
PUSH = "push"
_ID = re.compile(r"^[A-Za-z0-9._:@/\-\[\]]{1,200}$")


#: A static source from the ``[events]`` config: a JSON object, or its dict (as ``add_event_source``).
StaticSource = str | Mapping[str, object]

@dataclass(frozen=True)
class SubscriberSettings:
    """Subscriber-wide defaults; each may be overridden per source (``None`` there = use these)."""

    pub_port: int = 5557
    replay_port: int = 5558
    poll_ms: int = 100
    replay_timeout_s: float = 5.0
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 30.0
    backoff_factor: float = 2.0
    max_payload_bytes: int = 64 << 20  # larger PUB messages are dropped by ZMQ (MAXMSGSIZE)
    max_held: int = 100_000  # live messages held per source while its replay runs
    rcvhwm: int = 100_000
    max_sources: int = 128  # sources followed at most; sizes the subscriber's ZeroMQ context
    probe_interval_s: float = 5.0  # a source silent this long is asked through its replay ROUTER
    stale_after_s: float = 30.0  # a source not heard this long is stale (left out of matches)
    expire_after_s: float = 600.0  # ... and after this long its blocks are dropped (0 = never)
    tier_weights: str = DEFAULT_TIER_WEIGHTS  # match_engines' score weight per medium (kvcm.engines.scoring)
    speculative_weight: float = 0.9  # weight of a note_routed block (kvcm.engines.speculative)
    speculative_max_entries: int = 1000
    speculative_max_ttl_s: float = 60.0
    max_blocks_per_source: int = 262_144  # blocks one source holds at most (its oldest go first)
    max_blocks: int = 4_194_304  # blocks of every source together at most (kvcm.engines.index)
    max_sources_per_account: int = 16  # push sources one non-admin account may register (auth on)
    reserved_admin_sources: int = 16  # of max_sources, the ones only an admin's sources may take (auth on)
    push_budget_ms_per_s: float = 200.0  # report work one account (auth off: one source) may cost per second

    @classmethod
    def from_config(cls, cfg: EventsConfig) -> SubscriberSettings:
        """Build from ``kvcm.config.EventsConfig`` (fields it lacks keep their defaults)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{n: getattr(cfg, n) for n in names if hasattr(cfg, n)})


@dataclass(frozen=True)
class SourceSpec:
    """One event source. ``source_id`` is unique, ``dp_rank`` its DP rank within ``pod``."""

    source_id: str
    instance_id: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    dp_rank: int = 0
    replay_timeout_s: float | None = None
    backoff_initial_s: float | None = None
    backoff_max_s: float | None = None
    poll_ms: int | None = None
    static: bool = False  # comes from the config file (re-added at every start)
    # The pod whose DP rank this is, grouping ranks in match_engines; "" = source_id. Stored as
    # given so that specs persisted before the field existed stay equal to their re-added self.
    pod: str = ""
    #: ``zmq`` (kvcm subscribes to ``endpoint``) or ``push`` (the engine reports through
    #: ``report_events``; ``endpoint`` is empty). The fields below are push sources' only.
    kind: str = "zmq"
    medium: str = ""  # what a reported event without a medium is held on ("" = GPU)
    generation: int = 0  # the reporter's incarnation: a higher one replaces the source
    owner: str = ""  # the account that registered it (auth on), the only non-admin that may report
    #: vLLM's ``kv_cache_report_mode`` of the engine's requests: ``incremental`` (a store is a
    #: new physical block: each one is a holding) or ``full`` (reused prefixes are re-reported
    #: once per request: a held block re-reported is only made newest, never held twice)
    report_mode: str = INCREMENTAL

    @property
    def push(self) -> bool:
        return self.kind == PUSH

    def to_dict(self) -> dict[str, Any]:
        # Every field is a scalar: a shallow copy is asdict()'s result without its deep copies
        # (this runs at every flush of the source's position).
        return {name: getattr(self, name) for name in _SPEC_FIELDS}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SourceSpec:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


_SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(SourceSpec))


def tcp_endpoint(host: str, port: int) -> str:
    """``tcp://host:port`` with IPv6 literals bracketed."""
    host = host.strip("[]")
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"tcp://[{host}]:{port}"
    except ValueError:
        pass  # a DNS name
    return f"tcp://{host}:{port}"


def is_ipv6(endpoint: str) -> bool:
    return endpoint.startswith("tcp://[")


def check_endpoint(endpoint: str, what: str) -> str:
    if not isinstance(endpoint, str) or not endpoint.startswith(_SCHEMES):
        raise InvalidArgument(f"{what} must start with one of {_SCHEMES}, got {endpoint!r}")
    if endpoint.startswith("ipc://") and len(endpoint) - 6 > 100:
        raise InvalidArgument(f"{what}: ipc path longer than 100 bytes (Unix socket limit)")
    return endpoint


def build_spec(params: dict[str, Any], settings: SubscriberSettings) -> SourceSpec:
    """Validate ``add_event_source`` params (or a static config entry) into a :class:`SourceSpec`.

    Either ``endpoint`` (used as given; ``replay_endpoint`` optional) or ``host`` (ports from
    ``port``/``replay_port`` or the settings, offset by ``dp_rank``). ``replay: false`` turns
    replay off for a host-derived source.
    """
    _check_keys(params)
    source_id = params.get("source_id")
    if not isinstance(source_id, str) or not _ID.match(source_id):
        raise InvalidArgument(f"source_id must be 1-200 chars of [A-Za-z0-9._:@/-], got {source_id!r}")
    instance_id = params.get("instance_id")
    if not isinstance(instance_id, str) or not instance_id:
        raise InvalidArgument("instance_id is required")
    rank = params.get("dp_rank", 0)
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < 4096:
        raise InvalidArgument(f"dp_rank must be an int in [0, 4096), got {rank!r}")
    endpoint, replay = _endpoints(params, settings, rank)
    pod = params.get("pod")
    pod = "" if pod is None else pod
    if pod != "" and (not isinstance(pod, str) or not _ID.match(pod)):
        raise InvalidArgument(f"pod must be 1-200 chars of [A-Za-z0-9._:@/-], got {str(pod)[:40]!r}")
    topic = params.get("topic") or ""
    if not isinstance(topic, str):
        raise InvalidArgument("topic must be a string")
    return SourceSpec(
        source_id=source_id,
        instance_id=instance_id,
        endpoint=endpoint,
        replay_endpoint=replay,
        topic=topic,
        dp_rank=rank,
        replay_timeout_s=_positive(params, "replay_timeout_s", _MAX_SECONDS),
        backoff_initial_s=_positive(params, "backoff_initial_s", _MAX_SECONDS),
        backoff_max_s=_positive(params, "backoff_max_s", _MAX_SECONDS),
        poll_ms=_positive_int(params, "poll_ms", _MAX_POLL_MS),
        static=bool(params.get("static", False)),
        pod=pod,
        report_mode=check_report_mode(params.get("report_mode", INCREMENTAL)),
    )


def check_report_mode(value: object) -> str:
    """A source's ``report_mode``, checked strictly (a typo must not count re-reports as holdings)."""
    if not isinstance(value, str) or value not in REPORT_MODES:
        raise InvalidArgument(f"report_mode must be one of {list(REPORT_MODES)} (vLLM's kv_cache_report_mode of the "
                              f"engine's requests), got {str(value)[:40]!r}")
    return value


def _endpoints(
    params: dict[str, Any], settings: SubscriberSettings, rank: int
) -> tuple[str, str | None]:
    endpoint, host = params.get("endpoint"), params.get("host")
    if endpoint and host:
        raise InvalidArgument("give either endpoint or host, not both")
    if endpoint:
        replay = params.get("replay_endpoint") or None
        check_endpoint(endpoint, "endpoint")
        if replay is not None:
            check_endpoint(replay, "replay_endpoint")
        return endpoint, replay
    if not isinstance(host, str) or not host:
        raise InvalidArgument("endpoint or host is required")
    port = _port(params, "port", settings.pub_port, rank)
    replay_port = _port(params, "replay_port", settings.replay_port, rank)
    pub = tcp_endpoint(host, port + rank)
    if params.get("replay", True) is False:
        return pub, None
    return pub, tcp_endpoint(host, replay_port + rank)


# Upper bounds of a source's timings: beyond them a value is a mistake (or an attack on the
# persisted record, which must stay encodable), not a setting.
_MAX_SECONDS = 86_400.0
_MAX_POLL_MS = 60_000


def _positive(params: dict[str, Any], name: str, most: float) -> float | None:
    value = params.get(name)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= most:
        raise InvalidArgument(f"{name} must be a number in (0, {most:g}], got {str(value)[:40]}")
    return float(value)


def _positive_int(params: dict[str, Any], name: str, most: int) -> int | None:
    value = _positive(params, name, most)
    return None if value is None else max(1, int(value))


def _port(params: dict[str, Any], name: str, default: int, rank: int) -> int:
    value = params.get(name)
    if value is None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value + rank <= 65535:
        raise InvalidArgument(f"{name} must be an int with {name} + dp_rank in 1..65535, got {str(value)[:40]}")
    return value


#: What a source description may hold: ``add_event_source``'s fields (and ``static``, set here).
_KEYS = frozenset({"source_id", "instance_id", "endpoint", "replay_endpoint", "host", "port", "replay_port",
                   "replay", "topic", "dp_rank", "replay_timeout_s", "backoff_initial_s", "backoff_max_s",
                   "poll_ms", "static", "pod", "report_mode"})


def _check_keys(params: dict[str, Any]) -> None:
    """A misspelled key (``replay_endpiont``) must not quietly give a source without replay."""
    for key in params:
        if key not in _KEYS:
            guess = suggest(str(key), _KEYS)
            hint = f" (did you mean {guess}?)" if guess else ""
            raise InvalidArgument(f"unknown field {str(key)[:100]}{hint}")


def push_spec(
    source_id: str, instance_id: str, *, dp_rank: int = 0, pod: str = "", medium: str = "", generation: int = 0,
    owner: str = "", report_mode: str = INCREMENTAL,
) -> SourceSpec:
    """The spec of a source registered through ``report_events`` (validated like ``build_spec``)."""
    if not isinstance(source_id, str) or not _ID.match(source_id):
        raise InvalidArgument(f"source_id must be 1-200 chars of [A-Za-z0-9._:@/-], got {str(source_id)[:200]!r}")
    if not instance_id:
        raise InvalidArgument("instance_id is required")
    if not 0 <= dp_rank < 4096:
        raise InvalidArgument(f"dp_rank must be an int in [0, 4096), got {dp_rank}")
    if pod and not _ID.match(pod):
        raise InvalidArgument(f"pod must be 1-200 chars of [A-Za-z0-9._:@/-], got {pod[:200]!r}")
    if medium and not _MEDIUM.match(medium):
        raise InvalidArgument(f"medium must be 1-32 chars of [A-Za-z0-9_-], got {medium[:40]!r}")
    return SourceSpec(source_id=source_id, instance_id=instance_id, endpoint="", dp_rank=dp_rank, pod=pod,
                      kind=PUSH, medium=medium.upper(), generation=generation, owner=owner,
                      report_mode=check_report_mode(report_mode))


_MEDIUM = re.compile(r"^[A-Za-z0-9_\-]{1,32}$")


def static_specs(entries: Sequence[StaticSource], settings: SubscriberSettings) -> list[SourceSpec]:
    """Static sources from the ``[events]`` config: JSON objects (or dicts) as ``add_event_source``.

    :raises ConfigError: naming ``events.sources[i]`` (a config mistake stops start-up)."""
    specs = []
    for i, entry in enumerate(entries):
        try:
            params = json.loads(entry) if isinstance(entry, str) else dict(entry)
            if not isinstance(params, dict):
                raise InvalidArgument("must be a JSON object")
            params["static"] = True
            specs.append(build_spec(params, settings))
        except (ValueError, TypeError, InvalidArgument) as exc:
            reason = exc.message if isinstance(exc, InvalidArgument) else f"not valid JSON: {exc}"
            raise ConfigError(f"events.sources[{i}]: {reason}") from None
    return specs
