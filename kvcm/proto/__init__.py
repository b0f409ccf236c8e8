"""Wire formats shared by server, client and subscriber: the msgpack-RPC envelope and codecs."""
