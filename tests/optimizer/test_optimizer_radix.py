"""kvcm.optimizer.radix: insert, prefix queries with masks, tombstones, cleaning, export."""

from __future__ import annotations

import pytest

from kvcm.optimizer.radix import RadixTree
from tests import stress_radix


def _shape(tree: RadixTree) -> list[tuple[list[int], list[int]]]:
    """(run, children's first keys) per node, breadth first, without the root."""
    return [(n.keys, sorted(n.children)) for n in tree.nodes() if n is not tree.root]


def test_insert_builds_compressed_runs_and_splits_on_divergence():
    tree = RadixTree()
    assert tree.insert([1, 2, 3, 4]) == [1, 2, 3, 4]
    assert _shape(tree) == [([1, 2, 3, 4], [])]
    assert tree.insert([1, 2, 7]) == [7]
    assert _shape(tree) == [([1, 2], [3, 7]), ([3, 4], []), ([7], [])]
    assert tree.insert([1, 2, 7, 8]) == [8]  # a leaf's run is extended, not given a child
    assert _shape(tree)[-1] == ([7, 8], [])
    tree.check()
    assert len(tree) == tree.total_blocks == 6


def test_insert_under_a_parent_anchors_the_path():
    tree = RadixTree()
    tree.insert([1, 2, 3])
    assert tree.insert([9], parent=2) == [9]
    assert tree.parent_of(9) == 2 and tree.parent_of(3) == 2
    assert tree.insert([5], parent=424242) == [5]  # unknown parent: under the root
    assert tree.parent_of(5) is None
    tree.check()


def test_a_key_cannot_move_to_another_parent():
    tree = RadixTree()
    tree.insert([1, 2])
    with pytest.raises(ValueError, match="prefix-dependent"):
        tree.insert([5, 2])


def test_match_counts_internal_masked_and_external_live_hits():
    tree = RadixTree()
    tree.insert([1, 2, 3, 4])
    assert tree.match([1, 2, 3, 9]) == (0, 3)
    assert tree.match([1, 2, 3, 4], mask=2) == (2, 2)
    assert tree.match([7, 8, 3, 4], mask=2) == (2, 2)  # masked blocks need not be in the tree
    assert tree.match([1, 2, 3, 4], mask=[False, True, False, True]) == (2, 2)
    assert tree.match([1, 2], mask=5) == (2, 0)
    assert tree.match([]) == (0, 0)


def test_tombstones_stop_matches_and_are_revived_in_place():
    tree = RadixTree()
    tree.insert([1, 2, 3, 4])
    assert tree.remove([2, 99]) == 1
    assert tree.match([1, 2, 3, 4]) == (0, 1)
    assert 2 not in tree and tree.total_blocks == 4
    assert tree.insert([1, 2, 3, 4, 5]) == [2, 5]
    assert tree.match([1, 2, 3, 4, 5]) == (0, 5)
    assert _shape(tree) == [([1, 2, 3, 4, 5], [])]
    tree.check()


def test_clean_deletes_tombstones_that_end_a_branch_only():
    tree = RadixTree()
    tree.insert([1, 2, 3])
    tree.insert([1, 2, 7, 8])
    tree.remove([2, 3, 8])
    assert tree.clean() == 2  # 3 (a whole leaf) and 8 (a leaf's tail); 2 is interior
    assert _shape(tree) == [([1, 2], [7]), ([7], [])]
    assert tree.total_blocks == 3 and len(tree) == 2
    tree.check()


def test_remove_with_clean_deletes_upwards():
    tree = RadixTree()
    tree.insert([1, 2])
    tree.insert([1, 5, 6])
    tree.remove([5, 6, 2], clean=True)
    assert _shape(tree) == [([1], [])]
    tree.remove([1], clean=True)
    assert tree.total_blocks == 0 and _shape(tree) == []
    tree.check()


def test_match_updates_node_statistics_and_export_has_them():
    tree = RadixTree()
    tree.insert([1, 2, 3], now=1.0)
    tree.insert([1, 2, 9], now=2.0)
    tree.match([1, 2, 9], now=5.0)
    nodes = {n["first_key"]: n for n in tree.export()}
    assert nodes[None]["node_id"] == 0 and nodes[None]["parent_id"] is None
    assert nodes[1]["access_count"] == 1 and nodes[1]["last_access_time"] == 5.0
    assert nodes[9]["access_count"] == 1 and nodes[3]["access_count"] == 0
    assert nodes[3]["parent_id"] == nodes[1]["node_id"] and nodes[3]["is_leaf"]
    assert {n["cached_blocks"] for n in tree.export()} == {0, 2, 1}
    dot = tree.to_dot()
    assert dot.startswith("digraph radix {") and "->" in dot


def test_check_catches_a_corrupted_index():
    tree = RadixTree()
    tree.insert([1, 2, 3])
    tree.insert([1, 9])
    tree._where[3] = tree.root
    with pytest.raises(AssertionError):
        tree.check()


@pytest.mark.parametrize("seed", [0, 1])
def test_seeded_stress_short(seed):
    state = stress_radix.run(seed, 250)
    assert state.tree.total_blocks > 0
