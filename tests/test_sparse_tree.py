"""SparseRadixCache against SGLang's real pools, allocator and radix tree (no server).

The request object is a minimal stand-in carrying the fields the tree reads; the tree, the
``ReqToTokenPool`` and the ``TokenToKVPoolAllocator`` are SGLang 0.5.17's own classes.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from sgl_sparse import create_method
from sgl_sparse.radix.tree import SparseRadixCache
from sgl_sparse.slots import SENTINEL_SLOT

POOL = 64


@dataclass
class FakeReq:
    rid: str
    origin_input_ids: list[int] | array
    output_ids: list[int] | array = field(default_factory=list)
    req_pool_idx: int = 0
    cache_protected_len: int = 0
    extra_key: str | None = None
    last_node: Any = None
    priority: int = 0
    prefix_indices: torch.Tensor | None = None
    fill_len: int = 0

    def __post_init__(self) -> None:  # SGLang keeps token ids in array("q")
        self.origin_input_ids = array("q", self.origin_input_ids)
        self.output_ids = array("q", self.output_ids)

    def get_fill_ids(self) -> array:
        return (self.origin_input_ids + self.output_ids)[: self.fill_len]


def _make(tree_cls: type = SparseRadixCache, method: str = "streamingllm",
          disable: bool = False, window_for: Any = None) -> tuple[Any, ReqToTokenPool, Any]:
    req_pool = ReqToTokenPool(size=4, max_context_len=128, device="cpu", enable_memory_saver=False)
    alloc = TokenToKVPoolAllocator(POOL, torch.float32, "cpu", None, need_sort=False)
    params = CacheInitParams(disable=disable, req_to_token_pool=req_pool, token_to_kv_pool_allocator=alloc, page_size=1)
    if tree_cls is RadixCache:
        return RadixCache(params), req_pool, alloc
    m = create_method(method)
    return SparseRadixCache(params, m, m.config.fingerprint(), window_for=window_for), req_pool, alloc


def _invariant(tree: Any, alloc: Any) -> int:
    """SGLang's idle leak check: available + evictable + protected - total (0 when sound)."""
    return alloc.available_size() + tree.evictable_size() + tree.protected_size() - POOL


def _admit(tree: Any, req_pool: ReqToTokenPool, alloc: Any, req: FakeReq, row: int) -> None:
    """What SGLang does at admission: match, lock, allocate the rest, write the row."""
    m = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", req.origin_input_ids), req.extra_key), req=req))
    req.prefix_indices, req.last_node = m.device_indices, m.last_device_node
    req.cache_protected_len = len(req.prefix_indices)
    tree.inc_lock_ref(req.last_node)
    req.req_pool_idx = row
    n = len(req.origin_input_ids) + len(req.output_ids)
    new = alloc.alloc(n - len(req.prefix_indices))
    req_pool.req_to_token[row, : len(req.prefix_indices)] = req.prefix_indices.to(torch.int32)
    req_pool.req_to_token[row, len(req.prefix_indices): n] = new.to(torch.int32)


def _evict_positions(req_pool: ReqToTokenPool, alloc: Any, req: FakeReq, positions: list[int]) -> None:
    """What our eviction step does: free request-owned slots, sentinel every dropped position."""
    row = req_pool.req_to_token[req.req_pool_idx]
    owned = [p for p in positions if p >= req.cache_protected_len]
    alloc.free(row[owned].long())
    row[positions] = SENTINEL_SLOT


def test_stock_tree_breaks_on_sentinels_negative_control() -> None:
    tree, req_pool, alloc = _make(RadixCache)
    req = FakeReq("a", list(range(10, 30)))
    _admit(tree, req_pool, alloc, req, 1)
    _evict_positions(req_pool, alloc, req, [3, 4, 5, 6])
    tree.cache_finished_req(req, kv_len_to_handle=20)
    assert _invariant(tree, alloc) != 0  # counts 4 phantom slots


def _match(tree: Any, tokens: list[int]) -> Any:
    return tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))


def _holes_in(indices: torch.Tensor) -> list[int]:
    return (indices == SENTINEL_SLOT).nonzero().flatten().tolist()


