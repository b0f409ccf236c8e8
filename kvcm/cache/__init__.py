"""The data plane's operations, split out of :mod:`kvcm.cache.manager`: reads (:mod:`.lookup`),
two-phase writes (:mod:`.writes`) and the opened storage backends (:mod:`.storage_pool`)."""
