"""What one key of a request costs the RPC thread, per kind of work: the one table the
dispatcher admits or refuses requests by (:class:`kvcm.rpc.dispatch.Estimate`, ``server.turn_budget_ms``).

Microseconds on the 2-core reference VM, each the marginal cost of one more key (the fixed cost
of a request, its round trip and commit, is left out), measured by the bench line named next to
it and rounded up; docs/limits.md quotes the figures and the commands. A lookup costs very
differently per key depending on what it answers, so each kind has its own entry:

* **full locations** (``get_cache_location``): every matched block's location is built, packed
  and copied into the reply;
* **the length only** (``get_cache_location_len`` with ``prefix_match``): the same walk over the
  records, counting the blocks with a visible copy, no location built;
* **the engine tier** (``match_engines``, ``get_host_cache_state``, ``note_routed``): one
  in-memory holder mask per key, no store read.

``report_events`` is costed per report, event, block, token and payload byte, by
``scripts/bench_events`` (:mod:`kvcm.api.engines`).
"""

from __future__ import annotations

#: Microseconds per key, by kind of work; each measured by ``scripts/bench_hostile --only
#: costs``, whose line of the same name prints it (the figure it printed on the reference VM,
#: then the entry, rounded up with room for a noisier machine).
US_PER_KEY: dict[str, float] = {
    # storage tier, full locations: the walk, and each block's location built into the reply.
    # prefix_match: 1.3 over run records, 5.4 block by block ("prefix_match (block by block)")
    "prefix_match": 6.0,
    "batch_get": 6.0,  # 2.5
    "reverse_roll_sw_match": 6.0,  # 1.8
    # storage tier, the length alone: 0.34 block by block (the records in the search cache), 0.16
    # over run records ("prefix_match_len (runs)")
    "prefix_match_len": 0.4,
    # storage tier, a compact reply (kvcm.proto.locations): the walk, and each block's stored
    # address copied as is ("prefix_match_compact": block by block; "... (runs)")
    "prefix_match_compact": 1.5,
    "get_cache_meta": 14.0,  # 7.3
    "start_write_cache": 15.0,  # 13.1, plus the slots below
    "remove_cache": 20.0,  # 6.5
    "pin_cache": 4.0,  # 1.7
    # engine tier, 100 sources holding parts of the chain: 0.15 reported by vLLM-shaped stores,
    # 0.43 by keyed adds ("match_engines (keyed reports)": every key's holder mask is its own)
    "match_engines": 0.45,
    # a default query of a table with hybrid sources (kvcm.engines.hybrid): the query's holder
    # masks laid out once as a matrix, then per hybrid slot (a source's group on a medium) its
    # column (full attention + sliding window: 2 slots per source; 1 and 100 hybrid sources)
    "hybrid": 0.5,  # 0.12 (0.38 with the other core busy)
    "hybrid_slot": 0.005,  # 0.0017 per key and hybrid slot (0.0032 with the other core busy)
    "note_routed": 0.1,  # 0.04
    # match_engines with include_storage: the storage tier's prefix, its locations counted by type
    "storage_prefix": 5.0,  # 4.1
    # get_cache_location with include_engines: per key and per source of the instance
    "engine_location": 1.5,  # 1.1 per key and holding source
}

#: A pin request also re-reads every pin the instance already holds (its cap counts them, and
#: lapsed ones are dropped in the same pass): microseconds per held pin (bench_hostile
#: ``pin_cache_held``: 0.8).
US_PER_HELD_PIN = 2.0
#: A write's slot in one spec's storage, per block and spec; and a new container (file or
#: segment), shared by the blocks it holds (bench_hostile ``start_write_cache_file_per_block``:
#: a storage of one block per file, 0.04 to 0.26 ms per block and spec, by how loaded the
#: machine's file system is).
US_PER_SLOT = 5.0
US_PER_CONTAINER = 150.0
#: A ``media``/``medium`` name or a ``loads`` entry of an engine-tier query (normalised, set up,
#: looked up per source; bench_hostile ``match_engines option``: 0.6).
US_PER_MATCH_OPTION = 1.0

#: Reply bytes of one location spec (its name and URI): the reply-size check before the work.
REPLY_BYTES_PER_SPEC = 96
#: The same for a compact reply: per location its skeleton id and delta array header, then per
#: spec its integers' deltas (a few each, one byte when they repeat the reference).
COMPACT_BYTES_PER_KEY = 8
COMPACT_BYTES_PER_SPEC = 16
