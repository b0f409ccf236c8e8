"""Eviction policies, shared by the live reclaimer and the offline optimizer.

One interface (:class:`Policy`), one registry (:data:`POLICIES`, :func:`make_policy`). A policy
only *orders* blocks; it never deletes anything. The caller reports what happens to blocks
(``on_write``, ``on_access``, ``on_remove``) and asks which ones to drop (``victims``,
``expired``), then calls ``on_remove`` for each block it really removed. Keys are any hashable:
block keys (ints) in the optimizer, ``(instance_id, block_key)`` tuples in the reclaimer.
``now`` is in seconds; a clock that goes backwards is clamped to the latest value seen, so the
write-time order of :class:`TTL` stays sorted. No policy is thread-safe: one owner at a time.

=============  =====================================================  ==========================
name           evicts first                                           structure (exact mode)
=============  =====================================================  ==========================
``lru``        least recently used (reads and writes refresh)         ``OrderedDict``, O(1)
``lfu``        lowest exponentially decayed use count (``half_life``  lazy-deletion heap,
               seconds; ties: least recent)                           O(log n)
``ttl``        past ``ttl_seconds`` since written (:meth:`expired`);  ``OrderedDict`` in write
               under pressure, oldest written first                   order, O(1)
``leaf_lru``   least recently used among *leaves*: a block is a       lazy-deletion heap over
               candidate only when no tracked block names it as       leaves, O(log n)
               ``parent``, so suffixes go before their prefixes
``random_lru`` Tair KVCM's RandomLRU: the     arrays + swap-pop, O(1);
               oldest of ``batch_size / sample_rate`` draws, with     victims O(s log s)
               replacement, from a fixed-seed xorshift64
=============  =====================================================  ==========================

**Exact and sampled modes.** ``lru``, ``lfu`` and ``leaf_lru`` take ``sample_size=k``: instead of
keeping candidates ordered, they keep them in a dense array and, like Redis' approximated LRU,
each victim is the best of ``k`` candidates drawn uniformly at random (seeded by ``seed``).
Updates become O(1) dict writes, which pays off for very large key spaces. The error is bounded
by order statistics: the victim is the worst of k uniform draws, so it lies outside the worst
fraction ``q`` of candidates with probability ``(1 - q) ** k`` (k=16: 18.5% for q=10%, 1% for
q=25%; k=64: 3.7% for q=5%) and its expected rank is the worst ``1 / (k + 1)``. ``ttl`` has no
sampled mode (its write-order list costs nothing on reads), ``random_lru`` is sampled by
definition. ``sample_size=0`` (the default) is exact.

Every policy has :meth:`check`, asserting its invariants, for tests and stress runs.
"""

from __future__ import annotations

import inspect

from kvcm.policies.base import BasePolicy, Policy
from kvcm.policies.leaf_lru import LeafLRU
from kvcm.policies.lfu import LFU
from kvcm.policies.lru import LRU
from kvcm.policies.random_lru import RandomLRU
from kvcm.policies.ttl import TTL

POLICIES: dict[str, type[BasePolicy]] = {
    cls.name: cls for cls in (LRU, LFU, TTL, LeafLRU, RandomLRU)
}


def make_policy(name: str, **opts: object) -> BasePolicy:
    """Build the policy registered as ``name`` with its options.

    :raises ValueError: unknown name (the message lists the valid ones) or unknown option.
    """
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown eviction policy {name!r}; valid: {', '.join(POLICIES)}")
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(opts) - set(accepted))
    if unknown:
        raise ValueError(
            f"policy {name!r} has no option {', '.join(unknown)}; "
            f"options: {', '.join(accepted) or 'none'}"
        )
    return cls(**opts)


__all__ = ["LFU", "LRU", "POLICIES", "TTL", "BasePolicy", "LeafLRU", "Policy", "RandomLRU", "make_policy"]
