"""High availability on the Redis store: the leader lease (:mod:`kvcm.ha.lease`)."""

from kvcm.ha.lease import Holder, Lease

__all__ = ["Holder", "Lease"]
