"""The request of every RPC, one ``msgspec.Struct`` each, by area: what a client sends and the
server decodes, strictly (:mod:`kvcm.proto.schema`). The handlers are the server's
(``kvcm/api/``); :data:`kvcm.proto.methods.METHODS` names each method's request and reply.

- :mod:`~kvcm.proto.requests.control`: storages, instance groups, instances, accounts,
  snapshots, health, and the record shapes they carry;
- :mod:`~kvcm.proto.requests.data`: the data plane (locations, writes, removals, pins);
- :mod:`~kvcm.proto.requests.engines`: the engine tier (event sources, matches, push reports);
- :mod:`~kvcm.proto.requests.admin`: API tokens, ``whoami``, metrics and the leader lease.
"""
