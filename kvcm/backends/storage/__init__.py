"""KV-block storages: where kvcm hands out space for blocks, behind one contract (:mod:`.base`)."""
