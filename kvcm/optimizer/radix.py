"""A radix tree over block-key sequences, with tombstones: Tair's optimizer index, in Python.

Each node holds a run of consecutive block keys (a path segment with no branching) and its
children keyed by their first key. A block that is evicted or removed stays in its run as a
*tombstone* until :meth:`RadixTree.clean` deletes tombstones that end a branch; inserting the
same block again revives it in place.

Keys are prefix-dependent (a key identifies its whole prefix, as kvcm's and vLLM's do), so a
key lives at exactly one place in the tree: a side index ``key -> node`` makes lookups and
removals O(1) per block, and a lookup needs no walk from the root. Inserting a key that already
sits under another parent is refused with :class:`ValueError`.

Complexity, for ``k`` keys: :meth:`insert` O(k) plus O(s) to split a run of ``s`` blocks;
:meth:`match` and :meth:`remove` O(k); :meth:`clean` O(blocks deleted) when given the removed
keys, O(tree) without.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Iterable, Iterator, Sequence

from kvcm.optimizer.trace import Mask


class _Node:
    __slots__ = ("access_count", "children", "id", "keys", "last_access", "n_alive",
                 "parent", "write_time")  # fmt: skip

    def __init__(self, node_id: int, keys: list[int], parent: _Node | None, now: float) -> None:
        self.id = node_id
        self.keys = keys
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.n_alive = 0
        self.access_count = 0
        self.last_access = now
        self.write_time = now

    def __repr__(self) -> str:
        return f"<node {self.id} blocks={len(self.keys)} alive={self.n_alive} children={len(self.children)}>"


class RadixTree:
    """Compressed trie of block keys with tombstones (see the module docstring)."""

    def __init__(self) -> None:
        self.root = _Node(0, [], None, 0.0)
        self._where: dict[int, _Node] = {}
        self._live: set[int] = set()
        self._next_id = 1

    def __len__(self) -> int:
        """Live (non-tombstone) blocks."""
        return len(self._live)

    def __contains__(self, key: object) -> bool:
        """True if ``key`` is a live block."""
        return key in self._live

    @property
    def total_blocks(self) -> int:
        """Blocks in the tree, tombstones included."""
        return len(self._where)

    def nodes(self) -> Iterator[_Node]:
        """Every node, breadth first from the root (the root included)."""
        queue = deque([self.root])
        while queue:
            node = queue.popleft()
            yield node
            queue.extend(node.children.values())

    def parent_of(self, key: int) -> int | None:
        """The block before ``key`` on its path (None at the top). :raises KeyError: not in tree."""
        node = self._where[key]
        pos = node.keys.index(key)
        if pos:
            return node.keys[pos - 1]
        up = node.parent
        return up.keys[-1] if up is not None and up.keys else None

    # --- insert --------------------------------------------------------------------------------

    def insert(self, keys: Sequence[int], now: float = 0.0, parent: int | None = None) -> list[int]:
        """Add the path ``keys`` below ``parent`` (the root if None or not in the tree).

        Returns the keys written: new blocks and revived tombstones, in order.
        :raises ValueError: a new key already sits elsewhere in the tree.
        """
        node, end = self._anchor(parent)
        live, written, i, n = self._live, [], 0, len(keys)
        while i < n:
            key = keys[i]
            if end == len(node.keys):
                child = node.children.get(key)
                if child is None:
                    written += self._add(node, list(keys[i:]), now)
                    break
                node, end = child, 0
            elif node.keys[end] != key:
                self._split(node, end)
                continue
            if key not in live:
                live.add(key)
                node.n_alive += 1
                written.append(key)
            end += 1
            i += 1
        return written

    def _anchor(self, parent: int | None) -> tuple[_Node, int]:
        """Where a path below ``parent`` starts: (node, number of its keys already matched)."""
        node = self._where.get(parent) if parent is not None else None
        if node is None or parent is None:
            return self.root, 0
        return node, node.keys.index(parent) + 1

    def _add(self, node: _Node, rest: list[int], now: float) -> list[int]:
        where = self._where
        if node is not self.root and not node.children:
            target = node  # extend a leaf's run, as Tair does, instead of adding a child
        else:
            target = _Node(self._next_id, [], node, now)
            self._next_id += 1
            node.children[rest[0]] = target
        for key in rest:
            if key in where:
                raise ValueError(
                    f"block key {key} is already in the tree under another parent; "
                    "keys must be prefix-dependent"
                )
            where[key] = target
            target.keys.append(key)
        self._live.update(rest)
        target.n_alive += len(rest)
        target.write_time = now
        return rest

    def _split(self, node: _Node, at: int) -> None:
        """Cut ``node``'s run before position ``at``; the tail becomes its only child."""
        tail = _Node(self._next_id, node.keys[at:], node, node.write_time)
        self._next_id += 1
        tail.children, tail.access_count, tail.last_access = (
            node.children, node.access_count, node.last_access
        )
        for child in tail.children.values():
            child.parent = tail
        live = self._live
        tail.n_alive = sum(1 for k in tail.keys if k in live)
        node.n_alive -= tail.n_alive
        node.keys = node.keys[:at]
        node.children = {tail.keys[0]: tail}
        for key in tail.keys:
            self._where[key] = tail

    # --- queries -------------------------------------------------------------------------------

    def match(self, keys: Sequence[int], mask: Mask = 0, now: float = 0.0) -> tuple[int, int]:
        """Prefix query: ``(internal, external)`` hits, as kvcm's ``prefix_match`` counts them.

        Masked blocks (an offset, or one bool per key) are on the device: they count as internal
        hits and are skipped; then the leading live blocks of the rest are external hits. Every
        node holding a hit gets its access count and time updated.
        """
        n = len(keys)
        if isinstance(mask, int):
            internal = min(max(mask, 0), n)
            look: Iterable[int] = keys[internal:]
        else:
            internal = sum(1 for m in mask[:n] if m)
            look = [k for k, m in zip(keys, mask) if not m]
        live, where, last, external = self._live, self._where, None, 0
        for key in look:
            if key not in live:
                break
            external += 1
            node = where[key]
            if node is not last:
                node.access_count += 1
                node.last_access = now
                last = node
        return internal, external

    # --- removal and cleaning ------------------------------------------------------------------

    def remove(self, keys: Iterable[int], clean: bool = False) -> int:
        """Turn live blocks into tombstones (unknown or dead keys are ignored); returns how many.

        With ``clean``, tombstones that now end a branch are deleted right away.
        """
        live, where, touched, n = self._live, self._where, [], 0
        for key in keys:
            if key in live:
                live.discard(key)
                node = where[key]
                node.n_alive -= 1
                touched.append(node)
                n += 1
        if clean and touched:
            self._clean_nodes(touched)
        return n

    def clean(self) -> int:
        """Delete every tombstone that ends a branch (repeatedly); returns blocks deleted."""
        leaves = [node for node in self.nodes() if not node.children]
        return self._clean_nodes(leaves)

    def _clean_nodes(self, nodes: Iterable[_Node]) -> int:
        deleted = 0
        for node in nodes:
            while node is not self.root and not node.children and node.keys:
                first = node.keys[0]
                deleted += self._trim(node)
                if node.keys:
                    break
                up = node.parent
                assert up is not None
                del up.children[first]
                node = up
        return deleted

    def _trim(self, leaf: _Node) -> int:
        """Drop the tombstones at the end of a leaf's run; returns how many."""
        keys, live, where, n = leaf.keys, self._live, self._where, 0
        while keys and keys[-1] not in live:
            del where[keys.pop()]
            n += 1
        return n

    # --- export --------------------------------------------------------------------------------

    def export(self) -> list[dict[str, float | None]]:
        """Nodes breadth first, for visualization (Tair's ``ExportForVisualization`` fields)."""
        out = []
        for node in self.nodes():
            out.append({
                "node_id": node.id,
                "parent_id": node.parent.id if node.parent is not None else None,
                "first_key": node.keys[0] if node.keys else None,
                "total_blocks": len(node.keys),
                "cached_blocks": node.n_alive,
                "access_count": node.access_count,
                "last_access_time": node.last_access,
                "write_time": node.write_time,
                "is_leaf": not node.children,
            })  # fmt: skip
        return out

    def to_dot(self, max_nodes: int = 500) -> str:
        """Graphviz text of the first ``max_nodes`` nodes (breadth first)."""
        lines = ["digraph radix {", "  node [shape=box, fontsize=10];"]
        for i, node in enumerate(self.nodes()):
            if i >= max_nodes:
                break
            label = f"{len(node.keys)} blocks\\n{node.n_alive} cached\\n{node.access_count} hits"
            lines.append(f'  n{node.id} [label="{label}"];')
            if node.parent is not None:
                lines.append(f"  n{node.parent.id} -> n{node.id};")
        lines.append("}")
        return "\n".join(lines) + "\n"

    # --- invariants ----------------------------------------------------------------------------

    def check(self) -> None:
        """Assert every structural invariant; prints the offending node on failure."""
        node = self.root
        try:
            assert not self.root.keys and self.root.parent is None, "root is empty and has no parent"
            seen: set[int] = set()
            ids: set[int] = set()
            for node in self.nodes():
                self._check_node(node, seen, ids)
            assert seen == set(self._where), "the index holds exactly the keys of the tree"
            assert self._live <= seen, "live blocks are in the tree"
        except AssertionError:
            print(f"radix check failed at {node!r}: keys={node.keys[:8]}", file=sys.stderr)
            raise

    def _check_node(self, node: _Node, seen: set[int], ids: set[int]) -> None:
        assert node.id not in ids, "node ids are unique"
        ids.add(node.id)
        if node is not self.root:
            assert node.keys, "only the root has an empty run"
        for key in node.keys:
            assert key not in seen, f"key {key} appears once"
            seen.add(key)
            assert self._where.get(key) is node, f"index of {key} points at its node"
        assert node.n_alive == sum(1 for k in node.keys if k in self._live), "live count"
        for first, child in node.children.items():
            assert child.parent is node, "child points back at its parent"
            assert child.keys and child.keys[0] == first, "child is keyed by its first block"
