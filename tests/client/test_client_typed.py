"""The typed sync client against a real server: every typed method, its result equal to what
``call()`` returns for the same request, typed errors, the retry rule and reply matching."""

from __future__ import annotations

import asyncio
import importlib.machinery
import importlib.util
import inspect
import pathlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import msgspec
import pytest
import zmq

from kvcm.client import IDEMPOTENT_METHODS, METHODS, Client
from kvcm.errors import Code, Conflict, InvalidArgument, NotFound, ServerError, Unavailable
from kvcm.proto.methods import METHODS as TABLE
from kvcm.proto.results import (
    CacheLocationLen,
    CacheLocations,
    CacheMeta,
    EngineMatches,
    Health,
    InstanceInfoReply,
    Lost,
    Mask,
    Pinned,
    Registered,
    Removed,
    SpecInfo,
    Unpinned,
    WriteFinished,
    WriteSession,
)
from kvcm.testing import FakeEnginePublisher, serve_in_thread

ROOT = pathlib.Path(__file__).resolve().parents[2]
SPECS = [{"name": "tp0", "size": 1024}, {"name": "tp1", "size": 1024}]

#: Every RPC of the server when this client was written; a typed method each.
KNOWN_METHODS = (
    "add_account", "add_event_source", "add_storage", "add_token", "check_health", "create_instance_group",
    "delete_account", "disable_storage", "enable_storage", "finish_write_cache", "gen_config_snapshot",
    "get_cache_location", "get_cache_meta", "get_instance_group", "get_instance_info", "get_manager_cluster_info",
    "get_metrics", "list_account", "list_event_sources", "list_instance_groups", "list_instance_info",
    "list_storage", "list_tokens", "load_config_snapshot", "match_engines", "pin_cache", "register_instance",
    "remove_cache", "remove_event_source", "remove_instance", "remove_instance_group", "remove_storage",
    "report_lost", "revoke_token", "start_write_cache", "trim_cache", "unpin_cache", "update_account",
    "update_instance_group", "update_storage", "whoami",
)


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    with serve_in_thread() as srv:
        yield srv


@pytest.fixture
def kv(server: Any) -> Iterator[Client]:
    with server.client() as client:
        yield client


def same(typed: Any, untyped: dict[str, Any]) -> None:
    """The typed result is the plain map read into its Struct: nothing lost, nothing changed."""
    assert typed == msgspec.convert(untyped, type(typed))
    assert set(msgspec.structs.asdict(typed)) >= set(untyped)  # no field of the reply is dropped


def written(kv: Client, instance: str, keys: list[int]) -> WriteSession:
    session = kv.start_write_cache(instance_id=instance, block_keys=keys)
    kv.finish_write_cache(instance_id=instance, write_session_id=session.write_session_id,
                          success_blocks=Mask(offset=len(session.locations)),
                          locations=msgspec.to_builtins(session.locations))  # Tair's clients echo them
    return session


def test_every_rpc_has_a_typed_method() -> None:
    typed = {name for name in dir(Client) if name in METHODS}
    assert typed == set(METHODS)  # every RPC the server answers has its typed method
    for name in typed:
        assert getattr(Client, name).__doc__, name


#: Fields every request may carry that the client sets itself (``auth`` from the client's own).
_CLIENT_SET = {"auth"}


def surface_gaps(methods: dict[str, Any], client: type) -> list[str]:
    """Per RPC with a request schema: the request fields its typed method has no parameter for,
    and the parameters that are no request field (``timeout`` aside)."""
    gaps = []
    for name, method in sorted(methods.items()):
        request = getattr(method, "request", None)
        typed = getattr(client, name, None)
        if request is None or typed is None:
            continue
        fields = set(request.__struct_fields__) - _CLIENT_SET
        params = set(inspect.signature(typed).parameters) - {"self", "timeout"}
        gaps += [f"{name}: no parameter for field {f!r}" for f in sorted(fields - params)]
        gaps += [f"{name}: parameter {p!r} is no request field" for p in sorted(params - fields)]
    return gaps