def test_finish_match_split_lock_evict_keep_invariant_and_never_free_slot0() -> None:
    tree, req_pool, alloc = _make()
    a = FakeReq("a", list(range(100, 120)), output_ids=[7, 8, 9])
    _admit(tree, req_pool, alloc, a, 1)
    _evict_positions(req_pool, alloc, a, [2, 3, 4, 5, 10, 11])
    assert _invariant(tree, alloc) < 0  # request-owned slots are neither free nor in the tree yet
    tree.cache_finished_req(a, kv_len_to_handle=23)
    assert _invariant(tree, alloc) == 0
    assert tree.evictable_size() == 23 - 6 and tree.total_size() == 17

    # A continuation (it matches through the end of a's sequence) resumes from a's kept set.
    b = FakeReq("b", list(range(100, 120)) + [7, 8, 9, 50, 51])
    _admit(tree, req_pool, alloc, b, 2)
    assert len(b.prefix_indices) == 23 and _holes_in(b.prefix_indices) == [2, 3, 4, 5, 10, 11]
    assert tree.protected_size() == 17 and tree.evictable_size() == 0
    assert _invariant(tree, alloc) + 2 == 0  # the 2 new slots are request-owned

    # Another conversation on the same first tokens is no continuation: it never sees a hole, its
    # match stops before the first one (and it recomputes the rest itself).
    c = FakeReq("c", list(range(100, 110)) + [1, 2, 3])
    _admit(tree, req_pool, alloc, c, 3)
    assert len(c.prefix_indices) == 2 and _holes_in(c.prefix_indices) == []
    tree.cache_finished_req(c, kv_len_to_handle=13)
    tree.cache_finished_req(b, kv_len_to_handle=25)
    assert _invariant(tree, alloc) == 0
    assert SENTINEL_SLOT not in alloc.free_pages.tolist()

    tree.evict(EvictParams(num_tokens=POOL))
    assert tree.evictable_size() == 0 and tree.protected_size() == 0
    assert alloc.available_size() == POOL
    assert sorted(alloc.free_pages.tolist()) == list(range(1, POOL + 1))


def test_shared_prefix_keeps_its_kv_for_other_conversations() -> None:
    """Copy-on-write: a conversation's eviction never changes what another one attends to."""
    tree, req_pool, alloc = _make()
    system = list(range(500, 516))
    a = FakeReq("a", system + [1, 2, 3, 4])
    b = FakeReq("b", system + [9, 8, 7])
    _admit(tree, req_pool, alloc, a, 1)
    tree.cache_finished_req(a, kv_len_to_handle=20)  # a dense first turn: the shared prefix is in the tree
    shared = _match(tree, system).device_indices.tolist()
    a2 = FakeReq("a2", system + [1, 2, 3, 4, 5, 6])
    _admit(tree, req_pool, alloc, a2, 2)
    _admit(tree, req_pool, alloc, b, 3)
    # a2 evicts inside the system prompt and in its own part; b holds the same prompt.
    _evict_positions(req_pool, alloc, a2, [2, 3, 4, 17, 21])
    tree.cache_finished_req(a2, kv_len_to_handle=22)
    tree.cache_finished_req(b, kv_len_to_handle=19)
    # The system prompt node has two branches now: it keeps all its KV for everyone.
    assert _match(tree, system).device_indices.tolist() == shared
    assert _match(tree, system + [9, 8, 7]).device_indices[:16].tolist() == shared
    # a2's continuation still resumes from exactly a2's kept set (hidden where the tree keeps KV).
    m = _match(tree, system + [1, 2, 3, 4, 5, 6, 77])
    assert len(m.device_indices) == 22 and _holes_in(m.device_indices) == [2, 3, 4, 17, 21]
    assert _invariant(tree, alloc) == 0


