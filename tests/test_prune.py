"""Prefix-Cache Pruning without a server: the tree operation (sgl_sparse/prune/tree_ops.py) on SGLang's real radix tree,
allocator and req-to-token pool, checked against the kept set computed by hand (what a continuation sees, what is
freed, what a conversation sharing the prefix keeps), and the request parsing (sgl_sparse/prune/body.py):
selectors, ranges, chat messages to content spans with the tiny model's real chat template, and the error naming
each bad field."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from sgl_sparse.prune import tree_ops
from sgl_sparse.prune.body import BadPruneRequest, merge, message_spans, parse_body, sequence_ranges
from sgl_sparse.registry import create_method
from sgl_sparse.request_methods import EVICTION, MethodResolver
from tests.test_sparse_tree import FakeReq, _admit, _evict_positions, _holes_in, _invariant, _make, _match

RESOLVER = MethodResolver(create_method("dense"), EVICTION)


@pytest.fixture(scope="module")
def tok(tiny_model: str) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model)


def _render(tok: Any) -> Any:
    def render(messages: list[Any]) -> list[int]:
        ids = tok.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=False)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return render


def _parse(tok: Any, body: dict[str, Any], need_ranges: bool = True) -> dict[str, Any]:
    return parse_body(body, tok.encode, _render(tok), 2048, RESOLVER.resolve, need_ranges)


def test_ranges_are_checked_sorted_and_merged() -> None:
    assert sequence_ranges([[30, 40], [0, 10], [5, 12], [40, 41]], 50) == [(0, 12), (30, 41)]
    for bad, where in (([[0, 51]], "ranges[0]"), ([[5, 5]], "ranges[0]"), ([[-1, 3]], "ranges[0]"),
                       ([[0, 2], [1]], "ranges[1]"), ([[0, "3"]], "ranges[0]"), ([], "ranges"), ("0-3", "ranges"),
                       ([[True, 3]], "ranges[0]")):
        with pytest.raises(BadPruneRequest) as e:
            sequence_ranges(bad, 50)
        assert e.value.field == where, (bad, e.value)


def test_message_spans_cover_each_content_without_the_templates_markers(tok: Any) -> None:
    messages = [{"role": "system", "content": "you are terse"}, {"role": "user", "content": "list the files"},
                {"role": "assistant", "content": "calling ls"}, {"role": "tool", "content": "a.py b.py c.py"},
                {"role": "assistant", "content": "three files"}]
    render = _render(tok)
    ids = render(messages)
    spans = message_spans(render, messages)
    assert len(spans) == len(messages)
    for (lo, hi), m in zip(spans, messages):
        assert tok.decode(ids[lo:hi]).strip() == m["content"].strip(), (lo, hi, tok.decode(ids[lo:hi]))
    # Markers stay outside: the token before each span is the role marker, the one after it <|end|>.
    end_id = tok.convert_tokens_to_ids("<|end|>")
    assert all(ids[hi] == end_id for _, hi in spans)


def test_roles_and_lag_select_the_older_tool_results(tok: Any) -> None:
    messages = [{"role": "user", "content": "go"}]
    for i in range(4):
        messages += [{"role": "assistant", "content": f"call {i}"}, {"role": "tool", "content": f"result number {i}"}]
    out = _parse(tok, {"messages": messages, "roles": ["tool"], "lag": 2})
    ids = out["token_ids"]
    texts = [tok.decode(ids[lo:hi]).strip() for lo, hi in out["ranges"]]
    assert texts == ["result number 0", "result number 1"]
    assert _parse(tok, {"messages": messages, "roles": ["tool"], "lag": 4})["ranges"] == []


@pytest.mark.parametrize(("body", "field"), [
    ({}, "token_ids"),
    ({"token_ids": [1, 2], "text": "x", "ranges": [[0, 1]]}, "token_ids"),
    ({"token_ids": [1, 2, 3]}, "ranges"),
    ({"token_ids": [1, 2, 3], "ranges": [[0, 4]]}, "ranges[0]"),
    ({"token_ids": [1, 2048], "ranges": [[0, 1]]}, "token_ids[1]"),
    ({"token_ids": [1, -2], "ranges": [[0, 1]]}, "token_ids[1]"),
    ({"token_ids": "1 2", "ranges": [[0, 1]]}, "token_ids"),
    ({"token_ids": [1, 2], "ranges": [[0, 1]], "keep_tokens": 5}, "keep_tokens"),
    ({"token_ids": [1, 2], "ranges": [[0, 1]], "keep_tokens": -1}, "keep_tokens"),
    ({"token_ids": [1, 2], "ranges": [[0, 1]], "policy": "h2o"}, "policy"),
    ({"token_ids": [1, 2], "ranges": [[0, 1]], "rangez": []}, "rangez"),
    ({"token_ids": [1, 2], "ranges": [[0, 1]], "evict_branches": "yes"}, "evict_branches"),
    ({"token_ids": [1, 2], "roles": ["tool"]}, "roles"),
    ({"messages": [{"role": "tool", "content": "x"}], "roles": "tool"}, "roles"),
    ({"messages": [{"role": "tool", "content": "x"}], "roles": ["tool"], "lag": -1}, "lag"),
    ({"messages": [{"role": "tool", "content": "x"}], "roles": ["tool"], "ranges": [[0, 1]]}, "roles"),
    ({"messages": [{"content": "x"}], "ranges": [[0, 1]]}, "messages"),
    ({"text": "", "ranges": [[0, 1]]}, "text"),
    ({"token_ids": [1, 2], "ranges": [[0, 1]], "sgl_sparse_method": "quest"}, "sgl_sparse_method"),
    ({"token_ids": [1, 2], "ranges": [[0, 1]], "sgl_sparse_method": "snapkv", "sgl_sparse_config": "{"},
     "sgl_sparse_config"),
    ([1, 2], "body"),
])
def test_bad_bodies_name_the_field(tok: Any, body: Any, field: str) -> None:
    with pytest.raises(BadPruneRequest) as e:
        _parse(tok, body)
    assert e.value.field == field, str(e.value)


def test_selectors_and_namespace(tok: Any) -> None:
    by_text = _parse(tok, {"text": "hello there", "ranges": [[0, 1]]})
    assert by_text["token_ids"] == tok.encode("hello there")
    assert by_text["fingerprint"] == RESOLVER.default.fingerprint
    snap = _parse(tok, {"token_ids": [1, 2, 3], "ranges": [[1, 2]], "sgl_sparse_method": "snapkv",
                        "sgl_sparse_config": '{"budget": 64, "window_size": 8, "sink_tokens": 4}'})
    assert snap["fingerprint"] != RESOLVER.default.fingerprint and snap["ranges"] == [(1, 2)]
    assert "ranges" not in _parse(tok, {"token_ids": [1, 2, 3]}, need_ranges=False)


def test_merge_over_dp_ranks() -> None:
    done = {"status": "completed", "matched_tokens": 90, "freed_slots": 40}
    miss = {"status": "failed", "matched_tokens": 0, "message": "not cached"}
    assert merge([miss, done]) == {**done, "freed_slots": 40, "evicted_branch_slots": 0}
    assert merge([miss, {"status": "blocked", "matched_tokens": 90}])["status"] == "blocked"
    assert merge([miss, {**miss, "matched_tokens": 3}])["matched_tokens"] == 3


# -- the tree surgery -------------------------------------------------------------------------------

def _finished(tree: Any, req_pool: Any, alloc: Any, rid: str, prompt: list[int], out: list[int], row: int,
              evicted: tuple[int, ...] = ()) -> list[int]:
    """One request served and finished the way the server does it; returns its whole token sequence."""
    req = FakeReq(rid, prompt, output_ids=out)
    _admit(tree, req_pool, alloc, req, row)
    if evicted:
        _evict_positions(req_pool, alloc, req, list(evicted))
    n = len(prompt) + len(out)
    tree.cache_finished_req(req, kv_len_to_handle=n)
    return prompt + out


def test_prune_hides_the_ranges_frees_them_and_the_continuation_still_matches() -> None:
    tree, req_pool, alloc = _make()
    seq = _finished(tree, req_pool, alloc, "a", list(range(100, 130)), [7, 8], 1)
    free0 = alloc.available_size()
    r = tree_ops.prune(tree, seq, None, [(4, 10), (20, 22)])
    assert (r.status, r.matched_tokens, r.pruned_tokens, r.freed_slots, r.kept_tokens, r.resident_tokens) == (
        "completed", 32, 8, 8, 0, 24)
    assert alloc.available_size() == free0 + 8 and _invariant(tree, alloc) == 0
    # The next turn (the history plus new tokens) matches all 32 positions, the pruned ones as holes.
    nxt = _match(tree, seq + [1, 2])
    assert len(nxt.device_indices) == 32
    assert _holes_in(nxt.device_indices) == [*range(4, 10), 20, 21]
    # Pruning it again is a no-op that says so; a range past the cached end fails and changes nothing.
    assert tree_ops.prune(tree, seq, None, [(4, 10)]).status == "completed"
    assert tree_ops.prune(tree, seq, None, [(4, 10)]).pruned_tokens == 0
    bad = tree_ops.prune(tree, seq + [5, 6], None, [(30, 34)])
    assert bad.status == "failed" and alloc.available_size() == free0 + 8
    insp = tree_ops.inspect(tree, seq, None)
    assert (insp["matched_tokens"], insp["resident_tokens"], insp["hidden_tokens"]) == (32, 24, 8)


def test_a_prefix_another_conversation_shares_keeps_its_kv_and_that_conversation_sees_no_hole() -> None:
    tree, req_pool, alloc = _make()
    shared = list(range(100, 120))
    a = _finished(tree, req_pool, alloc, "a", shared + [1, 2, 3, 4], [9], 1)
    b = _finished(tree, req_pool, alloc, "b", shared + [5, 6, 7, 8], [9], 2)
    free0 = alloc.available_size()
    # Positions 2..6 lie in the shared node, 21..23 in a's own branch: only those 2 slots are freed.
    r = tree_ops.prune(tree, a, None, [(2, 6), (21, 23)])
    assert r.status == "completed" and r.pruned_tokens == 6 and r.freed_slots == 2
    assert alloc.available_size() == free0 + 2 and _invariant(tree, alloc) == 0
    assert _holes_in(_match(tree, a + [0]).device_indices) == [2, 3, 4, 5, 21, 22]
    mb = _match(tree, b + [0])
    assert len(mb.device_indices) == len(b) and _holes_in(mb.device_indices) == []


def test_evict_branches_frees_a_range_a_stale_reply_branch_shares() -> None:
    """The agent loop: turn 1's reply as generated ([9, 9]) is a branch beside the history the template
    re-renders ([8, 9] + a tool result), so turn 1's tool result (positions 20..24) lies on a shared node.
    Copy-on-write frees nothing; ``evict_branches`` evicts the idle stale branch first and frees the range."""
    for evict in (False, True):
        tree, req_pool, alloc = _make()
        p1 = list(range(100, 120)) + [1, 2, 3, 4]  # system + task, then turn 1's tool result at 20..24
        _finished(tree, req_pool, alloc, "t1", p1, [9, 9, 9], 1)
        seq = _finished(tree, req_pool, alloc, "t2", p1 + [8, 9, 5, 6], [7], 2)
        free0 = alloc.available_size()
        r = tree_ops.prune(tree, seq, None, [(20, 24)], evict_branches=evict)
        assert r.status == "completed" and r.pruned_tokens == 4
        if not evict:
            assert (r.freed_slots, r.evicted_branch_slots) == (0, 0)
            assert len(_match(tree, p1 + [9, 9, 9, 0]).device_indices) == 27  # the stale branch still whole
        else:
            assert (r.freed_slots, r.evicted_branch_slots) == (4, 3)
            assert alloc.available_size() == free0 + 7
            # The stale sequence now meets the hole at 20: its match stops there, it never sees one.
            assert len(_match(tree, p1 + [9, 9, 9, 0]).device_indices) == 20
        assert _invariant(tree, alloc) == 0
        assert _holes_in(_match(tree, seq + [0]).device_indices) == [20, 21, 22, 23]


def test_a_requests_own_prune_with_evict_branches_frees_what_a_stale_reply_branch_shared() -> None:
    """The same agent loop with the prune inside turn 2 (custom_params sgl_sparse_prune, its own prompt): the tool
    result it hides (20..24) lies on the node turn 1's reply as generated shares, so at its finish copy-on-write keeps
    that KV for the stale branch, hidden but resident, and the pool's LRU evicts only the branch's own leaf after it.
    With ``evict_branches`` (``FinishedState.evict_branches_after``, the first range's start) the finishing request
    evicts the idle branch first and the range's slots go back to the pool."""
    from sgl_sparse.radix.records import FinishedState

    for evict in (False, True):
        tree, req_pool, alloc = _make()
        p1 = list(range(100, 120)) + [1, 2, 3, 4]
        _finished(tree, req_pool, alloc, "t1", p1, [9, 9, 9], 1)
        t2 = FakeReq("t2", p1 + [8, 9, 5, 6], output_ids=[7])
        state = FinishedState(kept=torch.tensor([p for p in range(29) if not 20 <= p < 24]), tail_start=24,
                              evict_branches_after=20 if evict else None)
        tree._on_finish = lambda req, st=state: st if req.rid == "t2" else None
        _admit(tree, req_pool, alloc, t2, 2)
        assert t2.cache_protected_len == 24  # the tool result is the tree's (turn 1's prompt), not the request's
        _evict_positions(req_pool, alloc, t2, [20, 21, 22, 23])
        free0 = alloc.available_size()
        tree.cache_finished_req(t2, kv_len_to_handle=29)
        assert _invariant(tree, alloc) == 0
        assert _holes_in(_match(tree, p1 + [8, 9, 5, 6, 7, 0]).device_indices) == [20, 21, 22, 23]
        if evict:  # the stale branch's 3 slots and the range's 4
            assert alloc.available_size() == free0 + 7
            assert len(_match(tree, p1 + [9, 9, 9, 0]).device_indices) == 20  # the stale sequence meets the hole
        else:  # nothing freed: the stale branch still reads the range whole
            assert alloc.available_size() == free0
            assert len(_match(tree, p1 + [9, 9, 9, 0]).device_indices) == 27


def test_a_prune_voids_the_turns_own_record_below_it_even_where_it_frees_nothing() -> None:
    """The agent loop without ``evict_branches``: turn 1's stale reply branch shares turn 1's tool result (20..24), so
    a prune of turn 2's messages frees nothing there. Turn 2's own record (it evicted position 26, in its own tool
    result; its tail, the generation prompt and reply, hangs below the prune's record) still holds 20..24 resident,
    and a next turn whose re-rendered reply leaves turn 2's inside its tail used to resume from it and read the
    pruned range again (a review's repro: holes [26] only). The prune voids that record: the next turn resumes from
    the prune's own."""
    from sgl_sparse.radix.records import FinishedState

    tree, req_pool, alloc = _make()
    p1 = list(range(100, 120)) + [1, 2, 3, 4]
    _finished(tree, req_pool, alloc, "t1", p1, [9, 9, 9], 1)
    p2 = p1 + [8, 9, 5, 6]  # turn 2's prompt: turn 1's reply re-rendered, then its tool result
    state = FinishedState(kept=torch.tensor([p for p in range(31) if p != 26]), tail_start=len(p2))
    tree._on_finish = lambda req: state if req.rid == "t2" else None
    t2 = FakeReq("t2", p2, output_ids=[7, 7, 7])
    _admit(tree, req_pool, alloc, t2, 2)
    _evict_positions(req_pool, alloc, t2, [26])
    tree.cache_finished_req(t2, kv_len_to_handle=31)
    r = tree_ops.prune(tree, p2, None, [(20, 24)])
    assert r.status == "completed" and (r.pruned_tokens, r.freed_slots) == (4, 0)  # shared with t1's branch
    nxt = _match(tree, p2 + [7, 1, 2])  # leaves turn 2's reply at 29, inside its record's tail
    assert _holes_in(nxt.device_indices) == [20, 21, 22, 23, 26], _holes_in(nxt.device_indices)
    assert _invariant(tree, alloc) == 0


def test_a_request_pruning_a_cached_turn_compacts_below_it_as_the_route_does() -> None:
    """The route's snapkv_global / kvzip_global prune a cached turn through an internal request whose prompt is the
    turn's messages (28 tokens: the route refuses a sequence that already hides positions) and which prunes its own
    prompt; the turn's generation prompt and reply hang below that prompt's end. At the request's finish that
    continuation used to shield the range (the last node had a child: nothing compacted, 0 slots freed, a review's
    repro). With ``FinishedState.pruned`` the finish compacts as a route prune does, and the next turn resumes from
    the request's record with the range hidden."""
    from sgl_sparse.radix.records import FinishedState

    tree, req_pool, alloc = _make()
    p2 = list(range(100, 128))
    own = FinishedState(kept=torch.tensor([p for p in range(28) if not 20 <= p < 24]), tail_start=28, pruned=True)
    tree._on_finish = lambda req: own if req.rid == "own" else None
    _finished(tree, req_pool, alloc, "turn", p2, [7, 7, 7], 1)  # the turn, cached whole
    r = FakeReq("own", p2)  # the route's internal request (its one output token never gets a slot)
    _admit(tree, req_pool, alloc, r, 2)
    assert len(r.prefix_indices) == 28 and _holes_in(r.prefix_indices) == []
    _evict_positions(req_pool, alloc, r, [20, 21, 22, 23])  # its own prune (tree-owned positions: sentinels)
    free0 = alloc.available_size()
    tree.cache_finished_req(r, kv_len_to_handle=28)
    assert alloc.available_size() == free0 + 4 and _invariant(tree, alloc) == 0
    nxt = _match(tree, p2 + [7, 1, 2])  # leaves the turn's reply inside it
    assert _holes_in(nxt.device_indices) == [20, 21, 22, 23], _holes_in(nxt.device_indices)


def test_evict_branches_spares_a_conversation_branching_before_the_ranges() -> None:
    tree, req_pool, alloc = _make()
    shared = list(range(100, 120))
    a = _finished(tree, req_pool, alloc, "a", shared + [1, 2, 3, 4], [9], 1)
    b = _finished(tree, req_pool, alloc, "b", shared + [5, 6, 7, 8], [9], 2)
    r = tree_ops.prune(tree, a, None, [(21, 23)], evict_branches=True)
    assert (r.freed_slots, r.evicted_branch_slots) == (2, 0) and _invariant(tree, alloc) == 0
    mb = _match(tree, b + [0])
    assert len(mb.device_indices) == len(b) and _holes_in(mb.device_indices) == []


def test_a_range_a_running_request_holds_is_blocked_and_nothing_changes() -> None:
    tree, req_pool, alloc = _make()
    seq = _finished(tree, req_pool, alloc, "a", list(range(100, 124)), [], 1)
    running = FakeReq("b", seq + [1, 2, 3])
    _admit(tree, req_pool, alloc, running, 2)  # locks the path it matched
    free0 = alloc.available_size()
    r = tree_ops.prune(tree, seq, None, [(3, 8)])
    assert r.status == "blocked" and alloc.available_size() == free0
    assert tree.view_of(seq, None).kept.tolist() == list(range(24))
    assert tree_ops.inspect(tree, seq, None)["hidden_tokens"] == 0
    tree.cache_finished_req(running, kv_len_to_handle=27)
    assert tree_ops.prune(tree, seq, None, [(3, 8)]).status == "completed"
    assert _invariant(tree, alloc) == 0


def test_prune_within_an_eviction_record_and_on_a_stock_tree() -> None:
    tree, req_pool, alloc = _make()
    # A finished eviction request: positions 5..9 already evicted (its Chain Cache record).
    seq = _finished(tree, req_pool, alloc, "a", list(range(100, 124)), [3], 1, evicted=(5, 6, 7, 8, 9))
    r = tree_ops.prune(tree, seq, None, [(0, 12)])
    assert (r.pruned_tokens, r.resident_tokens, r.freed_slots) == (7, 13, 7)  # 0..4 and 10..11 were still resident
    assert _holes_in(_match(tree, seq + [0]).device_indices) == list(range(12))
    assert _invariant(tree, alloc) == 0
    stock, req_pool, alloc = _make(method="dense")
    seq = _finished(stock, req_pool, alloc, "a", list(range(100, 110)), [], 1)
    assert tree_ops.prune(stock, seq, None, [(0, 3)]).status == "failed"
    assert tree_ops.inspect(stock, seq, None)["matched_tokens"] == 10


def test_a_dense_request_on_a_mixed_tree_recomputes_a_pruned_range_and_fills_its_holes() -> None:
    """A mixed server (dense by default, eviction per request): a dense request sharing a pruned sequence's
    first tokens is cached chunk by chunk the stock way until its sequence runs into the pruned holes; then it
    is cached at finish, and its freshly computed slots fill the holes (the next such request matches whole)."""
    tree, req_pool, alloc = _make(method="dense")
    tree.evicting, tree._evicts_for = True, lambda req: False
    seq = _finished(tree, req_pool, alloc, "a", list(range(100, 130)), [], 1)
    assert tree_ops.prune(tree, seq, None, [(10, 20)]).freed_slots == 10
    other = FakeReq("b", seq[:24] + [1, 2, 3, 4])
    _admit(tree, req_pool, alloc, other, 2)
    assert len(other.prefix_indices) == 10  # stops at the first hole
    other.fill_len = 16
    tree.cache_unfinished_req(other, chunked=True)  # the stock path would assert on the holes here
    other.fill_len = 28
    tree.cache_finished_req(other, kv_len_to_handle=28)
    assert _invariant(tree, alloc) == 0
    again = _match(tree, seq[:24] + [1, 2, 3, 4, 5])
    assert len(again.device_indices) == 28 and _holes_in(again.device_indices) == []


def test_a_sequence_cached_inside_a_longer_one_is_pruned_and_freed() -> None:
    """A chat's history (no generation prompt) ends inside the node of the request that served it (history +
    generation prompt + answer): every match through that node continues the history, so it is freed too, and
    a match of the longer sequence stops at the history's end (the pruned view), never at a hole."""
    tree, req_pool, alloc = _make()
    history = list(range(100, 130))
    full = _finished(tree, req_pool, alloc, "a", history + [1, 2], [3], 1)
    r = tree_ops.prune(tree, history, None, [(5, 15)])
    assert (r.status, r.pruned_tokens, r.freed_slots) == ("completed", 10, 10)
    assert _invariant(tree, alloc) == 0
    m = _match(tree, full + [4])
    assert len(m.device_indices) == 30 and _holes_in(m.device_indices) == list(range(5, 15))


def test_chat_ranges_of_a_requests_own_prompt(tok: Any) -> None:
    """The per-request chat form: the role spans of the request's messages, only where the tokenizer's template
    reproduces the start of the prompt the route rendered."""
    from sgl_sparse.prune.body import chat_ranges

    messages = [{"role": "user", "content": "go"}]
    for i in range(3):
        messages += [{"role": "assistant", "content": f"call {i}"}, {"role": "tool", "content": f"output {i}"}]
    render = _render(tok)
    prompt = list(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    prompt_ids = tok.encode("".join(prompt), add_special_tokens=False)
    ids = render(messages)
    assert prompt_ids[:len(ids)] == ids
    ranges = chat_ranges(render, messages, prompt_ids, ["tool"], 1)
    assert [tok.decode(ids[lo:hi]).strip() for lo, hi in ranges] == ["output 0", "output 1"]
    with pytest.raises(BadPruneRequest) as e:
        chat_ranges(render, messages, [ids[0] + 1, *ids[1:]], ["tool"], 1)
    assert e.value.field == "roles" and "renders these messages differently" in str(e.value)
    with pytest.raises(BadPruneRequest) as e:
        chat_ranges(render, messages, prompt_ids, ["tool"], -1)
    assert e.value.field == "lag"
