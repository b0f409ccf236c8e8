"""ShardedLocks and MakeBatches (Tair's test vectors, meta/test/meta_indexer_test.cc)."""

from __future__ import annotations

import threading

import pytest

from kvcm.cache.locks import ShardedLocks, check_shard_count, make_batches


def _keys(keys, batches):
    return [[keys[i] for i in batch] for batch in batches]


def test_make_batches_tair_vector_8_shards():
    keys = [0, 1, 2, 3, 4, 8, 9, 80, 800]
    assert _keys(keys, make_batches(keys, 8, 2)) == [[0, 8, 80, 800], [1, 9], [2, 3], [4]]


def test_make_batches_tair_vector_16_shards():
    keys = [0, 4, 7, 16, 20, 32, 33, 34, 35, 64]
    assert _keys(keys, make_batches(keys, 16, 3)) == [[0, 16, 32, 64], [33, 34, 35], [4, 20, 7]]


def test_make_batches_zero_batch_size_is_one_batch_per_shard():
    keys = [0, 1, 2, 17]
    assert _keys(keys, make_batches(keys, 16, 0)) == [[0], [1, 17], [2]]


def test_negative_keys_use_low_bits_twos_complement():
    locks = ShardedLocks(16)
    assert locks.shard(-1) == 15
    assert locks.shard(-16) == 0
    assert locks.shard(2**63 - 1) == 15


@pytest.mark.parametrize("n", [0, -4, 3, 12])
def test_shard_count_must_be_power_of_two(n):
    with pytest.raises(ValueError):
        check_shard_count(n)


def test_hold_takes_shards_ascending_and_releases():
    locks = ShardedLocks(8)
    with locks.hold([7, 1, 9, 3]) as shards:
        assert shards == [1, 3, 7]
        assert locks.held() == [1, 3, 7]
    assert locks.held() == []


def test_hold_releases_on_error():
    locks = ShardedLocks(4)
    with pytest.raises(RuntimeError), locks.hold([1, 2]):
        raise RuntimeError
    assert locks.held() == []


def test_opposite_orders_do_not_deadlock():
    locks = ShardedLocks(64)
    errors = []

    def worker(keys):
        try:
            for _ in range(2000):
                with locks.hold(keys):
                    pass
        except Exception as exc:  # noqa: BLE001 - any failure fails the test  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in ([1, 2, 3, 4], [4, 3, 2, 1], [2, 4], [3, 1])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert not errors


def test_acquire_release_twin_of_hold():
    locks = ShardedLocks(8)
    taken = locks.acquire([9, 1, 3])
    assert locks.held() == [1, 3]
    locks.release(taken)
    assert locks.held() == []
