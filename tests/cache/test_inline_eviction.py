"""In-line eviction: a write that meets its group's quota makes room in its own transaction
through the manager's room maker (:mod:`kvcm.cache.room`), and quota admission counts the bytes
already on their way out (the "being freed" counter). Real servers (LMDB in a temp dir, file and
shm storages); a small deterministic room maker stands in for the reclaimer."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import msgpack
import pytest

from kvcm.cache.deleter import DB as DELETES
from kvcm.cache.deleter import pending_bytes
from kvcm.cache.masks import BlockMask
from kvcm.cache.room import Room, Victim
from kvcm.config import ConfigError, ReclaimConfig
from kvcm.errors import CapacityError, KvcmError
from kvcm.testing import RunningServer, make_test_config, serve_in_thread
from tests.helpers import (
    add_group,
    add_shm_storage,
    error_code,
    finish,
    locate,
    register,
    remove_shm,
    shm_prefix,
    start,
    wait_for,
    write,
)
from tests.helpers import uris as loc_uris

pytestmark = pytest.mark.both_stores

BLOCK = 2048  # two specs of 1024 bytes (helpers.SPECS)
# No reclaimer thread: every eviction here is in-line, so the tests see exactly what it did.
OVERRIDES = {"reclaim": {"enabled": False}, "cache": {"delete_poll_ms": 20, "session_check_ms": 50}}


class OldestFirst:
    """The reclaimer's part, in miniature: victims oldest-written first (key order on a tie)
    among the group's serving copies, skipping pinned blocks and what it already handed out."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.pinned: set[tuple[str, int]] = set()
        self.taken: set[Victim] = set()
        self.calls: list[tuple[str, dict[str, int], int]] = []
        self.given_back: list[list[Victim]] = []

    def make_room(self, group: str, needs: Mapping[str, int], limit: int) -> Room:
        self.calls.append((group, dict(needs), limit))
        candidates = sorted((written, inst, key, kind, nbytes) for inst in self.cache.instances_of_group(group)
                            for key, nbytes, kind, written, _ in self.cache.serving_keys(inst))
        freed: Counter[str] = Counter()
        victims: list[Victim] = []
        pinned = 0

        def covered() -> bool:
            return all(freed[kind] >= n for kind, n in needs.items())

        for _, inst, key, kind, nbytes in candidates:
            if covered() or len(victims) >= limit:
                break
            helps = (kind in needs and freed[kind] < needs[kind]) or ("" in needs and freed[""] < needs[""])
            if (inst, key, kind) in self.taken or not helps:
                continue
            if (inst, key) in self.pinned:
                pinned += 1
                continue
            victims.append((inst, key, kind))
            self.taken.add((inst, key, kind))
            freed[kind] += nbytes
            freed[""] += nbytes
        why = "" if covered() else (f"{pinned} pinned blocks" if pinned else "nothing serving left")
        return Room(victims, why)

    def give_back(self, victims: Sequence[Victim]) -> None:
        self.given_back.append(list(victims))
        self.taken.difference_update(victims)


class Fixed:
    """A room maker that offers the same victims whatever is asked (a buggy or stale one)."""

    def __init__(self, victims: list[Victim]) -> None:
        self.victims = victims
        self.given_back: list[list[Victim]] = []

    def make_room(self, group: str, needs: Mapping[str, int], limit: int) -> Room:
        return Room(list(self.victims), "")

    def give_back(self, victims: Sequence[Victim]) -> None:
        self.given_back.append(list(victims))


@pytest.fixture
def server(tmp_path) -> Iterator[tuple[RunningServer, Any]]:
    with serve_in_thread(data_dir=str(tmp_path / "data"), overrides=OVERRIDES) as srv, srv.client() as c:
        yield srv, c


def full_group(c: Any, blocks: int = 4, delay_ms: int = 60_000, **quota: Any) -> None:
    """Group ``g`` on the default file storage, ``blocks`` blocks of quota, filled with keys
    1..blocks by one write each (so they are written in key order)."""
    add_group(c, "g", ["default-file"], capacity=blocks * BLOCK, delay_ms=delay_ms, **quota)
    register(c, "a", group="g")
    for key in range(1, blocks + 1):
        write(c, [key], "a")


def statuses(c: Any, keys: list[int], instance: str = "a") -> list[str]:
    metas = c.call("get_cache_meta", {"instance_id": instance, "block_keys": keys})["metas"]
    return [m["status"] for m in metas]


def freeing(srv: RunningServer, group: str = "g") -> dict[str, int]:
    return srv.app.cache.being_freed.of(group)


def refusal(fn: Any, *args: Any, **kwargs: Any) -> KvcmError:
    with pytest.raises(KvcmError) as info:
        fn(*args, **kwargs)
    return info.value