def test_a_turn_that_hid_only_shared_positions_resumes_from_its_record_beside_other_traffic() -> None:
    """A conversation whose method hid only positions of a prefix another conversation shares frees none of them
    (copy-on-write), so its path has no hole at all. Its next turn, leaving the previous answer inside it (the
    re-rendered reply), must still resume from its record, as it does when it is alone on the server (there the
    positions were freed, and the first hole sends the match to the record). It used to get the dense prefix
    instead: the same turn read 3 more positions because another conversation shared its system prompt."""
    from sgl_sparse.radix.records import FinishedState

    system, own, answer = list(range(500, 516)), [1, 2, 3, 4], [7, 8, 9, 10]
    kept = torch.tensor([p for p in range(24) if p not in (2, 3, 4)])
    for beside in (False, True):
        tree, req_pool, alloc = _make()
        tree._on_finish = lambda req: FinishedState(kept=kept, tail_start=20) if req.rid == "a" else None
        if beside:  # another conversation holds the system prompt
            _admit(tree, req_pool, alloc, b := FakeReq("b", system + [9, 8, 7]), 3)
            tree.cache_finished_req(b, kv_len_to_handle=19)
        a = FakeReq("a", system + own, output_ids=answer)
        _admit(tree, req_pool, alloc, a, 1)
        _evict_positions(req_pool, alloc, a, [2, 3, 4])
        tree.cache_finished_req(a, kv_len_to_handle=24)
        nxt = _match(tree, system + own + answer[:2] + [77, 78])  # leaves a's answer at 22
        assert len(nxt.device_indices) == 22 and _holes_in(nxt.device_indices) == [2, 3, 4], (beside, nxt)
        assert _invariant(tree, alloc) == 0


def test_first_finisher_of_a_new_prefix_does_not_decide_for_the_next_conversation() -> None:
    """a finishes alone, so its nodes are exclusive and compacted in place; b, another conversation
    on the same system prompt, matches only up to the first hole and recomputes; its KV then fills
    the holes it kept, so later conversations match further, and a's continuation is unchanged."""
    tree, req_pool, alloc = _make()
    system = list(range(600, 620))
    a = FakeReq("a", system + [1, 2, 3])
    _admit(tree, req_pool, alloc, a, 1)
    _evict_positions(req_pool, alloc, a, [5, 6, 7, 8, 21])
    tree.cache_finished_req(a, kv_len_to_handle=23)
    assert tree.total_size() == 18  # a's hidden positions were freed: its nodes were its own

    b = FakeReq("b", system + [4, 4])
    _admit(tree, req_pool, alloc, b, 2)
    assert len(b.prefix_indices) == 5 and _holes_in(b.prefix_indices) == []
    _evict_positions(req_pool, alloc, b, [7])  # b's own choice, inside the recomputed part
    tree.cache_finished_req(b, kv_len_to_handle=22)
    # b filled holes 5, 6, 8 (it kept them); 7 is still a hole, so a third conversation stops there.
    assert len(_match(tree, system + [5]).device_indices) == 7
    m = _match(tree, system + [1, 2, 3, 9])  # a's continuation: exactly a's kept set
    assert len(m.device_indices) == 23 and _holes_in(m.device_indices) == [5, 6, 7, 8, 21]
    assert _invariant(tree, alloc) == 0


def test_chain_of_turns_compacts_the_conversation_in_place() -> None:
    tree, req_pool, alloc = _make()
    t1 = FakeReq("t1", list(range(700, 716)))
    _admit(tree, req_pool, alloc, t1, 1)
    tree.cache_finished_req(t1, kv_len_to_handle=16)
    assert tree.total_size() == 16

    t2 = FakeReq("t2", list(range(700, 716)) + [1, 2, 3, 4])
    _admit(tree, req_pool, alloc, t2, 2)
    # t2's method drops positions 4..9 of turn 1 (tree-owned: hidden) and its own 17 (freed).
    _evict_positions(req_pool, alloc, t2, [4, 5, 6, 7, 8, 9, 17])
    assert tree.total_size() == 16  # still locked by t2: untouched
    tree.cache_finished_req(t2, kv_len_to_handle=20)
    # The path is this conversation's only: compacted in place, 20 logical, 13 physical.
    m = _match(tree, list(range(700, 716)) + [1, 2, 3, 4])
    assert len(m.device_indices) == 20 and _holes_in(m.device_indices) == [4, 5, 6, 7, 8, 9, 17]
    assert tree.total_size() == 13 and _invariant(tree, alloc) == 0
    # A retry of turn 2 (a branch after turn 1) is no continuation of t2 and t1's record is gone
    # with the positions t2 freed: it gets the dense prefix before the first hole.
    assert len(_match(tree, list(range(700, 716)) + [8]).device_indices) == 4


