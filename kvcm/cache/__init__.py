"""The data plane: block records per instance, their locations, two-phase writes and removal.

:mod:`.manager` is the facade the RPC layer calls. Below it, one module per operation
(:mod:`.lookup`, :mod:`.writes`, :mod:`.removal`, :mod:`.consistency`) takes the shared
:class:`~.state.CacheState`; under those sit the parts: :mod:`.meta_index` (records through a
search cache), :mod:`.blocks` (the record and run byte layouts), :mod:`.locations` and
:mod:`.uricodec` (compact location addresses), :mod:`.keys` and :mod:`.masks` (what a request
asks for), :mod:`.placement` (where blocks go), :mod:`.sessions`, :mod:`.usage`, :mod:`.deleter`,
:mod:`.locks`, :mod:`.storage_pool` and :mod:`.listeners` (what the rest of kvcm is told).
"""