def test_full_group_admits_a_write_by_evicting_exactly_enough(server):
    srv, c = server
    full_group(c, delay_ms=2000)
    cache = srv.app.cache
    maker = OldestFirst(cache)
    cache.set_room_maker(maker)
    session = start(c, [10, 11], "a")
    assert len(session["locations"]) == 2
    assert maker.calls == [("g", {"": 2 * BLOCK}, 4096)]
    assert statuses(c, [1, 2, 3, 4]) == ["deleting", "deleting", "serving", "serving"]  # the two oldest
    assert freeing(srv) == {"file": 2 * BLOCK}
    usage = cache.usage("g")
    assert usage["bytes"] == 6 * BLOCK  # the victims still hold their space until the deleter frees it
    assert cache.deleter.pending() == 2
    cache.check()
    finish(c, session, instance="a")
    # freed by the deleter after the group's delay, like any other delete
    assert wait_for(lambda: cache.usage("g")["bytes"] == 4 * BLOCK)
    assert freeing(srv) == {} and cache.deleter.pending() == 0
    assert statuses(c, [1, 2, 3, 4, 10, 11]) == ["not_found"] * 2 + ["serving"] * 4
    assert maker.given_back == []
    cache.check()


def test_victims_wait_for_the_delay_before_they_are_freed(server):
    srv, c = server
    full_group(c, blocks=2, delay_ms=60_000)
    cache = srv.app.cache
    cache.set_room_maker(OldestFirst(cache))
    write(c, [10], "a")
    cache.background_once()  # a deleter pass now: the victim is not due for a minute
    assert statuses(c, [1]) == ["deleting"] and cache.deleter.pending() == 1
    assert cache.usage("g")["bytes"] == 3 * BLOCK
    cache.deleter.run_once(now=cache.clock() + 61)
    assert statuses(c, [1]) == ["not_found"] and cache.usage("g")["bytes"] == 2 * BLOCK
    assert freeing(srv) == {}
    cache.check()


def test_room_maker_unset_refuses_as_before_and_says_why(server):
    srv, c = server
    full_group(c)
    exc = refusal(start, c, [10], "a")
    assert exc.code.name == "QUOTA_EXCEEDED" and "no room maker" in str(exc)
    srv.app.cache.set_room_maker(OldestFirst(srv.app.cache))
    srv.app.cache.set_room_maker(None)
    assert error_code(start, c, [10], "a") == "QUOTA_EXCEEDED"
    assert statuses(c, [1, 2, 3, 4]) == ["serving"] * 4


def test_writing_blocks_are_never_victims(server):
    srv, c = server
    add_group(c, "g", ["default-file"], capacity=4 * BLOCK, delay_ms=60_000)
    register(c, "a", group="g")
    pending = start(c, [1], "a")  # the oldest block, but writing
    for key in (2, 3, 4):
        write(c, [key], "a")
    cache = srv.app.cache
    cache.set_room_maker(Fixed([("a", 1, "file")]))  # offers the writing block: never marked
    exc = refusal(start, c, [10], "a")
    assert exc.code.name == "QUOTA_EXCEEDED"
    assert f"{BLOCK} bytes of the group are writing" in str(exc) and "0 victim(s) marked" in str(exc)
    assert statuses(c, [1]) == ["writing"] and freeing(srv) == {}
    maker = OldestFirst(cache)
    cache.set_room_maker(maker)
    write(c, [10], "a")
    assert statuses(c, [1, 2, 3, 4, 10]) == ["writing", "deleting", "serving", "serving", "serving"]
    assert finish(c, pending, instance="a")["served"] == 1  # the writer was not disturbed
    cache.check()


def test_nothing_evictable_refuses_naming_why(server):
    srv, c = server
    full_group(c)
    cache = srv.app.cache
    maker = OldestFirst(cache)
    maker.pinned = {("a", k) for k in (1, 2, 3, 4)}
    cache.set_room_maker(maker)
    exc = refusal(start, c, [10], "a")
    assert exc.code.name == "QUOTA_EXCEEDED"
    message = str(exc)
    assert "4 pinned blocks" in message and "0 of them being freed" in message, message
    assert "0 bytes of the group are writing" in message, message
    assert statuses(c, [1, 2, 3, 4]) == ["serving"] * 4 and freeing(srv) == {}
    assert maker.given_back == []  # nothing was marked
    cache.check()


def test_a_partial_cover_is_refused_and_its_victims_given_back(server):
    srv, c = server
    full_group(c)
    cache = srv.app.cache
    maker = OldestFirst(cache)
    maker.pinned = {("a", k) for k in (2, 3, 4)}
    cache.set_room_maker(maker)
    exc = refusal(start, c, [10, 11], "a")  # needs two blocks, one is evictable
    assert exc.code.name == "QUOTA_EXCEEDED" and "3 pinned blocks" in str(exc), str(exc)
    assert f"{BLOCK} bytes of any type still missing" in str(exc), str(exc)
    assert maker.given_back == [[("a", 1, "file")]]
    assert statuses(c, [1, 2, 3, 4]) == ["serving"] * 4  # the request rolled back, its mark too
    assert freeing(srv) == {} and cache.deleter.pending() == 0
    cache.check()
    write(c, [10], "a")  # one block: the one evictable block covers it
    assert statuses(c, [1]) == ["deleting"]