def test_locked_path_is_not_compacted() -> None:
    tree, req_pool, alloc = _make()
    a = FakeReq("a", list(range(300, 310)))
    _admit(tree, req_pool, alloc, a, 1)
    tree.cache_finished_req(a, kv_len_to_handle=10)
    b = FakeReq("b", list(range(300, 310)) + [5])
    c = FakeReq("c", list(range(300, 310)) + [6])
    _admit(tree, req_pool, alloc, b, 2)
    _admit(tree, req_pool, alloc, c, 3)
    _evict_positions(req_pool, alloc, b, [1, 2])
    tree.cache_finished_req(b, kv_len_to_handle=11)  # c still holds the shared prefix
    assert tree.total_size() == 10 + 1  # shared prefix intact (c holds it) + b's own token
    assert _holes_in(_match(tree, list(range(300, 310))).device_indices) == []
    assert _holes_in(_match(tree, list(range(300, 310)) + [5, 0]).device_indices) == [1, 2]
    tree.cache_finished_req(c, kv_len_to_handle=11)
    assert _invariant(tree, alloc) == 0


def test_keys_are_namespaced_by_fingerprint_and_extra_key() -> None:
    """The namespace is what keeps compacted KV of one config from another's requests once several
    configs share a tree (per-request methods); here: the key the stock tree stores is namespaced."""
    tree, _, _ = _make()
    key = tree._ns(RadixKey(array("q", [1, 2]), "salt"))
    assert key.extra_key == f"{tree.fingerprint}:salt"
    assert tree._ns(RadixKey(array("q", [1, 2]))).extra_key == tree.fingerprint


@pytest.mark.parametrize("disable", [False, True])
@pytest.mark.parametrize("method", ["dense", "streamingllm"])
def test_unfinished_chunks(method: str, disable: bool) -> None:
    """The next chunk continues after the filled part (with --disable-radix-cache too: the stock tree
    returns early there, so a prompt longer than a chunk would restart at chunk 1 forever)."""
    tree, req_pool, alloc = _make(method=method, disable=disable)
    a = FakeReq("a", list(range(400, 420)), fill_len=8)
    _admit(tree, req_pool, alloc, a, 1)
    tree.cache_unfinished_req(a)
    assert len(a.prefix_indices) == 8
    # Evicting methods keep the prompt request-owned until finish; dense inserts each chunk.
    assert tree.total_size() == (8 if method == "dense" and not disable else 0)
    tree.cache_finished_req(a, kv_len_to_handle=20)
    assert tree.total_size() == (0 if disable else 20) and _invariant(tree, alloc) == 0


def test_turn_after_an_abandoned_branch_recomputes_and_leaves_a_valid_record() -> None:
    """A branch (e.g. an aborted turn) compacts the conversation's nodes in place and voids the record
    it continued; the next turn recomputes past the first hole, its slots fill the tree's holes, and
    the turn after it resumes from its record over the whole sequence."""
    tree, req_pool, alloc = _make()
    t0 = FakeReq("t0", list(range(800, 820)))
    _admit(tree, req_pool, alloc, t0, 1)
    _evict_positions(req_pool, alloc, t0, [10, 11])
    tree.cache_finished_req(t0, kv_len_to_handle=20)
    aborted = FakeReq("x", list(range(800, 820)) + [1, 2])
    _admit(tree, req_pool, alloc, aborted, 2)
    _evict_positions(req_pool, alloc, aborted, [3, 4, 5])
    tree.cache_finished_req(aborted, kv_len_to_handle=22)
    assert len(_match(tree, list(range(800, 820)) + [7]).device_indices) == 3  # t0's record is void

    t1 = FakeReq("t1", list(range(800, 820)) + [7, 7, 7])
    _admit(tree, req_pool, alloc, t1, 3)
    assert len(t1.prefix_indices) == 3
    _evict_positions(req_pool, alloc, t1, [12, 21])
    tree.cache_finished_req(t1, kv_len_to_handle=23)
    m = _match(tree, list(range(800, 820)) + [7, 7, 7, 9])
    assert len(m.device_indices) == 23 and _holes_in(m.device_indices) == [12, 21]
    assert _invariant(tree, alloc) == 0


