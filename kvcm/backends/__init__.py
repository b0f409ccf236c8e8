"""kvcm's two plug-in points, each a contract and one module per kind.

- :mod:`kvcm.backends.metastore`: where kvcm keeps its metadata (LMDB, the embedded default; an
  in-memory store; Redis, Valkey or Redis Cluster past one machine), one contract
  (:mod:`kvcm.backends.metastore.base`);
- :mod:`kvcm.backends.storage`: where KV blocks live (``file``, ``shm``, and external ones kvcm
  only hands out URIs for), one contract (:mod:`kvcm.backends.storage.base`) and the registry of
  kinds (:mod:`kvcm.backends.storage.registry`).
"""