def test_victims_are_bounded_per_request(server):
    srv, c = server
    full_group(c)
    cache = srv.app.cache
    maker = Fixed([("a", 1, "file"), ("a", 2, "file"), ("a", 3, "file")])
    cache.set_room_maker(maker, limit=2)
    exc = refusal(start, c, [10, 11, 12], "a")
    assert exc.code.name == "QUOTA_EXCEEDED" and "reclaim.inline_max_blocks" in str(exc), str(exc)
    assert maker.given_back == [[("a", 1, "file"), ("a", 2, "file")]]  # the third was never marked
    assert statuses(c, [1, 2, 3]) == ["serving"] * 3
    with pytest.raises(ValueError):
        cache.set_room_maker(maker, limit=0)


def test_victims_of_another_group_are_not_evicted(server):
    srv, c = server
    full_group(c)
    add_group(c, "other", ["default-file"])
    register(c, "b", group="other")
    write(c, [1], "b")
    cache = srv.app.cache
    cache.set_room_maker(Fixed([("b", 1, "file"), ("a", 1, "file")]))
    write(c, [10], "a")
    assert statuses(c, [1], "b") == ["serving"]
    assert statuses(c, [1, 2]) == ["deleting", "serving"]
    cache.check()


def test_per_type_quota_evicts_that_type(tmp_path):
    prefix = shm_prefix()
    try:
        with serve_in_thread(data_dir=str(tmp_path / "data"), overrides=OVERRIDES) as srv, srv.client() as c:
            add_shm_storage(c, "mem", prefix)
            cache = srv.app.cache
            maker = OldestFirst(cache)
            cache.set_room_maker(maker)
            # a spare type takes the write without evicting anything (fall-over comes first)
            add_group(c, "spill", ["mem", "default-file"], per_type={"shm": 2 * BLOCK}, delay_ms=60_000)
            register(c, "s", group="spill")
            write(c, [1, 2], "s")
            assert [x["type"] for x in write(c, [3], "s")["locations"]] == ["file"]
            assert maker.calls == []
            # both types full: evict from the first candidate's type, the write lands there
            add_group(c, "typed", ["mem", "default-file"], per_type={"shm": 2 * BLOCK, "file": 2 * BLOCK},
                      delay_ms=60_000)
            register(c, "t", group="typed")
            write(c, [1], "t")
            write(c, [2], "t")
            write(c, [3, 4], "t")  # shm is full: to file
            assert [x["type"] for x in write(c, [5], "t")["locations"]] == ["shm"]
            assert maker.calls == [("typed", {"shm": BLOCK}, 4096)]
            assert statuses(c, [1, 2, 3, 4, 5], "t") == ["deleting"] + ["serving"] * 4
            assert freeing(srv, "typed") == {"shm": BLOCK}
            # a group total over a per-type need: both asked for at once
            add_group(c, "both", ["mem"], capacity=3 * BLOCK, per_type={"shm": 2 * BLOCK}, delay_ms=60_000)
            register(c, "u", group="both")
            write(c, [1], "u")
            write(c, [2], "u")
            write(c, [3, 4], "u")
            assert maker.calls[-1] == ("both", {"": BLOCK, "shm": 2 * BLOCK}, 4096)
            assert statuses(c, [1, 2, 3, 4], "u") == ["deleting", "deleting", "serving", "serving"]
            cache.check()
            # a request larger than the type's quota cannot be helped by evicting
            exc = refusal(start, c, [7, 8, 9], "u")
            assert exc.code.name == "QUOTA_EXCEEDED" and "do not fit the quota" in str(exc), str(exc)
            assert statuses(c, [3, 4], "u") == ["serving", "serving"]
    finally:
        remove_shm(prefix)


def test_a_rolled_back_request_gives_back_and_leaves_the_counter(server):
    srv, c = server
    full_group(c)
    cache = srv.app.cache
    maker = OldestFirst(cache)
    cache.set_room_maker(maker)
    # 1. The start joins an outer transaction that then fails (the server is idle meanwhile, so
    #    this thread may drive the manager directly).
    with pytest.raises(RuntimeError), cache.store.write():
        cache.start_write_cache("a", [10, 11], None)
        assert freeing(srv) == {"file": 2 * BLOCK}  # this thread sees its own marks at once ...
        raise RuntimeError("a later failure in the same transaction")
    assert maker.given_back == [[("a", 1, "file"), ("a", 2, "file")]]
    assert freeing(srv) == {} and cache.being_freed.snapshot() == {}  # ... and they are gone with it
    assert statuses(c, [1, 2, 3, 4, 10, 11]) == ["serving"] * 4 + ["not_found"] * 2
    assert cache.deleter.pending() == 0
    cache.check()
    # 2. The storage refuses the allocation after room was made: the request fails alone.
    backend = cache.pool.get("default-file")
    real = backend.allocate

    def refuse(n: int, size: int) -> list[str]:
        raise CapacityError("storage full")

    backend.allocate = refuse
    try:
        assert error_code(start, c, [10], "a") == "CAPACITY_EXHAUSTED"
    finally:
        backend.allocate = real
    assert maker.given_back[-1] == [("a", 1, "file")]
    assert statuses(c, [1]) == ["serving"] and freeing(srv) == {}
    cache.check()
    write(c, [10], "a")  # and once it can, the same victim goes
    assert statuses(c, [1]) == ["deleting"]
    cache.check()


