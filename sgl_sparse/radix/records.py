"""What the Chain Cache tree records, SGLang-free (torch only): one typed payload per tree node, the records a
finished request leaves, what a match hands a request, and the hole helpers.

SGLang's ``TreeNode`` gets exactly one attribute, ``node.sgl_sparse`` (:data:`NODE_ATTR`), holding a
:class:`NodeRecord`; every read goes through :func:`node_record`. The functions here take any node with SGLang's
shape (``key``, ``children``, ``parent``), so they are tested without SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from sgl_sparse.contract import TreePayload
from sgl_sparse.slots import complement, to_device

EMPTY = torch.empty(0, dtype=torch.int64)
VIEW_ATTR = "_sgl_sparse_view"  # set on SGLang's Req by the tree's match: what the request may see (a MatchView)
NODE_ATTR = "sgl_sparse"  # the one attribute on SGLang's TreeNode: its NodeRecord


@dataclass
class ChainRecord:
    """What a finished request of an evicting method left for its continuations: the sorted logical
    positions (CPU int64) it kept of its ``end`` tokens, and its method's :class:`TreePayload`.

    ``since``: the shortest match that may resume from it without reaching ``end``: the finished
    request's whole prompt (so only its own conversation qualifies, never another one that shares a
    system prompt) and its last eviction (``RequestState.tail_start``: from there on it only
    appended, so ``kept`` cut at any ``d >= since`` is the state it had at length ``d``), less a
    trailing generation prompt (``SparseRadixCache.resume_since``: the one cut that is not exactly
    such a state; the kept positions before it were scored with it in the window). ``end`` when
    unknown (not given, or out of ``[0, end]``)."""

    end: int
    kept: torch.Tensor
    payload: TreePayload | None = None
    since: int = -1
    # The finished request's prompt length (None: a prune's record). A request resumes inside the tail only when its
    # own prompt runs past it: the same prompt sent again (another user's first question) is not a continuation.
    prompt_len: int | None = None
    _hide_dev: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.since <= self.end:
            self.since = self.end

    def hide_on(self, device: torch.device) -> torch.Tensor:
        """Positions of ``[0, end)`` outside the kept set, cached on the device (built once)."""
        if self._hide_dev is None or self._hide_dev.device != device:
            self._hide_dev = to_device(complement(self.kept, self.end), device)
        return self._hide_dev


@dataclass(frozen=True)
class MatchView:
    """What a request's match gives it (stashed on the request, read by the runtime at its first
    step): ``length`` usable logical tokens of which ``kept`` (sorted CPU positions) hold visible KV,
    the record whose continuation it is (``None``: a dense prefix, ``kept`` is all of it), and the
    payload to restore (the record's when the match reaches its end; a payload describes the
    finished request at ``end``, so a continuation from inside its tail gets none)."""

    length: int
    kept: torch.Tensor
    record: ChainRecord | None
    payload: TreePayload | None = None


@dataclass(frozen=True)
class FinishedState:
    """What the runtime reports for a finishing request: its kept positions (sorted, CPU), payload, the
    logical length at its last eviction (``RequestState.tail_start``), and, when its own prune asked for it,
    the position after which the idle branches off its path are evicted before its hidden KV is freed."""

    kept: torch.Tensor
    payload: TreePayload | None = None
    tail_start: int | None = None
    evict_branches_after: int | None = None
    # Its own prune hid positions: the sequence's cached continuations (below its end, e.g. the turn's reply when
    # the route's snapkv_global prunes a cached turn through a request) are compacted and their records dropped
    # as a route prune does, not shielded by copy-on-write.
    pruned: bool = False
    # RequestState.sparse_from: K/V from this logical position on were computed under a sparse view.
    sparse_from: int | None = None
    # RequestState.logical_len: the positions its steps saw. SGLang may hand one more: under overlap scheduling
    # the forward launched before a request's finish was seen wrote its last token's K/V, a forward whose step
    # the runtime skips (integration/step.py); that position is freed, not cached, as without overlap, unless
    # the request hid nothing.
    logical_len: int | None = None

    @property
    def hid_nothing(self) -> bool:
        """Every position its steps saw is kept: the tree caches it as dense, that last position included
        (a view that hid nothing computed it)."""
        return self.logical_len is not None and int(self.kept.numel()) == self.logical_len and not self.pruned


@dataclass
class NodeRecord:
    """sgl_sparse's state of one tree node: ``holes``, the sorted positions (relative to the node) whose KV was
    freed (``SENTINEL_SLOT`` in the value); ``phys``, the live slots it holds (``len(key) - len(holes)``, what
    every size counts); ``chain``, the record of the finished sequence that ends at this node; ``sparse_at``, the
    first position (relative) whose K/V a finished request computed under a sparse view."""

    phys: int
    holes: torch.Tensor = field(default_factory=lambda: EMPTY)
    chain: ChainRecord | None = None
    sparse_at: int | None = None


def find_record(node: Any) -> NodeRecord | None:
    """The node's record, ``None`` for a node the tree has not seen yet (a leaf SGLang's insert just made)."""
    return getattr(node, NODE_ATTR, None)


def node_record(node: Any) -> NodeRecord:
    """The node's record; a node the tree has not seen yet gets a dense one (every slot live, as SGLang counts)."""
    rec = find_record(node)
    if rec is None:
        rec = NodeRecord(phys=len(node.key))
        setattr(node, NODE_ATTR, rec)
    return rec