def test_next_turn_that_leaves_the_previous_answer_resumes_from_its_record() -> None:
    """An agent's next turn whose history differs inside the previous answer (re-tokenized text) is
    still that conversation's continuation once its match covers the finished request's prompt and
    last eviction: it sees the kept set cut at its match. A request that leaves earlier (another
    conversation sharing part of the prompt, or one inside the span the last eviction decided) still
    stops at the first hole."""
    from sgl_sparse.radix.records import FinishedState

    tree, req_pool, alloc = _make()
    prompt, answer = list(range(900, 920)), [1, 2, 3, 4, 5, 6]
    hidden = [3, 4, 5, 9, 10]
    kept = torch.tensor([p for p in range(26) if p not in hidden])
    tails = {"a": 20, "s": 23}  # a: evicted at the end of its prompt (SnapKV); s: at decode length 23
    tree._on_finish = lambda req: FinishedState(kept=kept, tail_start=tails[req.rid]) if req.rid in tails else None
    a = FakeReq("a", prompt, output_ids=answer)
    _admit(tree, req_pool, alloc, a, 1)
    _evict_positions(req_pool, alloc, a, hidden)
    tree.cache_finished_req(a, kv_len_to_handle=26)
    assert _invariant(tree, alloc) == 0

    b = FakeReq("b", prompt + answer[:2] + [77, 78])  # leaves a's answer at 22
    _admit(tree, req_pool, alloc, b, 2)
    assert len(b.prefix_indices) == 22 and _holes_in(b.prefix_indices) == hidden
    assert b._sgl_sparse_view.kept.tolist() == [p for p in range(22) if p not in hidden]
    assert b._sgl_sparse_view.payload is None  # the payload describes a at 26 tokens
    for other in (prompt[:15] + [5, 5], prompt[:19] + [6]):  # leaves before a's prompt ends
        assert len(_match(tree, other).device_indices) == 3  # the first hole
    tree.cache_finished_req(b, kv_len_to_handle=24)
    assert _invariant(tree, alloc) == 0
    # a's record is untouched by b's branch, and a's own continuation still resumes at its end.
    m = _match(tree, prompt + answer + [9])
    assert len(m.device_indices) == 26 and _holes_in(m.device_indices) == hidden

    tree2, req_pool2, alloc2 = _make()
    tree2._on_finish = lambda req: FinishedState(kept=kept, tail_start=tails[req.rid])
    s = FakeReq("s", prompt, output_ids=answer)
    _admit(tree2, req_pool2, alloc2, s, 1)
    _evict_positions(req_pool2, alloc2, s, hidden)
    tree2.cache_finished_req(s, kv_len_to_handle=26)
    assert len(_match(tree2, prompt + answer[:2] + [7]).device_indices) == 3  # 22 < s's last eviction
    m = _match(tree2, prompt + answer[:4] + [7])
    assert len(m.device_indices) == 24 and _holes_in(m.device_indices) == hidden