def test_being_freed_is_counted_for_later_requests_of_the_same_group_commit(server):
    srv, c = server
    full_group(c)
    cache = srv.app.cache  # no room maker: only what the remove marked makes room
    with cache.store.group():
        cache.remove_cache("a", [1], None, None)
        cache.start_write_cache("a", [10], None)  # sees the remove's mark before it commits
    assert statuses(c, [1, 10]) == ["deleting", "writing"]
    cache.check()


def test_other_threads_see_a_mark_only_once_it_commits(server):
    srv, c = server
    full_group(c)
    cache = srv.app.cache
    seen: list[dict[str, int]] = []
    with cache.store.write():
        cache.remove_cache("a", [1], None, None)
        reader = threading.Thread(target=lambda: seen.append(cache.being_freed.of("g")))
        reader.start()
        reader.join()
        assert freeing(srv) == {"file": BLOCK}
    assert seen == [{}]
    assert freeing(srv) == {"file": BLOCK}  # committed: now everybody's
    cache.check()


def test_every_kind_of_delete_counts_and_the_counter_survives_a_restart(tmp_path):
    data = str(tmp_path / "data")
    overrides = {**OVERRIDES, "cache": {**OVERRIDES["cache"], "write_timeout_seconds": 1}}
    with serve_in_thread(data_dir=data, overrides=overrides) as srv, srv.client() as c:
        full_group(c, blocks=6)
        cache = srv.app.cache
        cache.set_room_maker(OldestFirst(cache))
        write(c, [10], "a")  # evicts 1
        c.call("remove_cache", {"instance_id": "a", "block_keys": [2]})
        failed = start(c, [20], "a")  # fits: 2 is on its way out
        start(c, [30], "a", write_timeout_seconds=1)  # evicts 3, then expires
        with cache.store.write():  # a failed write counts too (freed at once once it commits)
            cache.finish_write_cache("a", failed["write_session_id"], BlockMask(offset=0))
            assert freeing(srv) == {"file": 4 * BLOCK}
        assert wait_for(lambda: statuses(c, [20, 30]) == ["not_found"] * 2)  # failed and expired: freed
        assert freeing(srv) == {"file": 3 * BLOCK}  # 1, 2 and 3, due in a minute
        assert cache.deleter.pending() == 3
        cache.check()
        before = cache.being_freed.snapshot()
        # Entries written before they carried their bytes: four fields, looked up at open.
        with cache.store.write() as txn:
            entries = list(txn.scan(DELETES))
            for entry, value in entries[:2]:
                txn.put(DELETES, entry, msgpack.packb(msgpack.unpackb(value)[:4]))
    assert before == {("g", "file"): 3 * BLOCK}
    with serve_in_thread(data_dir=data, overrides=overrides) as srv, srv.client() as c:
        cache = srv.app.cache
        assert cache.being_freed.snapshot() == before
        with cache.store.read() as view:
            assert pending_bytes(view) == before
        cache.check()
        cache.deleter.run_once(now=cache.clock() + 61)
        assert cache.being_freed.snapshot() == {} and cache.usage("g")["bytes"] == 4 * BLOCK  # 4, 5, 6, 10
        cache.check()


def test_an_old_entry_whose_copy_is_gone_counts_nothing(server):
    srv, c = server
    full_group(c)
    cache = srv.app.cache
    with cache.store.write() as txn:  # as remove_all_meta left them before it dropped its deletes
        txn.put(DELETES, b"\0" * 16, msgpack.packb(["g", "a", 99, "nosuchid"]))
    with cache.store.read() as view:
        assert pending_bytes(view) == {}
    assert cache.deleter.run_once() == 0
    cache.check()


def test_forgetting_the_metadata_drops_its_pending_deletes(server):
    srv, c = server
    full_group(c)
    add_group(c, "other", ["default-file"], delay_ms=60_000)
    register(c, "b", group="other")
    write(c, [1, 2], "b")
    cache = srv.app.cache
    cache.set_room_maker(OldestFirst(cache))
    write(c, [10], "a")
    c.call("remove_cache", {"instance_id": "b", "block_keys": [1]})
    assert cache.deleter.pending() == 2
    c.call("trim_cache", {"instance_id": "a", "strategy": "remove_all_meta"})
    assert freeing(srv) == {} and freeing(srv, "other") == {"file": BLOCK}
    assert cache.deleter.pending() == 1  # the other instance's delete stays
    cache.check()


def test_consistency_check_catches_a_wrong_counter(server):
    srv, c = server
    full_group(c)
    cache = srv.app.cache
    c.call("remove_cache", {"instance_id": "a", "block_keys": [1]})
    cache.check()
    cache.being_freed.reset({("g", "file"): 1})
    with pytest.raises(AssertionError, match="being freed in memory"):
        cache.check()