def attach(node: Any, holes: torch.Tensor = EMPTY, sparse_at: int | None = None) -> NodeRecord:
    """Give ``node`` a fresh record with ``holes`` (relative, sorted) and no chain record."""
    rec = NodeRecord(phys=len(node.key) - int(holes.numel()), holes=holes, sparse_at=sparse_at)
    setattr(node, NODE_ATTR, rec)
    return rec


def holes_of(node: Any) -> torch.Tensor:
    return node_record(node).holes


def set_holes(node: Any, holes: torch.Tensor) -> None:
    rec = node_record(node)
    rec.holes = holes
    rec.phys = len(node.key) - int(holes.numel())


def path_starts(path: list[Any]) -> list[int]:
    """The logical position each node of a root-down ``path`` starts at."""
    starts, pos = [], 0
    for node in path:
        starts.append(pos)
        pos += len(node.key)
    return starts


def path_holes(path: list[Any], starts: list[int]) -> torch.Tensor:
    """Every hole of ``path`` as a logical position (sorted, CPU)."""
    holes = [node_record(n).holes + s for n, s in zip(path, starts) if node_record(n).holes.numel()]
    return torch.cat(holes) if holes else EMPTY


def mark_sparse(path: list[Any], sparse_from: int) -> None:
    """Mark the nodes of a finished sequence whose K/V (from logical position ``sparse_from`` on) its request
    computed under a sparse view: ``sparse_at``, the first such position relative to the node."""
    for node, start in zip(path, path_starts(path)):
        if start + len(node.key) > sparse_from:
            rec = node_record(node)
            at = max(0, sparse_from - start)
            rec.sparse_at = at if rec.sparse_at is None else min(rec.sparse_at, at)


def sparse_start(path: list[Any], starts: list[int], pos: int) -> int:
    """The first logical position of ``path`` whose K/V was computed under a sparse view, else ``pos``."""
    for node, s in zip(path, starts):
        at = node_record(node).sparse_at
        if at is not None:
            return min(pos, s + at)
    return pos


def void_records(nodes: list[Any], gone: torch.Tensor) -> None:
    """Drop the chain records of ``nodes`` whose kept set holds a position in ``gone``: a record that kept a
    freed or pruned position is void."""
    for node in nodes:
        rec = node_record(node)
        if rec.chain is not None and bool(torch.isin(rec.chain.kept, gone).any()):
            rec.chain = None


def descendants(top: Any) -> list[Any]:
    """Every node below ``top`` (not itself)."""
    out, stack = [], list(top.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def void_continuations(last: Any, hide: torch.Tensor) -> None:
    """Drop the records below ``last`` (continuations of a pruned sequence cached before the prune, e.g. the turn's
    own reply) whose kept set holds a pruned position. Where the prune freed that position the record is void anyway;
    where a shared node kept its KV (another branch reads it), the record would still look whole, and a next turn
    resuming from it (its match runs through ``last`` into that continuation) would read the pruned range again."""
    void_records(descendants(last), hide)


@dataclass
class PathView:
    """What the tree serves for a token sequence: ``length`` visible logical tokens (a match), of which
    ``kept`` hold resident KV, their slots (``slots[p]`` for a kept ``p``; on the pool's device), and the path of
    nodes that holds them."""

    length: int
    kept: torch.Tensor
    slots: torch.Tensor
    nodes: list[Any] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    record: ChainRecord | None = None
