"""The engine tier (inbound): vLLM/SGLang KV-event sources and the engine index built from them.

Modules: :mod:`~kvcm.engines.sources` (source specs, endpoints), :mod:`~kvcm.engines.subscriber`
(the subscriber thread), :mod:`~kvcm.engines.index` (engine blocks mapped into kvcm keys, persisted; ``match_engines``: its
parts :mod:`~kvcm.engines.indexstate`, :mod:`~kvcm.engines.applying`, :mod:`~kvcm.engines.bounds`,
:mod:`~kvcm.engines.queries`, :mod:`~kvcm.engines.persistence`) over :mod:`~kvcm.engines.table` and
:mod:`~kvcm.engines.entries`, :mod:`~kvcm.engines.hashing` (fast re-hashing),
:mod:`~kvcm.engines.service` (all of it wired together), :mod:`~kvcm.engines.metrics`,
:mod:`~kvcm.engines.cli` (``kvcm events``). kvcm's own outbound events live in :mod:`kvcm.publish`.
"""