@pytest.mark.store_independent
def test_config_keys():
    assert ReclaimConfig().inline is True and ReclaimConfig().inline_max_blocks == 4096


@pytest.mark.store_independent
def test_inline_max_blocks_must_be_positive(tmp_path):
    with pytest.raises(ConfigError, match=r"reclaim\.inline_max_blocks"):
        make_test_config(str(tmp_path), f"ipc://{tmp_path}/rpc", {"reclaim": {"inline_max_blocks": 0}})


def test_a_failing_room_maker_refuses_the_write_and_breaks_nothing(server):
    srv, c = server
    full_group(c)

    class Broken(Fixed):
        def make_room(self, group: str, needs: Mapping[str, int], limit: int) -> Room:
            raise RuntimeError("bug in the maker")

    cache = srv.app.cache
    cache.set_room_maker(Broken([]))
    exc = refusal(start, c, [10], "a")
    assert exc.code.name == "QUOTA_EXCEEDED" and "the room maker failed" in str(exc), str(exc)
    assert statuses(c, [1, 2, 3, 4]) == ["serving"] * 4
    cache.check()


def test_the_prefix_a_write_builds_on_is_not_evicted_for_it(server):
    srv, c = server
    full_group(c)
    cache = srv.app.cache
    maker = OldestFirst(cache)
    cache.set_room_maker(maker)
    session = start(c, [1, 10], "a")  # 1 is stored (masked) and the oldest: 2 goes instead
    assert session["block_mask"] == {"offset": 1}
    assert statuses(c, [1, 2]) == ["serving", "deleting"]
    assert maker.given_back == [[("a", 1, "file")]]  # handed back once the request was done asking
    assert ("a", 1, "file") not in maker.taken
    finish(c, session, instance="a")
    assert [len(x["location_specs"]) for x in locate(c, [1, 10], instance="a")] == [2, 2]
    cache.check()


# -- without a grace delay: victims dropped in the write's transaction, freed after its commit ----


def _uris(session: dict[str, Any]) -> list[list[str]]:
    return [[s["uri"] for s in loc["location_specs"]] for loc in session["locations"]]


def _slots(srv: RunningServer) -> int:
    return int(srv.app.storages.get("default-file").usage()["slots_used"])


# One spec of a block's size: a layout no slot of instance "a" fits, so a writer of this layout
# cannot take over the slots of a's victims, which then go the deleter's way.
ONE_SPEC = [{"name": "whole", "size": BLOCK}]


def test_without_a_delay_the_write_takes_over_its_victims_slots(server):
    """The victims' slots go straight to the new blocks of the same layout, in the same
    transaction: never freed, nothing queued for the deleter, no allocation."""
    from kvcm.blocks import BlockIO

    srv, c = server
    full_group(c, delay_ms=0)
    cache = srv.app.cache
    cache.set_room_maker(OldestFirst(cache))
    freed: list[list[str]] = []
    real = cache.deleter.free_storage
    cache.deleter.free_storage = lambda name, uris: (freed.append(list(uris)), real(name, uris))[1]  # type: ignore[method-assign]
    victims = [loc_uris(loc) for loc in locate(c, [1, 2], instance="a")]
    with BlockIO.for_instance(c, "a") as io:
        session = start(c, [10, 11], "a")
        assert statuses(c, [1, 2, 3, 4]) == ["not_found", "not_found", "serving", "serving"]
        assert sorted(_uris(session)) == sorted(victims)  # the very slots, spec by spec
        assert cache.deleter.pending() == 0 and _slots(srv) == 4 * 2 and freeing(srv) == {}
        assert cache.usage("g")["bytes"] == 4 * BLOCK  # 2 kept + 2 writing
        cache.check()  # every reserved slot is named by exactly one record
        for key, new in zip([10, 11], _uris(session)):
            for n, uri in enumerate(new):
                io.write(uri, bytes([key, n]) * 512)
        finish(c, session, instance="a")
        for key, loc in zip([10, 11], locate(c, [10, 11], instance="a")):
            assert [bytes(io.read(u)) for u in loc_uris(loc)] == [bytes([key, n]) * 512 for n in range(2)]
    cache.background_once()
    assert freed == [] and _slots(srv) == 4 * 2
    cache.check()


def test_without_a_delay_a_writer_of_another_layout_leaves_the_slots_to_the_deleter(server):
    srv, c = server
    full_group(c, delay_ms=0)
    register(c, "b", group="g", specs=ONE_SPEC)
    cache = srv.app.cache
    cache.set_room_maker(OldestFirst(cache))
    victims = {u for loc in locate(c, [1], instance="a") for u in loc_uris(loc)}
    session = write(c, [10], "b")
    assert statuses(c, [1, 2]) == ["not_found", "serving"]
    assert not victims & set(_uris(session)[0])  # a fresh slot of its own size
    assert wait_for(lambda: cache.deleter.pending() == 0)
    assert _slots(srv) == 3 * 2 + 1  # a's victim's two slots freed, b's one taken
    cache.check()


