"""Tair KVCM's HTTP/JSON surface, translated onto kvcm's own RPCs (docs/tair.md).

:mod:`kvcm.tair.shapes` reads and writes Tair's proto3-JSON shapes; :mod:`kvcm.tair.translate`
maps each Tair RPC to one kvcm RPC and back. The side HTTP port (:mod:`kvcm.rpc.http`) routes
``POST /api/<lowerCamelName>`` here; it imports nothing of kvcm above the foundations.
"""
