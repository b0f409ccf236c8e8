"""What two processes must agree on, and nothing of the server.

A client author, a port to another language or a compatibility tester reads this package alone:

- :mod:`kvcm.proto.wire`: the msgpack-RPC frames on the ZeroMQ socket (requests, replies,
  errors, the raw reply encodings) and their size caps;
- :mod:`kvcm.proto.schema`: the strict decoding every request goes through (field types,
  bounds, the caps on fields that scale work);
- :mod:`kvcm.proto.requests`: the request of every RPC, one ``msgspec.Struct`` each, by area;
- :mod:`kvcm.proto.methods`: the method table (each method's request, reply and retry rule),
  which the clients' typed methods are generated from;
- :mod:`kvcm.proto.results`: the typed replies the client SDK decodes into;
- :mod:`kvcm.proto.uris`: the storage URIs kvcm hands out, their codec and typed decoder;
- :mod:`kvcm.proto.kv_events`: vLLM's KV-cache event wire format, both ways;
- :mod:`kvcm.proto.extra_keys`: how a block's ``extra_keys`` (images, salt, adapter, prompt
  embeddings) are canonicalised into the digest its kvcm key is derived with;
- :mod:`kvcm.proto.tair`: Tair KVCM's proto3-JSON shapes, both ways.

Modules here import only third-party codecs (msgspec, msgpack), :mod:`kvcm.errors` and each
other (``tests/docs/test_layers.py`` enforces it).
"""