def test_without_a_delay_one_spec_blocks_take_over_slots_too(server):
    srv, c = server
    add_group(c, "g", ["default-file"], capacity=2 * BLOCK, delay_ms=0)
    register(c, "b", group="g", specs=ONE_SPEC)
    for key in (1, 2):
        write(c, [key], "b")
    cache = srv.app.cache
    cache.set_room_maker(OldestFirst(cache))
    victim = [loc_uris(loc) for loc in locate(c, [1], instance="b")]
    session = write(c, [10], "b")
    assert _uris(session) == victim and statuses(c, [1, 2, 10], "b") == ["not_found", "serving", "serving"]
    assert cache.deleter.pending() == 0 and _slots(srv) == 2
    cache.check()


def test_without_a_delay_specs_of_other_sizes_never_take_a_victims_slots(server):
    """The same spec names and the same total as the victims' (so the same layout to a
    record), but other sizes per spec: the storage refuses the slots (a 1536-byte spec in a
    1024-byte slot would spill into the next one), and the write gets slots of its own."""
    srv, c = server
    full_group(c, delay_ms=0)
    register(c, "d", group="g", specs=[{"name": "tp0", "size": 512}, {"name": "tp1", "size": 1536}])
    cache = srv.app.cache
    cache.set_room_maker(OldestFirst(cache))
    victim = set(loc_uris(locate(c, [1], instance="a")[0]))
    session = write(c, [10], "d")
    assert statuses(c, [1, 2], "a") == ["not_found", "serving"] and statuses(c, [10], "d") == ["serving"]
    new = _uris(session)[0]
    assert not victim & set(new) and [u.split("size=")[1] for u in new] == ["512", "1536"]
    assert wait_for(lambda: cache.deleter.pending() == 0)
    cache.check()


def test_without_a_delay_slots_taken_over_on_a_storage_that_then_fails_are_freed(tmp_path):
    """The first candidate takes over one victim's slots for one block but has no room for the
    other: the write falls over to the next candidate, and the slots it took over go back to
    the dropped copies, which the deleter frees after the commit."""
    prefix = shm_prefix()
    try:
        with serve_in_thread(data_dir=str(tmp_path / "data"), overrides=OVERRIDES) as srv, srv.client() as c:
            c.call("add_storage", {"storage": {"global_unique_name": "mem", "storage_type": "shm", "storage_spec": {
                "prefix": prefix, "segment_size": 1 << 20, "capacity_bytes": 2 * BLOCK}}})
            cache = srv.app.cache
            add_group(c, "g", ["mem", "default-file"], capacity=2 * BLOCK, delay_ms=0)
            register(c, "a", group="g")
            register(c, "b", group="g", specs=ONE_SPEC)
            write(c, [1], "a")
            write(c, [2], "b")  # the storage is full now
            cache.set_room_maker(OldestFirst(cache))
            session = write(c, [3, 4], "a")  # 1's slots fit block 3 on mem, block 4 finds no room there
            assert [x["type"] for x in session["locations"]] == ["file", "file"]
            assert statuses(c, [1, 3, 4]) == ["not_found", "serving", "serving"] and statuses(c, [2], "b") == ["not_found"]
            mem = srv.app.storages.get("mem")
            assert wait_for(lambda: mem.usage()["slots_used"] == 0)  # 1's and 2's slots, freed
            cache.check()
    finally:
        remove_shm(prefix)


def test_without_a_delay_victims_are_dropped_and_their_slots_freed_by_the_deleter(server):
    from kvcm.blocks import BlockIO

    srv, c = server
    full_group(c, delay_ms=0)
    register(c, "b", group="g", specs=ONE_SPEC)  # b's blocks cannot take over a's slots
    cache = srv.app.cache
    cache.set_room_maker(OldestFirst(cache))
    assert _slots(srv) == 4 * 2  # two specs a block
    with BlockIO.for_instance(c, "b") as io:
        session = start(c, [10, 11], "b")
        # Gone in the write's own commit: no deleting state, no delete entry; the slots go back
        # at the deleter's next wake-up.
        assert statuses(c, [1, 2, 3, 4]) == ["not_found", "not_found", "serving", "serving"]
        assert freeing(srv) == {}
        assert cache.usage("g")["bytes"] == 4 * BLOCK  # 2 kept + 2 writing
        assert wait_for(lambda: cache.deleter.pending() == 0)
        assert _slots(srv) == 2 * 2 + 2  # the victims' four slots were given back, b's two taken
        for key, new in zip([10, 11], _uris(session)):
            io.write(new[0], bytes([key]) * BLOCK)
        finish(c, session, instance="b")
        cache.check()
        # The next eviction (of a's block 3, for a's write) takes over 3's slots; every block
        # still reads its own bytes.
        write(c, [12], "a")
        for key, new in zip([10, 11], _uris(session)):
            assert bytes(io.read(new[0])) == bytes([key]) * BLOCK
    assert statuses(c, [3, 4, 12]) == ["not_found", "serving", "serving"]
    assert statuses(c, [10, 11], "b") == ["serving", "serving"]
    assert wait_for(lambda: cache.deleter.pending() == 0)
    assert _slots(srv) == 2 * 2 + 2
    cache.check()


