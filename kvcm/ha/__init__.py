"""High availability: one node leads, the others follow (:mod:`kvcm.ha.campaign`), over a Redis
key (:mod:`kvcm.ha.lease`) or a lock file on one host (:mod:`kvcm.ha.filelease`)."""
