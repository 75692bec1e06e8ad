"""The prefix index's tree: each hash's parent and children, for inspection and export.

Matching never reads it (a chained hash names its whole prefix); it is what
:meth:`~.index.PrefixIndex.export` shows, kept with as little memory as a million nodes
allow. The invariants it keeps are the "Tree" ones of :mod:`.index`'s docstring, asserted
by :func:`check_tree`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from kvroute.events import ExternalBlockHash as Hash

# A compact child set: None, one hash, or a dict of hashes to None (an untracked set). Most
# nodes have one child, and a container per node would triple the index's memory.
Kids = Hash | dict[Hash, None] | None


class Node(msgspec.Struct, gc=False):
    """Tree links of one hash. Untracked by the garbage collector (it holds no cycles), so
    a million of them add nothing to the collector's pauses."""

    parent: Hash | None
    tokens: int  # tokens in this block
    children: Kids = None
    depth: int | None = None


def add_kid(kids: Kids, h: Hash) -> Kids:
    if type(kids) is dict:
        kids[h] = None
        return kids
    return h if kids is None or kids == h else {kids: None, h: None}


def discard_kid(kids: Kids, h: Hash) -> Kids:
    if type(kids) is dict:
        kids.pop(h, None)
        return kids if len(kids) > 1 else next(iter(kids), None)
    return None if kids == h else kids


def members(kids: Kids) -> Iterable[Hash]:
    return () if kids is None else kids if type(kids) is dict else (kids,)


def external(h: Hash | None) -> str | int | None:
    """A hash as JSON shows it: bytes as hex, ints as they are."""
    return h.hex() if isinstance(h, bytes) else h


def link(nodes: dict[Hash, Node], orphans: dict[Hash, Kids], h: Hash, node: Node) -> None:
    """Hang ``node`` under its parent (or among the orphans) and fix depths below it."""
    parent = node.parent
    if parent is None:
        node.depth = 0
    elif (p := nodes.get(parent)) is not None:
        p.children = add_kid(p.children, h)
        node.depth = None if p.depth is None else p.depth + 1
    else:
        orphans[parent] = add_kid(orphans.get(parent), h)
    if node.children is not None:
        fix_depths(nodes, node)


def fix_depths(nodes: dict[Hash, Node], node: Node) -> None:
    """Give ``node``'s subtree the depths that ``node.depth`` implies."""
    stack, seen = [(node, node.depth)], set()  # seen: bogus events may close a cycle
    while stack:
        n, d = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        n.depth = d
        cd = None if d is None else d + 1
        for c in members(n.children):
            child = nodes[c]
            if child.depth != cd:
                stack.append((child, cd))


def export_node(nodes: dict[Hash, Node], h: Hash, copies: int) -> dict[str, Any]:
    """One held (``copies`` > 0) or predicted (0) hash, JSON-ready."""
    n = nodes.get(h)
    if n is None:  # only predicted anywhere: no tree node, so no parent known
        out = dict(hash=external(h), parent=None, depth=None, tokens=0)
    else:
        out = dict(hash=external(h), parent=external(n.parent), depth=n.depth, tokens=n.tokens)
    return out | {"copies": copies, "predicted": not copies}


def check_tree(nodes: dict[Hash, Node], orphans: dict[Hash, Kids]) -> None:
    """Asserts the tree's invariants (the index's docstring), in O(size)."""
    for h, node in nodes.items():
        p = nodes.get(node.parent) if node.parent is not None else None
        if node.parent is None:
            assert node.depth == 0, f"root {h!r} at depth {node.depth}"
        elif p is None:
            assert h in members(orphans.get(node.parent)), f"{h!r} lost"
        else:
            assert h in members(p.children), f"{h!r} not among its parent's children"
            assert node.depth == (None if p.depth is None else p.depth + 1), "depth"
        for c in members(node.children):
            assert nodes[c].parent == h, "child names another parent"
    for parent, kids in orphans.items():
        assert parent not in nodes, "orphan of a present parent"
        for c in members(kids):
            assert nodes[c].parent == parent, "orphan names another parent"