def test_without_a_delay_a_full_storage_takes_the_write_with_the_slots_still_queued(tmp_path):
    """The slots of earlier victims are still queued for the deleter when a write allocates on
    a storage with no free slot left: the write frees them itself and takes them."""
    prefix = shm_prefix()
    try:
        # The deleter wakes once a minute: only the write's own flush can free the slots.
        overrides = {**OVERRIDES, "cache": {**OVERRIDES["cache"], "delete_poll_ms": 60_000}}
        with serve_in_thread(data_dir=str(tmp_path / "data"), overrides=overrides) as srv, srv.client() as c:
            # room for 3 blocks on the storage, 2 in the group's quota
            c.call("add_storage", {"storage": {"global_unique_name": "mem", "storage_type": "shm", "storage_spec": {
                "prefix": prefix, "segment_size": 1 << 20, "capacity_bytes": 3 * BLOCK}}})
            cache = srv.app.cache
            add_group(c, "g", ["mem"], capacity=2 * BLOCK, delay_ms=0)
            register(c, "a", group="g")
            register(c, "b", group="g", specs=ONE_SPEC)  # b's blocks cannot take over a's slots
            write(c, [1], "a")
            write(c, [2], "a")
            cache.set_room_maker(OldestFirst(cache))
            write(c, [3], "b")  # evicts 1 (its slots queued) and takes the storage's last free space
            assert statuses(c, [1, 2]) == ["not_found", "serving"] and statuses(c, [3], "b") == ["serving"]
            assert cache.deleter.pending() == 1
            write(c, [4], "b")  # the storage is full: the queued slots are freed for it
            assert statuses(c, [2]) == ["not_found"] and statuses(c, [3, 4], "b") == ["serving", "serving"]
            cache.check()
    finally:
        remove_shm(prefix)


def test_without_a_delay_a_rolled_back_request_keeps_its_victims_and_their_bytes(server):
    srv, c = server
    full_group(c, delay_ms=0)
    cache = srv.app.cache
    maker = OldestFirst(cache)
    cache.set_room_maker(maker)
    with pytest.raises(RuntimeError), cache.store.write():
        cache.start_write_cache("a", [10, 11], None)
        raise RuntimeError("a later failure in the same transaction")
    assert maker.given_back == [[("a", 1, "file"), ("a", 2, "file")]]
    assert statuses(c, [1, 2, 3, 4, 10, 11]) == ["serving"] * 4 + ["not_found"] * 2
    assert cache.usage("g")["bytes"] == 4 * BLOCK and _slots(srv) == 4 * 2
    cache.check()  # the victims' slots are still reserved for them, on disk too
    write(c, [10], "a")
    assert statuses(c, [1]) == ["not_found"]
    cache.check()


def test_without_a_delay_a_free_lost_after_the_commit_is_given_back_by_a_restart(tmp_path):
    data = str(tmp_path / "data")
    with serve_in_thread(data_dir=data, overrides=OVERRIDES) as srv, srv.client() as c:
        full_group(c, delay_ms=0)
        cache = srv.app.cache
        cache.set_room_maker(OldestFirst(cache))

        def crash(name: str, uris: list[str]) -> None:
            raise OSError("the process died between the commit and the free")

        cache.deleter.free_storage = crash  # type: ignore[method-assign]
        register(c, "b", group="g", specs=ONE_SPEC)  # its block cannot take over the victim's slots
        write(c, [10], "b")  # the victim's record is gone; its slots were never given back
        assert statuses(c, [1]) == ["not_found"] and statuses(c, [10], "b") == ["serving"]
        assert _slots(srv) == 4 * 2 + 1
    with serve_in_thread(data_dir=data, overrides=OVERRIDES) as srv, srv.client() as c:
        assert _slots(srv) == 3 * 2 + 1  # the start-up reserve counts only what the metadata names
        assert statuses(c, [1, 2]) == ["not_found", "serving"] and statuses(c, [10], "b") == ["serving"]
        srv.app.cache.check()


def test_without_a_delay_a_kill_after_a_take_over_leaves_each_slot_named_once(tmp_path):
    """A server killed right after a write took over its victims' slots (real reclaimer as the
    room maker, real process, SIGKILL): the restart finds the slots reserved for the new
    blocks alone, which finish as usual; nothing was freed, nothing leaked."""
    from kvcm.testing import start_subprocess, stop_subprocess

    data = str(tmp_path / "data")
    sock = tmp_path / "s"
    sock.mkdir()
    server = start_subprocess(data, f"ipc://{sock}/rpc", ["--set", "reclaim.enabled=true", "--set",
                                                        "reclaim.interval_s=3600", "--set", "cache.delete_poll_ms=60000"])
    try:
        with server.client() as c:
            full_group(c, delay_ms=0)
            before = [loc_uris(loc) for loc in locate(c, [1, 2, 3, 4], instance="a")]
            session = start(c, [10, 11], "a")  # the quota is met: two of them make room
            gone = [i for i, status in enumerate(statuses(c, [1, 2, 3, 4])) if status == "not_found"]
            assert len(gone) == 2 and sorted(_uris(session)) == sorted(before[i] for i in gone)
    finally:
        stop_subprocess(server, kill=True)
    with serve_in_thread(data_dir=data, overrides=OVERRIDES) as srv, srv.client() as c:
        assert _slots(srv) == 4 * 2
        srv.app.cache.check()  # every reserved slot named by exactly one record
        assert statuses(c, [10, 11]) == ["writing", "writing"]
        assert finish(c, session, instance="a")["served"] == 2
        assert statuses(c, [10, 11]) == ["serving"] * 2
        srv.app.cache.check()