def test_next_turn_rendering_the_generation_prompt_differently_resumes_before_it() -> None:
    """A chat template whose generation prompt differs from how it renders the assistant turn in the
    history (``assistant:`` then ``<s>assistant: text``) makes the next turn leave the previous
    prompt just before its end: with the tree's ``resume_suffix`` set to that prompt's tokens, the
    record's ``since`` backs off over them. A request that leaves one token earlier (another question
    on the same document) still stops at the first hole, and so does every request when the prompt
    does not end with the suffix or the last eviction came after the prompt."""
    from sgl_sparse.radix.records import FinishedState

    suffix = (61, 62)
    prompt, answer = list(range(900, 918)) + list(suffix), [1, 2, 3, 4, 5, 6]
    hidden = [3, 4, 5, 9, 10]
    kept = torch.tensor([p for p in range(26) if p not in hidden])

    def finished(tail: int, prompt_ids: list[int]) -> tuple[Any, ReqToTokenPool, Any]:
        tree, req_pool, alloc = _make()
        tree.resume_suffix = suffix
        tree._on_finish = lambda req: FinishedState(kept=kept, tail_start=tail) if req.rid == "a" else None
        a = FakeReq("a", prompt_ids, output_ids=answer)
        _admit(tree, req_pool, alloc, a, 1)
        _evict_positions(req_pool, alloc, a, hidden)
        tree.cache_finished_req(a, kv_len_to_handle=26)
        assert _invariant(tree, alloc) == 0
        return tree, req_pool, alloc

    tree, req_pool, alloc = finished(20, prompt)
    assert tree.stats()["chain_resume_suffix_tokens"] == 2
    nxt = FakeReq("b", prompt[:18] + [63, 61, 62, 1, 2, 77, 61, 62])  # "<s>" + the suffix + the answer
    _admit(tree, req_pool, alloc, nxt, 2)
    assert len(nxt.prefix_indices) == 18 and _holes_in(nxt.prefix_indices) == hidden
    assert nxt._sgl_sparse_view.kept.tolist() == [p for p in range(18) if p not in hidden]
    tree.cache_finished_req(nxt, kv_len_to_handle=len(nxt.origin_input_ids))
    assert _invariant(tree, alloc) == 0
    assert len(_match(tree, prompt[:17] + [5, 61, 62]).device_indices) == 3  # leaves before: the first hole

    for tail, ids in ((20, list(range(900, 920))), (23, prompt)):  # no suffix at the end; evicted in decode
        tree, _, _ = finished(tail, ids)
        assert len(_match(tree, ids[:18] + [63, 61, 62]).device_indices) == 3


def test_the_same_chat_prompt_from_another_request_does_not_resume_from_the_first_ones_record() -> None:
    """With ``since`` backed off over the generation prompt, a second request with exactly the first one's chat prompt
    (another user asking the same first question) matches up to one token short of it, past ``since``: it must not
    resume from the first request's kept set (its SnapKV window would then be one token, its answer set by the
    first request's traffic), only a request whose prompt runs past the first one's does. A probe (prune, match)
    still resumes."""
    from sgl_sparse.radix.records import FinishedState

    suffix = (61,)
    prompt, answer = list(range(900, 919)) + list(suffix), [1, 2, 3, 4]
    hidden = [3, 4, 5, 21]
    kept = torch.tensor([p for p in range(24) if p not in hidden])
    tree, req_pool, alloc = _make()
    tree.resume_suffix = suffix
    tree._on_finish = lambda req: FinishedState(kept=kept, tail_start=20) if req.rid == "a" else None
    a = FakeReq("a", prompt, output_ids=answer)
    _admit(tree, req_pool, alloc, a, 1)
    _evict_positions(req_pool, alloc, a, hidden)
    tree.cache_finished_req(a, kv_len_to_handle=24)
    same = FakeReq("b", prompt)
    _admit(tree, req_pool, alloc, same, 2)
    assert len(same.prefix_indices) == 3 and same._sgl_sparse_view.record is None  # the first hole
    tree.cache_finished_req(same, kv_len_to_handle=20)
    m = _match(tree, prompt[:19])  # a probe of the messages: the record's view
    assert len(m.device_indices) == 19 and _holes_in(m.device_indices) == [3, 4, 5]
    nxt = FakeReq("c", prompt + [1, 2, 70])  # a's next turn
    _admit(tree, req_pool, alloc, nxt, 3)
    assert len(nxt.prefix_indices) == 22 and _holes_in(nxt.prefix_indices) == [3, 4, 5, 21]
    tree.cache_finished_req(nxt, kv_len_to_handle=23)
    assert _invariant(tree, alloc) == 0


