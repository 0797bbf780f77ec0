"""``SparseRadixCache``: SGLang's radix tree whose node values may hold sentinel slots (Chain Cache).

A node value holds one KV slot per logical token; a position whose KV was evicted holds
``SENTINEL_SLOT`` (a *hole*). Versus the stock ``RadixCache``:

* every size (evictable, protected, total) counts *physical* slots (``NodeRecord.phys``), so SGLang's
  strict idle leak check ``available + evictable + protected == total`` holds; every free skips holes;
* keys are namespaced by the method fingerprint (compacted KV of one config is never matched under
  another);
* with an evicting method a request's KV enters the tree only when it finishes, and Chain Cache is
  **copy-on-write** (docs/chain-cache.md):

  - holes are known on the host (``NodeRecord.holes``, sorted relative positions): no device sync to
    count, split, match or evict;
  - a finishing request compacts in place only the nodes *exclusive* to its path (unlocked, no other
    branch below them); nodes shared with other branches keep their KV;
  - its kept set is stored as a :class:`ChainRecord` on the node that ends its sequence; a later
    request that matches through that node is its continuation and sees exactly that kept set
    (positions outside it are hidden in its view, even where the tree holds them); so is a request
    that leaves the sequence after the record's ``since`` (past the finished request's whole prompt
    and its last eviction), e.g. an agent's next turn whose re-tokenized history differs inside the
    previous answer: it sees the kept set cut at its match, exactly the state the finished request
    had at that length. When the prompt ends with the chat template's generation prompt, ``since``
    backs off over it (``resume_suffix``): a prune or match of the turn's messages renders them
    without it, and templates that render the history's assistant turn differently from their
    generation prompt make the next turn leave there;
  - a request that is not a continuation of any valid record never sees a hole: its match stops at
    the first one, and it recomputes the rest (then its KV fills the holes of the dense region it
    shares, so the next conversation matches further). So one conversation's eviction never changes
    what another conversation attends to.

With a non-evicting method (``dense``) no hole ever exists and the behaviour is the stock one.
"""

from __future__ import annotations

