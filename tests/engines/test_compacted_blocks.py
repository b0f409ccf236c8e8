"""kvcm.engines.compacted: which of a flush's blocks leave the source's dict, and as what."""

from __future__ import annotations

from kvcm.engines.compact import CompactTable
from kvcm.engines.compacted import CompactBlocks
from kvcm.engines.entries import EngineBlock

ONCE = {"GPU": 1}


def _setup(n: int) -> tuple[CompactTable, dict[int, EngineBlock], list[int], list[EngineBlock]]:
    """``n`` blocks of one store as the index makes them (one key each, the shared refs), their
    keys held by slot 0."""
    table = CompactTable()
    keys = [1000 + i for i in range(n)]
    table.hold(0, keys)
    made = [EngineBlock("", k, 16 * (i + 1), (k,), ONCE) for i, k in enumerate(keys)]
    ids = list(range(1, n + 1))
    return table, dict(zip(ids, made)), ids, made


def test_a_fresh_store_moves_whole() -> None:
    table, blocks, ids, made = _setup(8)
    compact = CompactBlocks("GPU")
    assert compact.migrate(table.keys, blocks, [], [(ids, made)]) == ids
    assert len(compact) == 8
    assert all(compact.get(table.keys, bid) == blk for bid, blk in zip(ids, made))


def test_a_fresh_block_that_gained_a_holding_stays() -> None:
    """The test is by identity of the shared ``{medium: 1}``: a block whose holdings were
    replaced since it was made is not a common block any more."""
    table, blocks, ids, made = _setup(6)
    made[2].refs = {"GPU": 2}
    made[4].refs = {"GPU": 1, "CPU": 1}
    compact = CompactBlocks("GPU")
    assert compact.migrate(table.keys, blocks, [], [(ids, made)]) == [1, 2, 4, 6]
    assert compact.get(table.keys, 3) is None and compact.get(table.keys, 5) is None


def test_a_fresh_store_of_an_adapter_or_another_medium_stays() -> None:
    table, blocks, ids, made = _setup(4)
    lora = [EngineBlock("ad", b.end, b.pos, b.keys, ONCE) for b in made]
    assert CompactBlocks("GPU").migrate(table.keys, blocks, [], [(ids, lora)]) == []
    assert CompactBlocks("CPU").migrate(table.keys, blocks, [], [(ids, made)]) == []


def test_a_block_both_changed_and_fresh_moves_once() -> None:
    table, blocks, ids, made = _setup(5)
    compact = CompactBlocks("GPU")
    moved = compact.migrate(table.keys, blocks, [3, 3, 99], [(ids, made)])  # 99: gone since
    assert sorted(moved) == ids and len(moved) == len(set(moved)) and len(compact) == 5


def test_a_changed_block_is_tested_as_it_is_now() -> None:
    table, blocks, _, made = _setup(4)
    blocks[2] = EngineBlock("", made[1].end, made[1].pos, made[1].keys, {"GPU": 2})
    blocks[3] = EngineBlock("", made[2].end, made[2].pos, (made[2].end, 7), ONCE)  # two keys
    compact = CompactBlocks("GPU")
    assert compact.migrate(table.keys, blocks, [1, 2, 3, 4], []) == [1, 4]


def test_a_key_with_another_position_or_not_held_stays() -> None:
    table, blocks, ids, made = _setup(3)
    table.keys.set_pos(table.keys.locate_many([made[0].end], insert=False), [999])  # another position
    stray = EngineBlock("", 555, 16, (555,), ONCE)  # its key held by nobody
    compact = CompactBlocks("GPU")
    assert compact.migrate(table.keys, blocks, [], [([*ids, 9], [*made, stray])]) == [2, 3]