def test_every_request_field_is_a_typed_parameter(server: Any) -> None:
    """The typed methods of both clients take exactly the fields of each RPC's request schema, as
    the server's method table declares them: a field added to a request Struct without its
    parameter (or a parameter the server would refuse) fails here."""
    from kvcm.aio import Client as AsyncClient

    methods = server.app.dispatcher.methods
    assert len(methods) == len(METHODS)
    assert surface_gaps(methods, Client) == []
    assert surface_gaps(methods, AsyncClient) == []

    class Short(Client):
        def whoami(self, *, timeout: float | None = None) -> Any: ...  # type: ignore[override]

    assert surface_gaps(methods, Short) == ["whoami: no parameter for field 'trace_id'"]


def test_the_method_table_is_the_servers(server: Any) -> None:
    """The protocol's method table names exactly the server's methods, each with the request its
    handler decodes (the server's may add room for its own bookkeeping, never a field), and a
    client retries only what the server declares safe to retry."""
    served = server.app.dispatcher.methods
    assert sorted(TABLE) == sorted(served)
    for name, rpc in TABLE.items():
        request = served[name].request
        assert issubclass(request, rpc.request) and request.__struct_fields__ == rpc.request.__struct_fields__, name
        assert served[name].idempotent or not rpc.idempotent, name
    assert set(METHODS) == set(TABLE) and {n for n, rpc in TABLE.items() if rpc.idempotent} == IDEMPOTENT_METHODS


def load_generator() -> Any:
    """scripts/gen_client as a module."""
    loader = importlib.machinery.SourceFileLoader("gen_client", str(ROOT / "scripts" / "gen_client"))
    spec = importlib.util.spec_from_loader("gen_client", loader)
    assert spec is not None
    gen = importlib.util.module_from_spec(spec)
    loader.exec_module(gen)
    return gen


def test_a_field_added_to_a_request_is_a_parameter_of_both_clients() -> None:
    """Adding a field to a request Struct is all it takes: the generator makes it a keyword
    parameter of the sync and the asyncio method (None: not sent), and the method sends it."""
    gen = load_generator()
    rpc = TABLE["remove_event_source"]

    class Wider(rpc.request, kw_only=True):
        keep_blocks: bool = False

    table = {**TABLE, "remove_event_source": rpc._replace(request=Wider)}
    sent: list[dict[str, object]] = []
    for asynchronous, base in ((False, "ClientMethods"), (True, "AsyncClientMethods")):
        namespace: dict[str, Any] = {}
        exec(compile(gen.render(table, asynchronous), "<generated>", "exec"), namespace)
        methods = namespace[base]
        param = inspect.signature(methods.remove_event_source).parameters["keep_blocks"]
        assert param.kind is inspect.Parameter.KEYWORD_ONLY and param.default is None
        assert param.annotation == "bool | None"
        assert "keep_blocks" not in inspect.signature(methods.whoami).parameters

        class Probe(methods):
            def _typed(self, method: str, reply: Any, timeout: Any, **params: object) -> Any:
                sent.append(params)
                return params

        class AsyncProbe(methods):
            async def _typed(self, method: str, reply: Any, timeout: Any, **params: object) -> Any:
                sent.append(params)
                return params

        if asynchronous:
            asyncio.run(AsyncProbe().remove_event_source(source_id="s", keep_blocks=True))
        else:
            Probe().remove_event_source(source_id="s", keep_blocks=True)
    assert sent == [{"source_id": "s", "keep_blocks": True, "trace_id": None}] * 2