def test_generation_suffix_of_chat_templates(tiny_model: str) -> None:
    """The tokens at a generation prompt's end that a later request of the conversation may not share, found by
    rendering: the generation prompt itself for the tiny model's own template (its next turn renders the
    assistant turn as it prompts for it, but a prune or match of the turn's messages renders them without
    it), and for one that prefixes history turns with ``<s>``."""
    from transformers import AutoTokenizer

    from sgl_sparse.integration.chat_resume import generation_suffix

    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert tok.convert_ids_to_tokens(list(generation_suffix(tok))) == ["<|assistant|>"]
    suffix = generation_suffix(tok, PREFIXED_TEMPLATE)
    first = tok.apply_chat_template([{"role": "user", "content": "Hi."}], add_generation_prompt=True, tokenize=True,
                                    chat_template=PREFIXED_TEMPLATE)
    first = first["input_ids"] if hasattr(first, "keys") else first
    assert suffix and tuple(first[-len(suffix):]) == suffix
    assert tok.decode(list(suffix)).strip() == "assistant:"
    assert generation_suffix(None) == ()


# A template like the benchmark model's (.device-site/models/llama3-8b-shape): history turns start
# with "<s>role: ", the generation prompt is a bare "assistant:".
PREFIXED_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def test_a_dense_hit_leaves_the_observed_window_to_be_computed_but_a_record_resumes_whole() -> None:
    """window_for(req) = 4: a dense hit stops 4 positions before the request's end, so the method observes the
    queries it would observe alone (a hit over them gave PyramidKV the same prompt's answer differently); a
    Chain Cache continuation still resumes from its record's end (its window is its new tokens)."""
    tree, req_pool, alloc = _make(method="snapkv", window_for=lambda req: 4)
    prompt = list(range(600, 620))
    a = FakeReq("a", prompt, output_ids=[1, 2])
    _admit(tree, req_pool, alloc, a, 1)
    tree.cache_finished_req(a, kv_len_to_handle=22)  # dense: nothing evicted
    same = FakeReq("same", prompt)  # the same prompt again: SGLang would reuse 19 positions
    _admit(tree, req_pool, alloc, same, 2)
    assert len(same.prefix_indices) == 20 - 4 and _holes_in(same.prefix_indices) == []
    tree.cache_finished_req(same, kv_len_to_handle=20)
    # A continuation of a compacted sequence resumes from the record, even with fewer new tokens than the window.
    t1 = FakeReq("t1", list(range(700, 716)))
    _admit(tree, req_pool, alloc, t1, 1)
    _evict_positions(req_pool, alloc, t1, [3, 4, 5])
    tree.cache_finished_req(t1, kv_len_to_handle=16)
    t2 = FakeReq("t2", list(range(700, 716)) + [9, 9])
    _admit(tree, req_pool, alloc, t2, 3)
    assert len(t2.prefix_indices) == 16 and _holes_in(t2.prefix_indices) == [3, 4, 5]
    tree.cache_finished_req(t2, kv_len_to_handle=18)
    assert _invariant(tree, alloc) == 0


def test_each_node_carries_one_typed_record_and_nothing_else() -> None:
    """The tree adds exactly one attribute to SGLang's TreeNode (``sgl_sparse``: a NodeRecord) through finishes,
    splits and matches, and its physical count is always the key less its holes."""
    from sglang.srt.mem_cache.radix_cache import TreeNode

    from sgl_sparse.radix.records import NODE_ATTR, NodeRecord

    tree, req_pool, alloc = _make()
    a = FakeReq("a", list(range(100, 120)), output_ids=[7, 8, 9])
    _admit(tree, req_pool, alloc, a, 1)
    _evict_positions(req_pool, alloc, a, [2, 3, 4, 5, 10, 11])
    tree.cache_finished_req(a, kv_len_to_handle=23)
    c = FakeReq("c", list(range(100, 110)) + [1, 2, 3])  # splits a's node
    _admit(tree, req_pool, alloc, c, 3)
    tree.cache_finished_req(c, kv_len_to_handle=13)
    stock = set(vars(TreeNode()))
    stack, seen = [tree.root_node], 0
    while stack:
        node = stack.pop()
        seen += 1
        assert set(vars(node)) - stock == {NODE_ATTR}
        rec = getattr(node, NODE_ATTR)
        assert isinstance(rec, NodeRecord) and rec.phys == len(node.key) - rec.holes.numel()
        stack.extend(node.children.values())
    assert seen >= 4 and _invariant(tree, alloc) == 0
