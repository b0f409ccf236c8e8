"""The method table: every RPC's name, request, reply and retry rule, in one place.

The server's handlers (``kvcm/api/``) serve these requests; the clients' typed methods are
generated from this table and the request Structs' fields (``scripts/gen_client`` writes
:mod:`kvcm.client_methods` and :mod:`kvcm.aio_methods`), so a field added to a request is a
client parameter with no other edit. ``tests/client/test_client_typed.py`` holds the table equal to
the server's.

``idempotent``: a client may resend the request after a timeout without changing the outcome
(only those are retried). ``reply``: the :mod:`kvcm.proto.results` Struct the reply decodes
into, or :data:`~kvcm.proto.results.AdminReply` for the open-ended admin maps. ``doc``: the
typed method's docstring.
"""

from __future__ import annotations

from typing import NamedTuple

from kvcm.proto import results as r
from kvcm.proto.requests import admin, control, data, engines
from kvcm.proto.schema import RequestBase


class Rpc(NamedTuple):
    request: type[RequestBase]
    reply: object  # a results Struct type, or AdminReply (a dict alias)
    idempotent: bool
    doc: str


_ADMIN = r.AdminReply

#: Every RPC, by name: control plane, data plane, engine tier, admin.
METHODS: dict[str, Rpc] = {
    # storages, instance groups, instances (admin except where said)
    "add_storage": Rpc(control.AddStorageRequest, _ADMIN, False,
                       "Add a storage (``{global_unique_name, storage_type, storage_spec}``); ``{\"storage\": ...}``."),
    "update_storage": Rpc(control.UpdateStorageRequest, _ADMIN, False,
                          "Replace a storage's ``storage_spec`` (the whole spec); ``{\"storage\": ...}``."),
    "enable_storage": Rpc(control.StorageNameRequest, _ADMIN, True,
                          "Turn a storage's admin switch on; ``{\"storage\": ...}``."),
    "disable_storage": Rpc(control.StorageNameRequest, _ADMIN, True,
                           "Turn a storage's admin switch off; ``{\"storage\": ...}``."),
    "remove_storage": Rpc(control.StorageNameRequest, _ADMIN, False,
                          "Remove a storage no instance group lists; ``{}``."),
    "list_storage": Rpc(control.Empty, _ADMIN, True, "Every storage; ``{\"storage\": [...]}``."),
    "create_instance_group": Rpc(control.CreateInstanceGroupRequest, _ADMIN, False,
                                 "Create an instance group; ``{\"instance_group\": ...}`` at version 1."),
    "update_instance_group": Rpc(control.UpdateInstanceGroupRequest, _ADMIN, False,
                                 "Merge a partial group into the stored one, compare-and-set on "
                                 "``current_version``."),
    "remove_instance_group": Rpc(control.GroupNameRequest, _ADMIN, False,
                                 "Remove a group no instance belongs to; ``{}``."),
    "get_instance_group": Rpc(control.GroupNameRequest, _ADMIN, True, "One group; ``{\"instance_group\": ...}``."),
    "list_instance_groups": Rpc(control.Empty, _ADMIN, True, "Every group; ``{\"instance_group\": [...]}``."),
    "register_instance": Rpc(control.RegisterInstanceRequest, r.Registered, True,
                             "Register an instance, or attach to it (data plane; the same registration again "
                             "gives\n``created=False``). Fields left out (None) are not compared with a registered "
                             "instance's;\na new instance without ``location_spec_infos`` is router-only (engine "
                             "tier only)."),
    "get_instance_info": Rpc(control.InstanceIdRequest, r.InstanceInfoReply, True,
                             "One instance (data plane); INSTANCE_NOT_EXIST (a NotFound) for an unknown id."),
    "get_storage_specs": Rpc(control.StorageSpecsRequest, r.StorageSpecs, True,
                             "The storages the instance may use, as a client needs them (data plane: what\n"
                             ":mod:`kvcm.blocks` resolves URIs with)."),
    "list_instance_info": Rpc(control.ListInstanceInfoRequest, _ADMIN, True,
                              "The instances of one group (every group when not given); "
                              "``{\"instance_info\": [...]}``."),
    "remove_instance": Rpc(control.InstanceIdRequest, _ADMIN, False,
                           "Unregister an instance; its cached blocks are dropped afterwards. ``{}``."),
    # accounts, snapshots, health, the leader lease
    "add_account": Rpc(control.AddAccountRequest, _ADMIN, False,
                       "Add an account (role ``user`` unless given); ``{\"account\": ...}``."),
    "update_account": Rpc(control.UpdateAccountRequest, _ADMIN, False,
                          "Change an account's password, role or groups; ``{\"account\": ...}``."),
    "delete_account": Rpc(control.UserNameRequest, _ADMIN, False,
                          "Delete an account (never the last admin); ``{}``."),
    "list_account": Rpc(control.Empty, _ADMIN, True, "Every account (never a password); ``{\"accounts\": [...]}``."),
    "gen_config_snapshot": Rpc(control.Empty, _ADMIN, True,
                               "The whole registry; ``{\"config_snapshot\": ...}`` (password hashes included)."),
    "load_config_snapshot": Rpc(control.LoadConfigSnapshotRequest, _ADMIN, False,
                                "Replace the whole registry with a snapshot (a map or its JSON text); "
                                "``{\"loaded\": ...}``."),
    "check_health": Rpc(control.Empty, r.Health, True,
                        "Whether the server answers and its store reads; registry counts and storage states."),
    "get_manager_cluster_info": Rpc(control.Empty, _ADMIN, True,
                                    "The (single) node, always the leader, with Tair's fields."),
    "get_shard_map": Rpc(control.Empty, _ADMIN, True,
                         "The shards of this node's directory (docs/shards.md): ``{\"directory\", \"shard\", "
                         "\"shards\": [{\"name\",\n\"leader_endpoint\", \"endpoints\", \"groups\"}]}``; "
                         "no shards when the deployment is not sharded."),
    "leader_demote": Rpc(admin.LeaderDemoteRequest, _ADMIN, False,
                         "The leader hands the lease over (never retried: each call is one step-down)."),
    "get_leader_elector_config": Rpc(admin.GetLeaderElectorConfigRequest, _ADMIN, True,
                                     "This node's ``campaign_delay_time_ms`` (and lease timings with the lease)."),
    "update_leader_elector_config": Rpc(admin.UpdateLeaderElectorConfigRequest, _ADMIN, True,
                                        "Change this node's ``campaign_delay_time_ms`` until its restart."),
    # data plane
    "get_cache_location": Rpc(data.GetCacheLocationRequest, r.CacheLocations, True,
                              "Locations of the blocks of ``block_keys`` or ``token_ids``: the matched prefix\n"
                              "(``prefix_match``) or one entry per key (``batch_get``, ``reverse_roll_sw_match``)."),
    "get_cache_location_len": Rpc(data.GetCacheLocationLenRequest, r.CacheLocationLen, True,
                                  "How many locations :meth:`get_cache_location` would answer, without them: for\n"
                                  "``prefix_match`` the matched prefix in blocks (Tair's ``getCacheLocationLen``). "
                                  "The\ncheapest lookup on both sides: the reply is a few bytes, whatever the prompt."),
    "get_cache_meta": Rpc(data.GetCacheMetaRequest, r.CacheMeta, True,
                          "What kvcm knows of each key: one location and one :class:`BlockMeta` per request key."),
    "start_write_cache": Rpc(data.StartWriteCacheRequest, r.WriteSession, False,
                             "Allocate space for the keys not there yet (never retried: a write is not idempotent)."),
    "finish_write_cache": Rpc(data.FinishWriteCacheRequest, r.WriteFinished, False,
                              "End a write session; ``success_blocks`` is indexed over the session's locations.\n"
                              "``locations``: Tair's clients echo the session's locations back (checked, not used)."),
    "remove_cache": Rpc(data.RemoveCacheRequest, r.Removed, False,
                        "Mark every copy of the unmasked keys ``deleting``; the count of copies marked."),
    "report_lost": Rpc(data.ReportLostRequest, r.Lost, False,
                       "Blocks this client could not read: they stop being served and are freed at once."),
    "trim_cache": Rpc(data.TrimCacheRequest, r.Removed, False,
                      "Drop an instance's blocks: all, all metadata, or by time (Unix microseconds)."),
    "pin_cache": Rpc(data.PinCacheRequest, r.Pinned, False,
                     "Keep keys out of eviction for ``ttl_seconds`` (a soft pin)."),
    "unpin_cache": Rpc(data.UnpinCacheRequest, r.Unpinned, False,
                       "End the pins of ``block_keys``; the count of keys that were pinned."),
    # engine tier
    "add_event_source": Rpc(engines.AddEventSourceRequest, _ADMIN, False,
                            "Add one engine event source (``endpoint`` or ``host``); ``{\"source\": ...}``. ``pod``: "
                            "the\npod a DP rank belongs to (``match_engines`` groups by it; absent, the source is "
                            "its own)."),
    "remove_event_source": Rpc(engines.RemoveEventSourceRequest, _ADMIN, False,
                               "Remove a source and the blocks it held; ``{\"source_id\", \"instance_id\"}``."),
    "list_event_sources": Rpc(engines.ListEventSourcesRequest, _ADMIN, True,
                              "The sources (of one instance, when given); ``{\"sources\": [...]}``."),
    "match_engines": Rpc(engines.MatchEnginesRequest, r.EngineMatches, True,
                         "Per engine source and pod, the longest prefix of the query it holds, scored, best first\n"
                         "(sources not heard for ``events.stale_after_s`` left out unless ``include_stale``;\n"
                         "``include_storage`` adds kvcm's own storage tier as ``storage``). The prompt's extra keys\n"
                         "(an image, a salt) as vLLM sends them per block (``extra_keys``), or ``mm_features``,\n"
                         "``lora_name`` and ``cache_salt``, enter the keys of ``token_ids``."),
    "note_routed": Rpc(engines.NoteRoutedRequest, r.Routed, False,
                       "The router sent this prompt to ``source_id``: count its blocks there, ``speculative``,\n"
                       "until the engine's event confirms them or ``ttl_s`` ends."),
    "get_host_cache_state": Rpc(engines.GetHostCacheStateRequest, r.HostCacheState, True,
                                "Tair KVCM's ``GetHostCacheState``: per host (pod), local and global prefix hits\n"
                                "(``query_type``: prefix matching only; ``p2p_host_count``: accepted, not used)."),
    "report_events": Rpc(engines.ReportEventsRequest, r.EventsReported, False,
                         "A push source's report (docs/engines.md#push-ingestion): ``register``, ``heartbeat``,\n"
                         "``payloads`` (``[{\"seq\", \"payload\"}]``, vLLM-encoded), ``events`` / ``snapshot`` "
                         "(decoded\n``add`` / ``remove`` / ``clear`` events) or ``down``; ``resync`` in the reply "
                         "asks for a snapshot."),
    # admin: metrics, tokens
    "get_metrics": Rpc(admin.GetMetricsRequest, _ADMIN, True, "The numbers of ``/metrics`` as a map (admin)."),
    "add_token": Rpc(admin.AddTokenRequest, _ADMIN, False, "A new API token of ``user_name``, shown once (admin)."),
    "revoke_token": Rpc(admin.RevokeTokenRequest, _ADMIN, False, "Revoke an API token (admin)."),
    "list_tokens": Rpc(admin.ListTokensRequest, _ADMIN, True,
                       "API tokens (of one account, when given): ids, owners, labels, times (admin)."),
    "whoami": Rpc(admin.WhoamiRequest, _ADMIN, True,
                  "The caller's account, role, groups and how it authenticated."),
}

#: Methods a client may resend after a timeout.
IDEMPOTENT: frozenset[str] = frozenset(name for name, rpc in METHODS.items() if rpc.idempotent)

#: Reads every node of a deployment answers from the shared store, followers included (with
#: ``ha.follower_reads``): what a client may spread over the nodes (``read_from="any"``).
FOLLOWER_READS: frozenset[str] = frozenset({
    "get_cache_location", "get_cache_location_len", "get_cache_meta", "get_instance_info", "get_storage_specs",
    "match_engines", "get_host_cache_state", "list_event_sources"})

__all__ = ["FOLLOWER_READS", "IDEMPOTENT", "METHODS", "Rpc"]