def test_instances_typed(kv: Client) -> None:
    reg = kv.register_instance(instance_group="default", instance_id="ti-a", block_size=4,
                               location_spec_infos=[SpecInfo("tp0", 1024), SpecInfo("tp1", 1024)],
                               model_deployment={"model_name": "m", "dtype": "fp16"})
    assert isinstance(reg, Registered) and reg.created
    assert reg.storage_configs[0].global_unique_name == "default-file"
    again = kv.register_instance(instance_group="default", instance_id="ti-a", block_size=4,
                                 location_spec_infos=SPECS, model_deployment={"model_name": "m", "dtype": "fp16"})
    assert again.created is False
    same(again, kv.call("register_instance", {"instance_group": "default", "instance_id": "ti-a", "block_size": 4,
                                              "location_spec_infos": SPECS,
                                              "model_deployment": {"model_name": "m", "dtype": "fp16"}}))
    info = kv.get_instance_info(instance_id="ti-a")
    assert isinstance(info, InstanceInfoReply) and info.instance_info.block_size == 4
    assert info.instance_info.location_spec_infos == [SpecInfo("tp0", 1024), SpecInfo("tp1", 1024)]
    assert info.instance_info.model_deployment.model_name == "m"
    same(info, kv.call("get_instance_info", {"instance_id": "ti-a"}))
    assert kv.list_instance_info(instance_group_name="default") == kv.call("list_instance_info",
                                                                           {"instance_group_name": "default"})
    with pytest.raises(NotFound) as exc:
        kv.get_instance_info(instance_id="nobody")
    assert exc.value.code is Code.INSTANCE_NOT_EXIST
    assert kv.remove_instance(instance_id="ti-a") == {}


def test_data_plane_typed(kv: Client) -> None:
    kv.register_instance(instance_group="default", instance_id="td", block_size=4, location_spec_infos=SPECS)
    session = written(kv, "td", [1, 2, 3])
    assert isinstance(session, WriteSession) and session.block_mask == Mask(offset=0)
    assert [loc.spec_size for loc in session.locations] == [2, 2, 2]
    second = kv.start_write_cache(instance_id="td", block_keys=[1, 2, 4], write_timeout_seconds=30)
    assert second.block_mask == Mask(offset=2) and len(second.locations) == 1
    failed = kv.finish_write_cache(instance_id="td", write_session_id=second.write_session_id,
                                   success_blocks=Mask(bool_masks=[False]))
    assert failed == WriteFinished(served=0, failed=1)

    loc = kv.get_cache_location(instance_id="td", query_type="prefix_match", block_keys=[1, 2, 3, 4])
    assert isinstance(loc, CacheLocations) and len(loc.locations) == 3
    assert loc.locations[0].location_specs[0].uri.startswith("file://default-file/")
    same(loc, kv.call("get_cache_location", {"instance_id": "td", "query_type": "prefix_match",
                                             "block_keys": [1, 2, 3, 4]}))
    masked = kv.get_cache_location(instance_id="td", query_type="batch_get", block_keys=(1, 2, 9),
                                   block_mask=Mask(offset=1), location_spec_names=["tp1"])
    same(masked, kv.call("get_cache_location", {"instance_id": "td", "query_type": "batch_get",
                                                "block_keys": [1, 2, 9], "block_mask": {"offset": 1},
                                                "location_spec_names": ["tp1"]}))
    assert [x.type for x in masked.locations] == ["unspecified", "file", "unspecified"]
    length = kv.get_cache_location_len(instance_id="td", query_type="prefix_match", block_keys=[1, 2, 9, 3])
    assert length == CacheLocationLen(cache_location_len=2)
    assert kv.get_cache_location_len(instance_id="td", query_type="batch_get", block_keys=(1, 2, 9),
                                     block_mask=Mask(offset=1)).cache_location_len == 3

    meta = kv.get_cache_meta(instance_id="td", block_keys=[1, 9], detail_level=2)
    assert isinstance(meta, CacheMeta) and [m.status for m in meta.metas] == ["serving", "not_found"]
    assert meta.metas[0].nbytes == 2048 and meta.metas[0].all and meta.metas[1].id is None
    same(meta, kv.call("get_cache_meta", {"instance_id": "td", "block_keys": [1, 9], "detail_level": 2}))

    pinned = kv.pin_cache(instance_id="td", block_keys=[1, 2], ttl_seconds=60)
    assert isinstance(pinned, Pinned) and pinned.pinned == 2
    assert kv.unpin_cache(instance_id="td", block_keys=[1, 7]) == Unpinned(unpinned=1)
    assert kv.report_lost(instance_id="td", block_keys=[3]) == Lost(lost=1)
    assert kv.remove_cache(instance_id="td", block_keys=[1, 2], block_mask=Mask(offset=1)) == Removed(removed=1)
    assert kv.trim_cache(instance_id="td", strategy="remove_all_cache") == Removed(removed=1)
    same(kv.trim_cache(instance_id="td", strategy="timestamp", begin_timestamp=1, end_timestamp=2),
         kv.call("trim_cache", {"instance_id": "td", "strategy": "timestamp", "begin_timestamp": 1,
                                "end_timestamp": 2}))


