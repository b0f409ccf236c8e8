"""The engine tier: vLLM/SGLang KV-event sources, the engine index, kvcm's own event publisher.

Modules: :mod:`~kvcm.engines.sources` (source specs, endpoints), :mod:`~kvcm.engines.subscriber`
(the subscriber thread), :mod:`~kvcm.engines.index` + :mod:`~kvcm.engines.table` + :mod:`~kvcm.engines.entries`
(engine blocks mapped into kvcm keys, persisted; ``match_engines``), :mod:`~kvcm.engines.hashing` (fast re-hashing),
:mod:`~kvcm.engines.service` (all of it wired together), :mod:`~kvcm.publish.publisher` (kvcm's
own events in vLLM's format), :mod:`~kvcm.publish.eventlog` (the JSON-lines event log),
:mod:`~kvcm.engines.metrics`, :mod:`~kvcm.engines.cli` (``kvcm events``).
"""
