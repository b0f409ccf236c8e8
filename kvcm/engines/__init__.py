"""The engine tier (inbound): vLLM/SGLang KV-event sources and the engine index built from them.

Modules: :mod:`~kvcm.engines.sources` (source specs, endpoints), :mod:`~kvcm.engines.subscriber`
(the subscriber thread), :mod:`~kvcm.engines.index` + :mod:`~kvcm.engines.table` + :mod:`~kvcm.engines.entries`
(engine blocks mapped into kvcm keys, persisted; ``match_engines``), :mod:`~kvcm.engines.hashing` (fast re-hashing),
:mod:`~kvcm.engines.service` (all of it wired together), :mod:`~kvcm.engines.metrics`,
:mod:`~kvcm.engines.cli` (``kvcm events``). kvcm's own outbound events live in :mod:`kvcm.publish`.
"""