def test_without_a_delay_a_victim_of_another_type_is_not_dropped(server):
    srv, c = server
    full_group(c, delay_ms=0)
    cache = srv.app.cache
    maker = Fixed([("a", 1, "shm"), ("a", 2, "file")])  # block 1 has no shm copy: nothing to take
    cache.set_room_maker(maker)
    write(c, [10], "a")
    assert statuses(c, [1, 2, 10]) == ["serving", "not_found", "serving"]
    cache.check()


@pytest.mark.parametrize("delay_ms", [0, 60_000])
def test_listeners_hear_an_in_line_eviction_once_it_commits(server, delay_ms):
    from kvcm.cache.listeners import CacheListener

    srv, c = server
    full_group(c, delay_ms=delay_ms)
    cache = srv.app.cache
    heard: list[tuple[str, str, list[int]]] = []

    class Recorder(CacheListener):
        def on_removed(self, instance_id: str, keys: list[int]) -> None:
            heard.append(("removed", instance_id, list(keys)))

        def on_evicted(self, instance_id: str, keys: list[int], delay_s: float) -> None:
            heard.append(("evicted", instance_id, list(keys)))

    cache.set_room_maker(OldestFirst(cache))
    cache.add_listener(Recorder())
    write(c, [10], "a")
    assert ("removed", "a", [1]) in heard and ("evicted", "a", [1]) in heard



def test_without_a_delay_a_victim_with_another_copy_loses_only_the_evicted_one(tmp_path):
    """A record with a second copy is not dropped whole: its copy of the evicted type is marked
    ``deleting`` (and freed by the deleter) while the other copy keeps serving."""
    prefix = shm_prefix()
    try:
        with serve_in_thread(data_dir=str(tmp_path / "data"), overrides=OVERRIDES) as srv, srv.client() as c:
            add_shm_storage(c, "mem", prefix)
            cache = srv.app.cache
            add_group(c, "g", ["mem", "default-file"], per_type={"file": BLOCK}, delay_ms=0)
            register(c, "a", group="g")
            assert [x["type"] for x in write(c, [1], "a")["locations"]] == ["shm"]
            c.call("disable_storage", {"storage_unique_name": "mem"})
            assert [x["type"] for x in write(c, [1], "a")["locations"]] == ["file"]  # a second copy
            cache.set_room_maker(Fixed([("a", 1, "file")]))
            write(c, [3], "a")  # file is at its quota: 1's file copy makes room
            c.call("enable_storage", {"storage_unique_name": "mem"})
            meta = c.call("get_cache_meta", {"instance_id": "a", "block_keys": [1], "detail_level": 1})["metas"][0]
            assert meta["status"] == "serving"
            assert [x["type"] for x in locate(c, [1], instance="a")] == ["shm"]
            # the file copy goes at the deleter's next poll; the shm copy stays
            assert wait_for(lambda: c.call("get_cache_meta", {"instance_id": "a", "block_keys": [1],
                                                               "detail_level": 1})["metas"][0]["location_count"] == 1)
            assert statuses(c, [1, 3]) == ["serving", "serving"]
            cache.check()
    finally:
        remove_shm(prefix)


def test_without_a_delay_a_stop_frees_the_queued_copies_before_the_storages_close(tmp_path):
    overrides = {**OVERRIDES, "cache": {**OVERRIDES["cache"], "delete_poll_ms": 60_000}}
    freed: list[tuple[str, list[str]]] = []
    with serve_in_thread(data_dir=str(tmp_path / "data"), overrides=overrides) as srv, srv.client() as c:
        full_group(c, delay_ms=0)
        cache = srv.app.cache
        cache.set_room_maker(OldestFirst(cache))
        real = cache.deleter.free_storage

        def spy(name: str, uris: list[str]) -> None:
            freed.append((name, list(uris)))
            real(name, uris)

        cache.deleter.free_storage = spy  # type: ignore[method-assign]
        register(c, "b", group="g", specs=ONE_SPEC)  # its block cannot take over the victim's slots
        write(c, [10], "b")
        assert statuses(c, [1]) == ["not_found"] and cache.deleter.pending() == 1 and freed == []
    assert [(name, len(uris)) for name, uris in freed] == [("default-file", 2)]  # two specs
