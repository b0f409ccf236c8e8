"""A kvcm server process, composed: what ``kvcm serve`` runs.

- :mod:`kvcm.node.app`: :class:`~kvcm.node.app.App`, the composition root of one process (store,
  registry, engine tier, cache, reclaimer, dispatcher, RPC server, side HTTP).
- :mod:`kvcm.node.ha`: :class:`~kvcm.node.ha.HaNode`, a node of a leader/follower group
  (``ha.enabled``) running an ``App`` while it holds the lease, a follower stage otherwise.
- :mod:`kvcm.node.follower`: the follower stage and its reads from the shared store.
- :mod:`kvcm.node.stores`: opening the metadata store (LMDB, memory, Redis) and the engine store.
- :mod:`kvcm.node.refusals`: start-up refusals naming what is in the way (ports, the store).
- :mod:`kvcm.node.kernel`: loading the compiled block hash at start.
"""
