"""Tair KVCM's HTTP/JSON surface, translated onto kvcm's own RPCs (docs/tair.md).

:mod:`kvcm.proto.tair` reads and writes Tair's proto3-JSON shapes; :mod:`kvcm.tair.translate`
maps each Tair RPC to one kvcm RPC and back, with the translators of :mod:`kvcm.tair.requests`
(Tair JSON -> kvcm params) and :mod:`kvcm.tair.replies` (kvcm result -> Tair JSON);
:mod:`kvcm.tair.uris` gives ``file`` and ``shm`` URIs in Tair's form (the whole path) and takes
them back. The side HTTP port (:mod:`kvcm.http`) routes ``POST /api/<lowerCamelName>`` here; of
kvcm it imports only the foundations and the protocol (:mod:`kvcm.proto`).
"""