def test_token_ids_and_errors_typed(kv: Client) -> None:
    kv.register_instance(instance_group="default", instance_id="tt", block_size=4, location_spec_infos=SPECS)
    session = kv.start_write_cache(instance_id="tt", token_ids=list(range(1, 11)))
    assert len(session.locations) == 2  # two full blocks of 4 tokens
    with pytest.raises(InvalidArgument, match="ttl_seconds"):
        kv.pin_cache(instance_id="tt", block_keys=[1], ttl_seconds=0)
    with pytest.raises(InvalidArgument, match="query_type"):
        kv.get_cache_location(instance_id="tt", query_type="nonsense", block_keys=[1])
    with pytest.raises(InvalidArgument, match="cannot be sent"):  # beyond 64 bits: refused before sending
        kv.get_cache_location(instance_id="tt", query_type="prefix_match", block_keys=[1 << 70])
    with pytest.raises(NotFound):
        kv.start_write_cache(instance_id="nobody", block_keys=[1])
    with pytest.raises(Conflict):
        kv.add_storage(storage={"global_unique_name": "default-file", "storage_type": "file",
                                "storage_spec": {"root_path": "/tmp/x"}})


def test_control_plane_typed(kv: Client, tmp_path: Any) -> None:
    storage = {"global_unique_name": "ts1", "storage_type": "file", "storage_spec": {"root_path": str(tmp_path)}}
    assert kv.add_storage(storage=storage)["storage"]["global_unique_name"] == "ts1"
    assert kv.update_storage(storage=storage, force_update=True)["storage"]["enabled"] is True
    assert kv.disable_storage(storage_unique_name="ts1")["storage"]["enabled"] is False
    assert kv.enable_storage(storage_unique_name="ts1")["storage"]["enabled"] is True
    assert kv.list_storage() == kv.call("list_storage")
    group = kv.create_instance_group(instance_group={"name": "tg", "storage_candidates": ["ts1"]})
    assert group["instance_group"]["version"] == 1
    updated = kv.update_instance_group(instance_group={"name": "tg", "max_instance_count": 3}, current_version=1)
    assert updated["instance_group"]["max_instance_count"] == 3
    assert kv.get_instance_group(name="tg") == kv.call("get_instance_group", {"name": "tg"})
    assert "tg" in {g["name"] for g in kv.list_instance_groups()["instance_group"]}
    assert kv.remove_instance_group(name="tg") == {}
    assert kv.remove_storage(storage_unique_name="ts1") == {}

    assert kv.add_account(user_name="tu", password="pw-1", groups=["default"])["account"]["groups"] == ["default"]
    assert kv.update_account(user_name="tu", password="pw-2", groups=("*",))["account"]["groups"] == ["*"]
    assert "tu" in {a["user_name"] for a in kv.list_account()["accounts"]}
    token = kv.add_token(user_name="tu", name="ci")
    assert token["token"] and token["name"] == "ci"
    assert token["token_id"] in {t["token_id"] for t in kv.list_tokens(user_name="tu")["tokens"]}
    assert kv.revoke_token(token_id=token["token_id"])["user_name"] == "tu"
    assert kv.delete_account(user_name="tu") == {}
    assert kv.whoami() == kv.call("whoami")

    snapshot = kv.gen_config_snapshot()["config_snapshot"]
    assert snapshot["format"] == "kvcm-registry"
    assert kv.load_config_snapshot(config_snapshot=snapshot)["loaded"]["storage"] == len(snapshot["storages"])
    assert kv.get_manager_cluster_info() == kv.call("get_manager_cluster_info")
    assert set(kv.get_metrics()) == set(kv.call("get_metrics")) == {"timestamp", "node", "metrics"}

    health = kv.check_health()
    plain = kv.call("check_health")
    assert isinstance(health, Health) and health.status == "ok" and health.storages["default-file"].available
    plain["uptime_s"] = health.uptime_s  # the only field that moves between two calls
    same(health, plain)


