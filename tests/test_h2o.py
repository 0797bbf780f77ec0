"""H2O against a plain-torch reference (no server): scores accumulated from explicit softmax attention."""

from __future__ import annotations

import pytest
import torch

from sgl_sparse import SparseConfigError, create_method
from sgl_sparse.contract import ObservationWindow, RequestState, StepInfo
from sgl_sparse.reference import ToyAttentionStack, run_request


def _tokens(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_h2o(model: ToyAttentionStack, tokens: list[int], prompt_len: int, chunk_size: int, budget: int,
                  recent: int, window: int, interval: int,
                  prune: list[tuple[int, int]] = ()) -> tuple[torch.Tensor, list[int], list[int], dict]:
    """H2O written out: the same toy stack, attention per query head in float64 loops, each token's
    score the sum of the softmax probabilities it received from the prompt's last ``window`` queries
    and, if ``interval`` > 0, from every decode query, accumulated as the attention is computed. The
    kept set: the top ``budget - recent`` scores outside the last ``recent`` tokens (ties to the earlier
    position) plus the last ``recent``; at the prompt's end and every ``interval`` decoded tokens.
    Returns (last-layer outputs, kept count after each step, final kept positions, and each observed
    query position's contributions ``{query: {key: probability summed over heads and layers}}``).

    ``prune``: ranges the request prunes from its own prompt. They leave at the prompt's end, before its window
    is scored: the prompt attends them, but the window's scores are its softmax over the keys left."""
    pruned = {j for lo, hi in prune for j in range(lo, hi)}
    h_all = model.embed[torch.tensor(tokens)]
    n_layers, hq, hkv, d = model.n_layers, model.n_heads, model.n_kv_heads, model.head_dim
    keys = [torch.zeros(len(tokens), hkv, d) for _ in range(n_layers)]
    vals = [torch.zeros(len(tokens), hkv, d) for _ in range(n_layers)]
    retained: list[int] = []
    score: dict[int, float] = {}
    received: dict[int, dict[int, float]] = {}
    outs, kept_after = [], []
    steps = [(s, min(s + chunk_size, prompt_len)) for s in range(0, prompt_len, chunk_size)]
    steps += [(i, i + 1) for i in range(prompt_len, len(tokens))]
    decoded = 0
    for start, end in steps:
        decode = start >= prompt_len
        retained += list(range(start, end))
        h = h_all[start:end]
        for layer in range(n_layers):
            q, k, v = model.project(layer, h)
            keys[layer][start:end], vals[layer][start:end] = k, v
            out = torch.zeros(end - start, hq, d)
            for i in range(end - start):
                p = start + i
                visible = [j for j in retained if j <= p]
                observed = (decode and interval > 0) or (not decode and p >= prompt_len - window)
                for head in range(hq):
                    kv = head // (hq // hkv)
                    logits = torch.stack([keys[layer][j, kv].double() @ q[i, head].double() for j in visible])
                    probs = (logits / d**0.5).softmax(0)
                    out[i, head] = (probs[:, None] * vals[layer][visible, kv].double()).sum(0).float()
                    seen = visible
                    if observed and not decode and pruned:
                        seen = [j for j in visible if j not in pruned]
                        logits = torch.stack([keys[layer][j, kv].double() @ q[i, head].double() for j in seen])
                        probs = (logits / d**0.5).softmax(0)
                    if observed:
                        for j, pr in zip(seen, probs.tolist()):
                            score[j] = score.get(j, 0.0) + pr
                            received.setdefault(p, {})[j] = received.get(p, {}).get(j, 0.0) + pr
            h = out.reshape(end - start, -1)
        outs.append(h)
        decoded += decode
        if end == prompt_len:
            retained = [j for j in retained if j not in pruned]
        evict = (end == prompt_len) if not decode else (interval > 0 and decoded % interval == 0)
        if evict and len(retained) > budget:
            old, rest = retained[len(retained) - recent:] if recent else [], retained[:len(retained) - recent]
            heavy = sorted(rest, key=lambda j: (-score.get(j, 0.0), j))[:budget - recent]
            retained = sorted(heavy) + old
        kept_after.append(len(retained))
    return torch.cat(outs), kept_after, retained, received


@pytest.mark.parametrize(("budget", "ratio", "window", "interval"), [
    (24, 0.25, 8, 8),  # decode eviction every 8 decoded tokens, scored every 8
    (24, 0.25, 4, 6),  # scored every 4 and before each eviction at 6, 12, ...
    (20, 0.5, 8, 0),  # prompt only: decode appends, unscored
    (16, 0.0, 8, 5),  # heavy hitters only
    (16, 1.0, 8, 5),  # recent only
])
def test_h2o_equals_plain_reference(budget: int, ratio: float, window: int, interval: int) -> None:
    model, tokens, prompt_len, chunk = ToyAttentionStack(), _tokens(84, seed=3), 60, 16
    cfg = {"budget": budget, "recent_ratio": ratio, "window_size": window, "evict_interval": interval,
           "carry_scores": True}  # on_finish hands over the table only then
    method = create_method("h2o", cfg)
    trace = run_request(method, model, tokens, prompt_len=prompt_len, chunk_size=chunk)
    recent = int(budget * ratio)
    ref_out, ref_kept_after, ref_kept, received = reference_h2o(model, tokens, prompt_len, chunk, budget, recent,
                                                                 window, interval)
    assert trace.state.kept.tolist() == ref_kept
    assert trace.kept_after_step == ref_kept_after
    assert torch.allclose(trace.outputs, ref_out, atol=1e-4)
    assert ref_kept_after[len(range(0, prompt_len, chunk)) - 1] == budget  # compacted at the prompt's end
    if interval:
        assert max(ref_kept_after[4:]) <= budget + interval
        # The score table follows the retained order through every compaction.
        table = method.on_finish(trace.state).data["h2o_scores"]
        assert table.numel() == trace.state.num_kept
        # Queries decoded after the last observation are not scored yet (fewer than window_size of them).
        scored = trace.state.extra["h2o_scored"]
        assert len(tokens) - window < scored <= len(tokens)
        expected = torch.tensor([sum(c.get(j, 0.0) for p, c in received.items() if p < scored) for j in ref_kept],
                                dtype=torch.float32)
        assert torch.allclose(table, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("budget", "interval", "prune"), [
    (24, 8, [(10, 30)]),  # 40 left, compacted to 24, then every 8 decoded tokens
    (24, 5, [(0, 4), (50, 58)]),  # the window's own keys partly pruned
    (40, 6, [(20, 40)]),  # the 40 left fit the budget: nothing more at the prompt's end
])
def test_h2o_with_a_prune_equals_plain_reference(budget: int, interval: int, prune: list[tuple[int, int]]) -> None:
    """A request that prunes its own prompt: its window is scored over the keys left, the budget counts what is
    left, the score table stays aligned with the kept set through every later compaction, and each one keeps what
    the reference keeps."""
    model, tokens, prompt_len, chunk = ToyAttentionStack(), _tokens(84, seed=3), 60, 16
    cfg = {"budget": budget, "recent_ratio": 0.25, "window_size": 8, "evict_interval": interval, "carry_scores": True}
    method = create_method("h2o", cfg)
    trace = run_request(method, model, tokens, prompt_len=prompt_len, chunk_size=chunk, prune=prune)
    ref_out, ref_kept_after, ref_kept, received = reference_h2o(model, tokens, prompt_len, chunk, budget,
                                                                 int(budget * 0.25), 8, interval, prune)
    assert trace.state.kept.tolist() == ref_kept
    assert trace.kept_after_step == ref_kept_after
    assert torch.allclose(trace.outputs, ref_out, atol=1e-4)
    assert ref_kept_after[3] == min(budget, prompt_len - sum(hi - lo for lo, hi in prune))
    table = method.on_finish(trace.state).data["h2o_scores"]
    scored = trace.state.extra["h2o_scored"]
    expected = [sum(c.get(j, 0.0) for p, c in received.items() if p < scored) for j in ref_kept]
    assert table.numel() == trace.state.num_kept
    assert torch.allclose(table, torch.tensor(expected, dtype=torch.float32), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("carry", [True, False])
def test_a_continuation_that_prunes_drops_the_restored_scores_of_what_it_prunes(carry: bool) -> None:
    """Turn 2 resumes turn 1's heavy hitters, with their scores (the payload) under ``carry_scores`` and at zero
    by default, and prunes some of them and some of its new tokens: on_prune drops exactly their entries (the
    table stays the retained set's length, in retained order), and the prompt-end compaction keeps what a plain
    reference picks from the restored scores plus the window's softmax over the keys left."""
    model = ToyAttentionStack()
    cfg = {"budget": 24, "recent_ratio": 0.25, "window_size": 4, "evict_interval": 4, "carry_scores": carry}
    method = create_method("h2o", cfg)
    first = run_request(method, model, _tokens(72), prompt_len=60, chunk_size=16)
    payload = method.on_finish(first.state)
    assert (payload is not None) == carry  # the default leaves no table in the tree
    table = payload.data["h2o_scores"].tolist() if payload is not None else [0.0] * first.state.num_kept
    restored = dict(zip(first.state.kept.tolist(), table))

    st = method.new_state("turn2")
    st.set_kept(first.state.kept, logical_len=72)  # the tree's match view
    method.restore_state(st, payload)
    st.advance(28)  # the new prompt's tokens, 72..99
    prune = [(20, 50), (80, 90)]
    gone = torch.tensor([p for p in st.kept.tolist() if any(lo <= p < hi for lo, hi in prune)])
    method.on_prune(st, gone)  # what the runtime does at the end of the final prefill step
    st.set_kept(st.kept[~torch.isin(st.kept, gone)])
    left = st.kept.tolist()
    if carry:
        assert st.extra["h2o_scores"].tolist() == [restored[p] for p in left if p in restored]
    else:
        assert "h2o_scores" not in st.extra

    g = torch.Generator().manual_seed(4)
    n_layers, w, scale = 2, 4, 8**-0.5
    queries = [torch.randn(w, 4, 8, generator=g) for _ in range(n_layers)]
    keys = [torch.randn(100, 2, 8, generator=g) for _ in range(n_layers)]
    window = ObservationWindow(queries=dict(enumerate(queries)), q_pos=torch.arange(100 - w, 100),
                               key_buffer=lambda layer: keys[layer], key_rows=st.kept, k_pos=st.kept,
                               num_layers=n_layers, scale=scale)
    step = StepInfo(True, 28, 0, final_prefill=True)
    assert method.wants_observation(st, step)
    method.on_observation(st, window)
    plan = method.on_step_end(st, step)

    score = {p: restored.get(p, 0.0) for p in left}
    for layer in range(n_layers):
        for i, qp in enumerate(range(100 - w, 100)):
            visible = [p for p in left if p <= qp]
            for head in range(4):
                logits = torch.stack([keys[layer][p, head // 2].double() @ queries[layer][i, head].double()
                                      for p in visible]) * scale
                for p, pr in zip(visible, logits.softmax(0).tolist()):
                    score[p] += pr
    recent = int(24 * 0.25)
    heavy = sorted(left[:-recent], key=lambda p: (-score[p], p))[:24 - recent]
    assert plan is not None and plan.keep.tolist() == sorted(heavy) + left[-recent:]
    assert torch.allclose(st.extra["h2o_scores"], torch.tensor([score[p] for p in plan.keep.tolist()],
                                                                 dtype=torch.float32), rtol=1e-4, atol=1e-4)


def test_budget_covering_the_sequence_reproduces_dense() -> None:
    model, tokens = ToyAttentionStack(), _tokens(90)
    dense = run_request(create_method("dense"), model, tokens, prompt_len=70, chunk_size=32)
    sparse = run_request(create_method("h2o", {"budget": 200, "window_size": 8, "evict_interval": 4}), model, tokens,
                         prompt_len=70, chunk_size=32)
    assert torch.equal(sparse.outputs, dense.outputs)
    assert sparse.kept_after_step == dense.kept_after_step


def test_scores_survive_chain_cache_through_the_payload() -> None:
    method = create_method("h2o", {"budget": 24, "recent_ratio": 0.25, "window_size": 4, "evict_interval": 4,
                                   "carry_scores": True})
    trace = run_request(method, ToyAttentionStack(), _tokens(72), prompt_len=60, chunk_size=16)
    payload = method.on_finish(trace.state)
    assert payload is not None
    nxt = method.new_state("next")
    nxt.set_kept(trace.state.kept, logical_len=trace.state.logical_len)  # what the tree's match view gives
    method.restore_state(nxt, payload)
    assert torch.equal(nxt.extra["h2o_scores"], payload.data["h2o_scores"])
    assert nxt.extra["h2o_scored"] == 72  # the prefix's queries are not scored twice
    # A payload that does not describe this kept set (a cut match) is not restored.
    cut = method.new_state("cut")
    cut.set_kept(trace.state.kept[:-3], logical_len=69)
    method.restore_state(cut, payload)
    assert "h2o_scores" not in cut.extra


def test_config_defaults_and_errors() -> None:
    m = create_method("h2o")
    assert m.config.to_dict() == {"budget": 8192, "recent_ratio": 0.5, "window_size": 128, "evict_interval": 1024,
                                  "carry_scores": False}
    assert m.config.recent_tokens == 4096 and m.observation_window() == 128 and m.observes_decode()
    assert not create_method("h2o", {"evict_interval": 0}).observes_decode()
    st = RequestState(rid="r")
    assert m.on_finish(st) is None
    for cfg, message in [({"budget": 0}, "field 'budget' must be >= 1"),
                         ({"recent_ratio": 1.5}, "field 'recent_ratio' must be in"),
                         ({"window_size": 0}, "field 'window_size' must be >= 1"),
                         ({"evict_interval": -1}, "field 'evict_interval' must be >= 0")]:
        with pytest.raises(SparseConfigError, match=message):
            create_method("h2o", cfg)


def test_scores_survive_the_prefix_tree() -> None:
    """Through SGLang's real radix tree and pools (no server): the scores a finishing turn leaves beside its
    compacted KV come back to the turn that resumes at its end, aligned with the kept set it resumes with."""
    from sgl_sparse.radix.records import FinishedState
    from tests.test_sparse_tree import FakeReq, _admit, _evict_positions, _invariant, _make

    tree, req_pool, alloc = _make(method="h2o")
    method = create_method("h2o", {"carry_scores": True})  # the default leaves no table (test above)
    prompt, answer, hidden = list(range(900, 920)), [1, 2, 3, 4, 5, 6], [3, 4, 5, 9, 10]
    st = method.new_state("a")
    st.set_kept(torch.tensor([p for p in range(26) if p not in hidden]), logical_len=26)
    st.extra["h2o_scores"] = torch.arange(21, dtype=torch.float32)  # one per kept position, in retained order
    tree._on_finish = lambda req: FinishedState(kept=st.kept, payload=method.on_finish(st), tail_start=20)
    a = FakeReq("a", prompt, output_ids=answer)
    _admit(tree, req_pool, alloc, a, 1)
    _evict_positions(req_pool, alloc, a, hidden)
    tree.cache_finished_req(a, kv_len_to_handle=26)
    assert _invariant(tree, alloc) == 0

    b = FakeReq("b", prompt + answer + [77, 78])
    _admit(tree, req_pool, alloc, b, 2)
    view = b._sgl_sparse_view
    assert view.length == 26 and view.payload is not None
    nxt = method.new_state("b")
    nxt.set_kept(view.kept, logical_len=view.length)  # what the runtime does at admission
    method.restore_state(nxt, view.payload)
    assert nxt.extra["h2o_scores"].tolist() == list(range(21))