import heapq
import time
from array import array
from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from sgl_sparse.contract import SparseMethod
from sgl_sparse.radix.records import (
    EMPTY,
    VIEW_ATTR,
    ChainRecord,
    FinishedState,
    MatchView,
    PathView,
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
from sgl_sparse.request import match_view, set_match_view
from sgl_sparse.slots import complement, live_slots, retained_positions, to_device, write_sentinels


class SparseRadixCache(RadixCache):
    """SGLang's ``RadixCache`` with Chain Cache (module docstring). Besides SGLang's interface, its public API
    for Prefix-Cache Pruning (:mod:`sgl_sparse.prune.tree_ops`): :meth:`view_of` (what a sequence's match
    serves), :meth:`path_to`, :meth:`node_ending_at`, :meth:`compact_exclusive`, :meth:`evict_side_branches`
    and :meth:`drop_leaf`; the per-node state is a :class:`~sgl_sparse.radix.records.NodeRecord`."""

    def __init__(self, params: CacheInitParams, method: SparseMethod[Any], fingerprint: str,
                 on_finish: Callable[[Any], FinishedState | None] | None = None,
                 evicts_for: Callable[[Any], bool] | None = None, evicting: bool | None = None,
                 window_for: Callable[[Any], int] | None = None) -> None:
        self.method = method
        self.fingerprint = fingerprint
        # Whether any request may evict (then a match may meet holes); per request, ``evicts_for(req)``
        # (per-request methods: a request of a dense config is cached the stock way, at every chunk, in
        # its own namespace), else every request as ``method``.
        self.evicting = method.evicts if evicting is None else evicting
        self._evicts_for = evicts_for
        # window_for(req): how many of its prompt's last positions req's final prefill reads the queries of (an
        # observation window); a dense prefix hit leaves them to be computed (_chain_view).
        self._window_for = window_for
        # Runtime callback(req) -> FinishedState (or None: the request never ran a step); it also drops
        # the request's per-request state.
        self._on_finish = on_finish
        self._insert_holes: torch.Tensor | None = None  # absolute holes of the value being inserted
        self._insert_len = 0
        # The chat template's generation prompt as token ids (integration/chat_resume.py), which the
        # next turn may render differently: a record lets a continuation resume from before it.
        self.resume_suffix: tuple[int, ...] = ()
        super().__init__(params)

    def _evicts(self, req: Any) -> bool:
        """Whether ``req`` is cached the Chain Cache way (insertion at finish, its holes and record kept):
        its method evicts, or it continues a record (a pruned or compacted sequence), whose hidden positions
        its own finished sequence must keep hiding."""
        if not self.evicting:
            return False
        if self._evicts_for is None or self._evicts_for(req):
            return True
        view = match_view(req)
        return view is not None and view.record is not None

    def _chain_cached(self, req: Any, token_ids: Any) -> bool:
        """``_evicts(req)``, or a request of a non-evicting config whose sequence runs into holes the tree
        holds in its namespace (a pruned range, or an evicting request's record on a mixed server): the
        stock insertion would hand it the tree's sentinels for positions it computed itself (and SGLang's
        chunk caching asserts against that), so it is cached at finish, its slots filling those holes."""
        if self._evicts(req):
            return True
        if not self.evicting or self.disable:
            return False
        res = super().match_prefix(MatchPrefixParams(key=self._ns(RadixKey(token_ids, req.extra_key))))
        return any(holes_of(node).numel() for node in self.path_to(res.last_device_node))

    # -- namespace -------------------------------------------------------------------------------
    def _ns(self, key: RadixKey) -> RadixKey:
        """Only the public entry points (``match_prefix``, ``insert``) call this, once per key."""
        extra = self.fingerprint if key.extra_key is None else f"{self.fingerprint}:{key.extra_key}"
        return RadixKey(key.token_ids, extra, is_bigram=key.is_bigram, limit=key.limit)

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        res = super().match_prefix(_with_key(params, self._ns(params.key)))
        if not self.evicting:
            return res
        return self._chain_view(res, params.req)

    def insert(self, params: InsertParams) -> InsertResult:
        return super().insert(_with_key(params, self._ns(params.key)))

    # -- physical sizes (host-side: no device sync) -----------------------------------------------
    def reset(self) -> None:
        super().reset()
        attach(self.root_node)

    def _split_node(self, key: RadixKey, child: TreeNode, split_len: int) -> TreeNode:
        rec = node_record(child)
        holes, at = rec.holes, rec.sparse_at
        new_node = super()._split_node(key, child, split_len)
        # A chain record stays with the node that ends its sequence (the child).
        attach(new_node, holes[holes < split_len], at if at is not None and at < split_len else None)
        set_holes(child, holes[holes >= split_len] - split_len)
        rec.sparse_at = None if at is None else max(0, at - split_len)
        return new_node

    def _insert_helper(self, node: TreeNode, key: RadixKey, value: torch.Tensor, priority: int = 0,
                       chunked: bool = False) -> tuple[int, TreeNode]:
        remaining = len(key)
        prefix_len, last = super()._insert_helper(node, key, value, priority, chunked)
        if find_record(last) is None:  # a new leaf: the stock code counted len(key) slots
            start = self._insert_len - (remaining - prefix_len)
            h = self._insert_holes
            rel = EMPTY if h is None else h[(h >= start) & (h < start + len(last.key))] - start
            self.evictable_size_ -= len(last.key) - attach(last, rel).phys
        return prefix_len, last

    def _delete_leaf(self, node: TreeNode) -> None:
        super()._delete_leaf(node)
        self.evictable_size_ += len(node.key) - node_record(node).phys

    def inc_lock_ref(self, node: TreeNode) -> IncLockRefResult:
        if self.disable:
            return IncLockRefResult(delta=0)
        delta = 0
        while node != self.root_node:
            if node.lock_ref == 0:
                phys = node_record(node).phys
                self.evictable_size_ -= phys
                self.protected_size_ += phys
                delta -= phys
            node.lock_ref += 1
            self._update_leaf_status(node)
            node = node.parent
        return IncLockRefResult(delta=delta)

    def dec_lock_ref(self, node: TreeNode, params: Any = None) -> DecLockRefResult:
        if self.disable:
            return DecLockRefResult(delta=0)
        delta = 0
        while node != self.root_node:
            if node.lock_ref == 1:
                phys = node_record(node).phys
                self.evictable_size_ += phys
                self.protected_size_ -= phys
                delta += phys
            node.lock_ref -= 1
            self._update_leaf_status(node)
            node = node.parent
        return DecLockRefResult(delta=delta)

    def _live_value(self, node: TreeNode) -> torch.Tensor:
        holes = holes_of(node)
        if holes.numel() == 0:
            return node.value
        return node.value[to_device(complement(holes, len(node.key)), node.value.device)]

    def evict(self, params: EvictParams) -> EvictResult:
        if self.disable:
            return EvictResult()
        start_time = time.perf_counter()
        heap = [(self.eviction_strategy.get_priority(n), n) for n in self.evictable_leaves]
        heapq.heapify(heap)
        num_evicted = 0
        while num_evicted < params.num_tokens and heap:
            _, x = heapq.heappop(heap)
            num_evicted += self.drop_leaf(x)
            if len(x.parent.children) == 0 and x.parent.lock_ref == 0:
                heapq.heappush(heap, (self.eviction_strategy.get_priority(x.parent), x.parent))
        self.update_eviction_metrics(num_evicted, start_time)
        return EvictResult(num_tokens_evicted=num_evicted)

    def drop_leaf(self, node: TreeNode) -> int:
        """Evict the unlocked leaf ``node``: its live slots go back to the pool. Returns how many."""
        self.token_to_kv_pool_allocator.free(self._live_value(node))
        freed = node_record(node).phys
        self._delete_leaf(node)
        self._record_remove_event(node)
        return freed

    def _total_size_helper(self) -> int:
        total, stack = 0, [self.root_node]
        while stack:
            node = stack.pop()
            total += node_record(node).phys
            stack.extend(c for c in node.children.values() if not c.evicted)
        return total

    # -- what a match may see (evicting methods) ---------------------------------------------------
    def path_to(self, last: TreeNode) -> list[TreeNode]:
        """The nodes from the root (excluded) down to ``last``."""
        path = []
        while last is not None and last is not self.root_node:
            path.append(last)
            last = last.parent
        return path[::-1]

    def _chain_view(self, res: MatchResult, req: Any) -> MatchResult:
        """Cut the stock match to what this request may see (module docstring): the end of the
        deepest record on the path whose kept set is still fully resident, else the first hole."""
        path = self.path_to(res.last_device_node)
        starts = path_starts(path)
        pos = starts[-1] + len(path[-1].key) if path else 0
        all_holes = path_holes(path, starts)
        record: ChainRecord | None = None
        for node in reversed(path):
            rec = node_record(node).chain
            if rec is not None and not bool(torch.isin(rec.kept, all_holes).any()):
                record = rec
                break
        payload = record.payload if record is not None else None
        if record is not None:
            length, kept = record.end, record.kept
        else:
            length = int(all_holes.min()) if all_holes.numel() else pos
            # K/V computed under a finished request's sparse view is no dense prefix: where its hidden positions
            # lay in a prefix another path shares, nothing was freed and no hole stops the match there.
            length = min(length, sparse_start(path, starts, pos))
            kept = torch.arange(length)
        # A hole or a record ends the view early, or the path has neither (a conversation whose method hid only
        # positions another branch shares, so none was freed: without this its next turn read them again, where
        # alone it resumed from its record): resume inside a record's tail?
        if length < pos or (record is None and pos > 0):
            past = len(req.origin_input_ids) if hasattr(req, "origin_input_ids") else None  # a probe: no prompt
            inner = self._record_below(res.last_device_node, pos, all_holes, past)
            if inner is not None:
                record, payload, length = inner, None, pos
                kept = inner.kept[inner.kept < pos]
        # (A probe of view_of, which asks what is cached, carries no prompt and gets the whole view.)
        if record is None and self._window_for is not None and hasattr(req, "origin_input_ids"):
            # A dense hit that covers the positions whose queries the request's method observes would hand it a
            # shorter window than computing its prompt gives, so its kept set, and answer, would depend on what
            # another request had cached (PyramidKV: the same prompt twice answered differently). Those positions
            # are computed again; a Chain Cache record is resumed as it is (its window is the new tokens).
            total = len(req.origin_input_ids) + len(req.output_ids)
            cap = max(0, total - self._window_for(req))
            if length > cap:
                length, kept = cap, torch.arange(cap)
        if req is not None:
            set_match_view(req, MatchView(length, kept, record, payload))
        if length == pos and record is None:
            return res  # a dense prefix, no hole: the stock result as it is
        indices = res.device_indices[:length]
        if record is not None:
            indices = indices.clone()
            hide = record.hide_on(indices.device) if length == record.end else to_device(complement(kept, length),
                                                                                         indices.device)
            write_sentinels(indices, hide)
        last = self.node_ending_at(path, starts, length)
        return res._replace(device_indices=indices, last_device_node=last, last_host_node=last,
                            best_match_node=last)

    def _record_below(self, node: TreeNode, pos: int, holes: torch.Tensor, prompt_len: int | None = None,
                      limit: int = 256) -> ChainRecord | None:
        """A record on a sequence that runs through ``node`` (the match ends at ``pos``) from which a
        match of ``pos`` tokens may resume: ``since <= pos``, its kept positions before ``pos`` all
        resident, and, for a request of ``prompt_len`` prompt tokens, a prompt longer than the record's.
        Deepest ``since`` first (the latest decision). Looks at ``limit`` nodes at most."""
        best: ChainRecord | None = None
        stack, seen = list(node.children.values()), 0
        while stack and seen < limit:
            child = stack.pop()
            seen += 1
            rec = node_record(child).chain
            if (rec is not None and rec.since <= pos < rec.end and (best is None or rec.since > best.since)
                    and (prompt_len is None or rec.prompt_len is None or prompt_len > rec.prompt_len)):
                if not bool(torch.isin(rec.kept[rec.kept < pos], holes).any()):
                    best = rec
            stack.extend(child.children.values())
        return best

    def node_ending_at(self, path: list[TreeNode], starts: list[int], length: int) -> TreeNode:
        """The path node that ends at logical position ``length`` (splitting one if needed)."""
        if length == 0:
            return self.root_node
        for node, s in zip(path, starts):
            end = s + len(node.key)
            if end == length:
                return node
            if s < length < end:
                return self._split_node(node.key, node, length - s)
        raise AssertionError(f"no path node ends at {length}")

    # -- request lifecycle -----------------------------------------------------------------------
    def cache_finished_req(self, req: Any, is_insert: bool = True, *, kv_len_to_handle: int) -> None:
        finished = self._on_finish(req) if self._on_finish is not None else None
        token_ids = (req.origin_input_ids + req.output_ids)[:kv_len_to_handle]
        dense = finished is None or finished.hid_nothing
        if not dense and finished is not None and finished.logical_len is not None:
            token_ids = token_ids[:finished.logical_len]
        if not self._chain_cached(req, token_ids):
            return super().cache_finished_req(req, is_insert, kv_len_to_handle=kv_len_to_handle)
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        alloc = self.token_to_kv_pool_allocator
        n = len(token_ids)
        protected = req.cache_protected_len
        kept = retained_positions(row[:n]) if dense or finished is None else finished.kept
        kept = kept[kept < n]
        if self.disable or self.disable_finished_insert or not is_insert:
            alloc.free(self._owned_live(row, kept, protected, n, kv_len_to_handle))
            if not self.disable and req.last_node is not None:
                self.dec_lock_ref(req.last_node)
            return
        key = self._ns(RadixKey(token_ids, req.extra_key))
        hidden = complement(kept, n)
        self._insert_holes, self._insert_len = hidden, n
        try:
            values = row[:n].to(dtype=torch.int64, copy=True)
            prefix_len = super().insert(InsertParams(key=key, value=values,
                                                     priority=getattr(req, "priority", 0) or 0)).prefix_len
        finally:
            self._insert_holes = None
        path = self._path_of(key)
        # Request-owned positions the tree already held: fill the tree's holes in its dense region,
        # free the rest (duplicates). Then the tail beyond the key.
        transferred = self._fill_holes(path, row, kept, protected, prefix_len)
        dup = kept[(kept >= protected) & (kept < prefix_len)]
        if transferred.numel():
            dup = dup[~torch.isin(dup, transferred)]
        alloc.free(row[to_device(dup, row.device)].long())
        if kv_len_to_handle > n:
            alloc.free(live_slots(row[n:kv_len_to_handle]).long())
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        if finished is not None and finished.evict_branches_after is not None:
            # Its own prune's evict_branches (the route's rule): stale branches (an agent's replies as generated)
            # would otherwise keep the pruned KV resident for themselves; locked ones are left alone.
            self.evict_side_branches(path, finished.evict_branches_after)
        if finished is not None and finished.sparse_from is not None:
            mark_sparse(path, finished.sparse_from)
        own = finished is not None and finished.pruned
        self.compact_exclusive(path, hidden, own_tail=own)
        if own and hidden.numel():
            void_continuations(path[-1], hidden)
        if hidden.numel():
            since = n  # unknown without the runtime's state: only a match through the end resumes
            if finished is not None and finished.tail_start is not None:
                since = self._resume_since(req.origin_input_ids, finished.tail_start)
            node_record(path[-1]).chain = ChainRecord(n, kept.clone(), finished.payload if finished else None,
                                                      since=since, prompt_len=len(req.origin_input_ids))
        # A request that hid nothing leaves an existing record of the same sequence in place: positions
        # past it were computed under that record's view.

    def _resume_since(self, prompt: Any, tail_start: int) -> int:
        """A record's ``since``: the finished request's whole prompt and its last eviction, less the
        chat template's generation prompt when the prompt ends with it and nothing was evicted after
        the prompt. Two requests of the same conversation leave the sequence there, just before the
        prompt's end: a prune (or match) of the turn's messages, which renders them without the
        generation prompt (an agent pruning the turn it just sent: without this its match stopped at the
        conversation's previous record, and the prune failed or landed there), and, for a template whose
        generation prompt differs from how it renders that assistant turn in the history (e.g.
        ``assistant:`` then ``<s>assistant: text``, or DeepSeek-R1's ``<think>``), the next turn. The
        conversation's earlier messages all match, so it is still this conversation."""
        n = len(prompt)
        if tail_start > n:
            return tail_start
        k = len(self.resume_suffix)
        if 0 < k <= n and tuple(prompt[n - k:]) == self.resume_suffix:
            return n - k
        return n

    def _owned_live(self, row: torch.Tensor, kept: torch.Tensor, protected: int, n: int, end: int) -> torch.Tensor:
        """Live request-owned slots of ``row[:end]`` (kept positions past ``protected``, and any
        tail past the logical tokens), without a device sync."""
        own = kept[kept >= protected]
        slots = row[to_device(own, row.device)].long()
        if end > n:
            slots = torch.cat([slots, live_slots(row[n:end]).long()])
        return slots

    def _path_of(self, key: RadixKey) -> list[TreeNode]:
        node, pos, path = self.root_node, 0, []
        while pos < len(key):
            node = node.children[key[pos:].child_key(self.page_size)]
            path.append(node)
            pos += len(node.key)
        return path

    def _fill_holes(self, path: list[TreeNode], row: torch.Tensor, kept: torch.Tensor, protected: int,
                    prefix_len: int) -> torch.Tensor:
        """Give the tree this request's live slots at positions where the tree has holes (positions it
        recomputed because its match stopped before them): its record needs them resident, and in the
        dense region the next conversation matches further. Returns the positions whose slots moved."""
        moved, pos = [], 0
        for node in path:
            if pos >= prefix_len:
                break
            h = holes_of(node)
            if h.numel():
                cand = h + pos
                take = cand[torch.isin(cand, kept) & (cand >= protected)]
                if take.numel():
                    node.value[to_device(take - pos, node.value.device)] = row[to_device(take, row.device)].long()
                    set_holes(node, h[~torch.isin(h, take - pos)])
                    if node.lock_ref == 0:
                        self.evictable_size_ += int(take.numel())
                    else:
                        self.protected_size_ += int(take.numel())
                    moved.append(take)
            pos += len(node.key)
        return torch.cat(moved) if moved else EMPTY

    def compact_exclusive(self, path: list[TreeNode], hidden: torch.Tensor, own_tail: bool = False) -> None:
        """Free the KV the finished request hid, on the nodes only its path reaches (no lock, no other
        branch below them): bottom-up until the first shared node. ``own_tail``: the last node's children
        all extend the sequence (a prune of a cached sequence: every match through them continues it, so
        it sees the record at its end and never a hole), so they do not make the last node shared."""
        if not hidden.numel():
            return
        starts = path_starts(path)
        below: TreeNode | None = None
        freed_abs: list[torch.Tensor] = []
        for node, s in zip(reversed(path), reversed(starts)):
            branches = len(node.children) - (1 if below is not None else 0)
            if own_tail and node is path[-1]:
                branches = 0
            if node.lock_ref > 0 or branches > 0:
                break
            below = node
            h = hidden[(hidden >= s) & (hidden < s + len(node.key))] - s
            if not h.numel():
                continue
            new = h[~torch.isin(h, holes_of(node))]
            if not new.numel():
                continue
            idx = to_device(new, node.value.device)
            self.token_to_kv_pool_allocator.free(node.value[idx])
            write_sentinels(node.value, idx)
            set_holes(node, torch.cat([holes_of(node), new]).sort().values)
            self.evictable_size_ -= int(new.numel())
            freed_abs.append(new + s)
        # Records (of this conversation's earlier turns) that kept a position freed here are void:
        # drop them rather than test them at every match.
        if freed_abs:
            void_records(path, torch.cat(freed_abs))

    def evict_side_branches(self, path: list[TreeNode], first: int) -> int:
        """Evict the cached subtrees hanging off ``path``'s nodes that end after position ``first``, except below
        its last node (those continue the sequence). A subtree a running request holds is left whole (its lock
        reaches every node above it; on the route such a prune is ``blocked`` before this runs, at a request's
        finish other requests may hold side branches). Returns the slots freed."""
        on_path = {id(node) for node in path}
        freed, end = 0, 0
        for node in path[:-1]:
            end += len(node.key)
            if end <= first:
                continue
            for child in [c for c in node.children.values() if id(c) not in on_path]:
                freed += self._evict_subtree(child)
        return freed

    def _evict_subtree(self, top: TreeNode) -> int:
        order = [top, *descendants(top)]  # pre-order: every node before its descendants
        if any(node.lock_ref > 0 for node in order):
            return 0  # a running request reads it (a request finishing beside it): never free that
        # Leaves first, as the pool's LRU evicts.
        return sum(self.drop_leaf(node) for node in reversed(order))

    def view_of(self, token_ids: list[int], extra_key: str | None) -> PathView:
        """The visible match of ``token_ids`` in ``extra_key``'s namespace (what a request of that sequence
        would get), without locking anything."""
        probe = SimpleNamespace()
        # SGLang's tree keys are array('q') (its match asserts both sides have one type).
        res = self.match_prefix(MatchPrefixParams(key=RadixKey(array("q", token_ids), extra_key), req=probe))
        view: MatchView | None = getattr(probe, VIEW_ATTR, None)
        length = int(len(res.device_indices))
        kept = view.kept if view is not None and view.length == length else torch.arange(length)
        nodes = self.path_to(res.last_device_node)
        return PathView(length, kept, res.device_indices, nodes, path_starts(nodes),
                        view.record if view is not None else None)

    def cache_unfinished_req(self, req: Any, chunked: bool = False) -> None:
        if not self.disable and not self._chain_cached(req, req.get_fill_ids()):
            return super().cache_unfinished_req(req, chunked)
        # Evicting methods defer insertion to finish: the prompt stays request-owned, so the method
        # may free it. With the tree disabled (--disable-radix-cache) nothing is inserted either. In
        # both cases the next chunk continues after what is filled so far, as SGLang's ChunkCache
        # does (the stock RadixCache returns early when disabled, so a chunked prompt would restart).
        fill_len = len(req.get_fill_ids())
        req.prefix_indices = self.req_to_token_pool.req_to_token[req.req_pool_idx, :fill_len].to(
            dtype=torch.int64, copy=True)

    def stats(self) -> dict[str, Any]:
        """Tree-side numbers for ``/server_info`` (physical slots)."""
        return {
            "tree_evictable_slots": int(self.evictable_size()),
            "tree_protected_slots": int(self.protected_size()),
            # Tokens of the chat template's generation prompt a next turn may render differently.
            "chain_resume_suffix_tokens": len(self.resume_suffix),
        }


def _with_key(params: Any, key: RadixKey) -> Any:
    """A copy of a params dataclass with another key (never mutate the caller's params, keep every
    field a newer SGLang may add)."""
    return replace(params, key=key)