def test_engine_tier_typed(kv: Client) -> None:
    tokens = list(range(100, 116))
    kv.register_instance(instance_group="default", instance_id="te", block_size=4, location_spec_infos=SPECS)
    with FakeEnginePublisher().start() as engine:
        source = kv.add_event_source(source_id="pod-t", instance_id="te", endpoint=engine.endpoint,
                                     replay_endpoint=engine.replay_endpoint, pod="rack-1")
        assert source["source"]["source_id"] == "pod-t" and source["source"]["pod"] == "rack-1"
        engine.store([11, 12, 13], tokens[:12], block_size=4)
        for _ in range(200):
            match = kv.match_engines(instance_id="te", token_ids=tokens)
            if match.sources and match.sources[0].matched_blocks == 3:
                break
            threading.Event().wait(0.05)
        assert isinstance(match, EngineMatches) and match.num_blocks == 4
        assert match.sources[0].source_id == "pod-t" and match.sources[0].media == {"GPU": 3}
        same(match, {**kv.call("match_engines", {"instance_id": "te", "token_ids": tokens}), "freshness": msgspec.to_builtins(match.freshness)})  # ages move between calls
        assert kv.match_engines(instance_id="te", token_ids=tokens, medium="CPU", limit=1).sources == []
        hosts = kv.get_host_cache_state(instance_id="te", token_ids=tokens, query_type="QT_PREFIX_MATCH",
                                        p2p_host_count=2)
        untyped = kv.call("get_host_cache_state", {"instance_id": "te", "token_ids": tokens,
                                                   "query_type": "QT_PREFIX_MATCH", "p2p_host_count": 2})
        assert hosts == msgspec.convert(untyped, type(hosts)) and untyped["hosts"]  # "global" is global_ here
        with pytest.raises(InvalidArgument):
            kv.get_host_cache_state(instance_id="te", token_ids=tokens, query_type="batch_get")
        listed = kv.list_event_sources(instance_id="te")["sources"]
        assert [s["source_id"] for s in listed] == ["pod-t"]
        assert kv.remove_event_source(source_id="pod-t")["instance_id"] == "te"


# -- transport: a stub ROUTER (a real socket) that answers as each test needs -----------------------


class Stub:
    """A ROUTER on a real ipc endpoint; ``answer(msgid, method)`` gives the reply frames to send."""

    def __init__(self, endpoint: str, answer: Any) -> None:
        self.endpoint, self.answer = endpoint, answer
        self.seen: list[tuple[int, str]] = []
        self.params: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Stub:
        self._thread.start()
        self._ready.wait(5)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.bind(self.endpoint)
        self._ready.set()
        try:
            while not self._stop.is_set():
                if not sock.poll(20):
                    continue
                ident, payload = sock.recv_multipart()
                req = msgpack.unpackb(payload)
                self.seen.append((req[1], req[2]))
                self.params.append(req[3][0])
                for reply in self.answer(req[1], req[2]):
                    sock.send_multipart([ident, reply])
        finally:
            sock.close(0)


