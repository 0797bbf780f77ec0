"""sgl_sparse/radix/records.py without SGLang: the per-node record, chain records, the hole helpers, on plain nodes
shaped as SGLang's ``TreeNode`` (``key``, ``children``, ``parent``)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import torch

from sgl_sparse.radix import records
from sgl_sparse.radix.records import (
    EMPTY,
    NODE_ATTR,
    ChainRecord,
    attach,
    descendants,
    find_record,
    holes_of,
    mark_sparse,
    node_record,
    path_holes,
    path_starts,
    set_holes,
    sparse_start,
    void_continuations,
    void_records,
)


class Node:
    """A tree node as the records see it."""

    def __init__(self, n: int, parent: Node | None = None) -> None:
        self.key = list(range(n))
        self.children: dict[Any, Node] = {}
        self.parent = parent
        if parent is not None:
            parent.children[len(parent.children)] = self


def _chain(n: int = 3) -> list[Node]:
    """A root-down path of ``n`` nodes of 4, 5, 6, ... tokens (the root itself not included)."""
    root = Node(0)
    path, parent = [], root
    for i in range(n):
        parent = Node(4 + i, parent)
        path.append(parent)
    return path


def test_records_import_no_sglang() -> None:
    code = ("import sys, sgl_sparse.radix.records, sgl_sparse.prune.spec, sgl_sparse.prune.keep, "
            "sgl_sparse.prune.body, sgl_sparse.prune.tree_ops; "
            "assert not [m for m in sys.modules if m.startswith('sglang')], 'sglang imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_node_gets_one_typed_record() -> None:
    node = Node(6)
    assert find_record(node) is None
    rec = node_record(node)  # a node the tree has not seen is dense
    assert rec.phys == 6 and rec.holes.numel() == 0 and rec.chain is None and rec.sparse_at is None
    assert node_record(node) is rec and getattr(node, NODE_ATTR) is rec
    assert [k for k in vars(node) if k not in ("key", "children", "parent")] == [NODE_ATTR]
    fresh = attach(node, torch.tensor([1, 4]), sparse_at=2)
    assert fresh is not rec and node_record(node) is fresh and fresh.phys == 4 and fresh.sparse_at == 2


def test_set_holes_keeps_phys_in_step_and_the_rest_of_the_record() -> None:
    node = Node(8)
    rec = attach(node)
    rec.chain = ChainRecord(8, torch.arange(8))
    set_holes(node, torch.tensor([0, 3, 7]))
    assert holes_of(node).tolist() == [0, 3, 7] and rec.phys == 5 and rec.chain is not None
    set_holes(node, EMPTY)
    assert rec.phys == 8


def test_chain_record_since_and_hidden_positions() -> None:
    assert ChainRecord(10, torch.arange(10)).since == 10  # unknown: only a match through the end resumes
    assert ChainRecord(10, torch.arange(10), since=4).since == 4
    assert ChainRecord(10, torch.arange(10), since=11).since == 10  # out of range: the end
    rec = ChainRecord(6, torch.tensor([0, 2, 5]))
    hide = rec.hide_on(torch.device("cpu"))
    assert hide.tolist() == [1, 3, 4] and rec.hide_on(torch.device("cpu")) is hide  # built once


def test_path_starts_and_holes_are_logical_positions() -> None:
    path = _chain(3)  # 4, 5, 6 tokens
    assert path_starts(path) == [0, 4, 9] and path_starts([]) == []
    assert path_holes(path, path_starts(path)).numel() == 0
    for node in path:
        attach(node)
    set_holes(path[0], torch.tensor([1]))
    set_holes(path[2], torch.tensor([0, 5]))
    assert path_holes(path, path_starts(path)).tolist() == [1, 9, 14]


def test_sparse_marks_the_nodes_from_the_first_sparse_position() -> None:
    path = _chain(3)  # [0, 4), [4, 9), [9, 15)
    assert sparse_start(path, path_starts(path), 15) == 15
    mark_sparse(path, 6)
    assert [node_record(n).sparse_at for n in path] == [None, 2, 0]
    assert sparse_start(path, path_starts(path), 15) == 6 and sparse_start(path, path_starts(path), 5) == 5
    mark_sparse(path, 5)  # an earlier one wins
    assert [node_record(n).sparse_at for n in path] == [None, 1, 0]
    mark_sparse(path, 12)
    assert [node_record(n).sparse_at for n in path] == [None, 1, 0]


def test_records_that_kept_a_gone_position_are_void() -> None:
    path = _chain(3)
    for i, node in enumerate(path):
        node_record(node).chain = ChainRecord(15, torch.arange(i, 15, 2))
    void_records(path, torch.tensor([3]))  # kept by the records starting at 1 (odd positions)
    assert [node_record(n).chain is not None for n in path] == [True, False, True]


def test_void_continuations_reaches_every_node_below_but_not_the_last() -> None:
    path = _chain(2)
    last = path[0]
    side = Node(3, last)
    below = Node(2, path[1])
    assert {id(n) for n in descendants(last)} == {id(path[1]), id(side), id(below)}
    for node in (last, path[1], side, below):
        node_record(node).chain = ChainRecord(20, torch.tensor([1, 7]))
    node_record(side).chain = ChainRecord(20, torch.tensor([1, 2]))
    void_continuations(last, torch.tensor([7]))
    assert node_record(last).chain is not None and node_record(side).chain is not None
    assert node_record(path[1]).chain is None and node_record(below).chain is None


def test_finished_state_and_match_view_defaults() -> None:
    state = records.FinishedState(kept=torch.arange(3))
    assert state.payload is None and state.tail_start is None and not state.pruned and state.logical_len is None
    view = records.MatchView(3, torch.arange(3), None)
    assert view.payload is None and view.record is None