def reply(msgid: int, result: Any, error: Any = None) -> bytes:
    return bytes(msgpack.packb([1, msgid, error, result]))


def test_only_idempotent_methods_are_retried(tmp_path: Any) -> None:
    with Stub(f"ipc://{tmp_path}/s", lambda msgid, method: []) as stub, \
            Client(stub.endpoint, timeout=0.2, retries=2) as kv:
        t0 = time.monotonic()
        with pytest.raises(Unavailable) as exc:
            kv.get_cache_location(instance_id="i", query_type="prefix_match", block_keys=[1])
        assert 3 * 0.2 <= time.monotonic() - t0 < 3 * 0.2 + 3  # each attempt waits its timeout, no longer
        assert exc.value.code is Code.TIMEOUT and "3 attempt(s)" in str(exc.value)
        with pytest.raises(Unavailable):
            kv.start_write_cache(instance_id="i", block_keys=[1])
        with pytest.raises(Unavailable):
            kv.pin_cache(instance_id="i", block_keys=[1], ttl_seconds=1)
    methods = [m for _, m in stub.seen]
    assert methods == ["get_cache_location"] * 3 + ["start_write_cache", "pin_cache"]
    assert "get_cache_location" in IDEMPOTENT_METHODS and "start_write_cache" not in IDEMPOTENT_METHODS


def test_replies_to_other_msgids_are_skipped(tmp_path: Any) -> None:
    removed = {"removed": 5, "added_by_a_later_server": [1, 2]}  # read leniently: skipped

    def answer(msgid: int, method: str) -> list[bytes]:  # a stray reply of another shape comes first
        return [reply(msgid + 1, {"locations": "not this"}), reply(msgid - 1, {"removed": 99}),
                reply(msgid, removed)]

    with Stub(f"ipc://{tmp_path}/s", answer) as stub, Client(stub.endpoint, timeout=2) as kv:
        assert kv.remove_cache(instance_id="i", block_keys=[1]) == Removed(removed=5)


def test_malformed_and_error_replies_are_typed(tmp_path: Any) -> None:
    def answer(msgid: int, method: str) -> list[bytes]:
        if method == "remove_cache":
            return [reply(msgid, {"removed": "five"})]
        if method == "whoami":
            return [b"\xc1 not msgpack"]
        return [reply(msgid, None, {"code": 103, "name": "WRITE_SESSION_UNKNOWN", "message": "gone"})]

    with Stub(f"ipc://{tmp_path}/s", answer) as stub, Client(stub.endpoint, timeout=0.5, retries=0) as kv:
        with pytest.raises(ServerError, match="malformed reply"):
            kv.remove_cache(instance_id="i", block_keys=[1])
        with pytest.raises(ServerError, match="malformed reply"):
            kv.whoami()
        with pytest.raises(NotFound) as exc:
            kv.finish_write_cache(instance_id="i", write_session_id="s")
        assert exc.value.code is Code.WRITE_SESSION_UNKNOWN and "gone" in str(exc.value)


def test_unset_arguments_are_not_sent_and_auth_is(tmp_path: Any) -> None:
    def answer(msgid: int, method: str) -> list[bytes]:
        return [reply(msgid, {"locations": []})]

    with Stub(f"ipc://{tmp_path}/s", answer) as stub, Client(stub.endpoint, timeout=2, auth={"token": "t"}) as kv:
        kv.get_cache_location(instance_id="i", query_type="prefix_match", block_keys=[1], block_mask=Mask(offset=1))
    # reply_format is the typed client's own default (the compact reply), sent like auth
    assert stub.params[-1] == {"instance_id": "i", "query_type": "prefix_match", "block_keys": [1],
                               "block_mask": {"offset": 1}, "reply_format": "compact", "auth": {"token": "t"}}


def test_closed_client_refuses_typed_calls(server: Any) -> None:
    kv = server.client()
    assert kv.check_health().status == "ok"
    kv.close()
    with pytest.raises(RuntimeError, match="closed"):
        kv.check_health()
