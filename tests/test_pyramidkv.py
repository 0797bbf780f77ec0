"""PyramidKV against a plain-torch reference (no server): per-layer budgets on kvpress's schedule, per-layer
SnapKV selections, the union that stays resident, and each layer reading only its own set."""

from __future__ import annotations

import pytest
import torch

from sgl_sparse import SparseConfigError, create_method
from sgl_sparse.contract import KVGeometry, ObservationWindow, RequestState, StepInfo, TreePayload
from sgl_sparse.methods.eviction.pyramidkv import PENDING, UNUSED, LayerKeepSelector, layer_budgets
from sgl_sparse.reference import ToyAttentionStack, run_request


def _tokens(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def kvpress_budgets(n: int, num_layers: int, budget: int, fixed: int, beta: int, window: int) -> list[int]:
    """kvpress ``PyramidKVPress.get_layer_budget`` (0.5.5) written out with ``max_capacity_prompt = budget`` and the
    window there replaced by our fixed part (sink + window); no compression while ``n <= budget``. Its guard first,
    in its own terms (``budget`` kept of ``n`` with the ``window``): a smallest layer under the window, every layer
    keeps ``budget``."""
    if n <= budget:
        return [n] * num_layers
    lo, hi = budget / beta, 2 * budget - budget / beta
    if hi >= n - window:
        hi = n - window
        lo = 2 * budget - hi
    if not n >= hi >= lo >= window:
        return [budget] * num_layers
    min_num = (budget - fixed) / beta
    max_num = (budget - fixed) * 2 - min_num
    if max_num >= n - fixed:
        max_num = n - fixed
        min_num = (budget - fixed) * 2 - max_num
    steps = (max_num - min_num) / (num_layers - 1)
    return [fixed + round(max_num - i * steps) for i in range(num_layers)]


def _pool(x: list[float], kernel: int, pooling: str) -> list[float]:
    pad = kernel // 2
    out = []
    for i in range(len(x)):
        part = x[max(0, i - pad):i + pad + 1]
        out.append(sum(part) / len(part) if pooling == "avgpool" else max(part))
    return out


def reference_pyramidkv(model: ToyAttentionStack, tokens: list[int], prompt_len: int, chunk: int, budget: int,
                        beta: int, window: int, kernel: int, pooling: str, sink: int, interval: int,
                        prune: list[tuple[int, int]] = ()) -> tuple[torch.Tensor, list[int], list[list[int]],
                                                                    list[list[int]]]:
    """PyramidKV written out: every layer holds its own list of positions and attends only to it (float64 loops
    per query head). At the prompt's end (and every ``interval`` decoded tokens), when some layer holds more
    than its budget, each layer scores its own positions with the softmax of the last ``window`` queries (causal,
    GQA group and queries summed per KV head), pools along its positions, sums the KV heads, and keeps its
    first ``sink`` and last ``window`` positions plus the best others up to its budget (ties to the earlier).
    Returns (last-layer outputs, union size after each step, each layer's final positions, the budgets of each
    selection). ``prune``: ranges the request prunes from its own prompt, gone from every layer's list at the
    prompt's end, before its selection."""
    h_all = model.embed[torch.tensor(tokens)]
    n_layers, hq, hkv, d = model.n_layers, model.n_heads, model.n_kv_heads, model.head_dim
    group = hq // hkv
    keys = [torch.zeros(len(tokens), hkv, d, dtype=torch.float64) for _ in range(n_layers)]
    vals = [torch.zeros(len(tokens), hkv, d, dtype=torch.float64) for _ in range(n_layers)]
    qs = [torch.zeros(len(tokens), hq, d, dtype=torch.float64) for _ in range(n_layers)]
    sets: list[list[int]] = [[] for _ in range(n_layers)]
    outs, union_after, budgets_seen = [], [], []
    steps = [(s, min(s + chunk, prompt_len)) for s in range(0, prompt_len, chunk)]
    steps += [(i, i + 1) for i in range(prompt_len, len(tokens))]
    decoded = 0
    for start, end in steps:
        h = h_all[start:end]
        for layer in range(n_layers):
            q, k, v = model.project(layer, h)
            qs[layer][start:end], keys[layer][start:end], vals[layer][start:end] = q, k, v
            sets[layer] += list(range(start, end))
            out = torch.zeros(end - start, hq, d)
            for i in range(end - start):
                p = start + i
                visible = [j for j in sets[layer] if j <= p]
                for head in range(hq):
                    logits = keys[layer][visible, head // group] @ qs[layer][p, head] / d**0.5
                    out[i, head] = (logits.softmax(0)[:, None] * vals[layer][visible, head // group]).sum(0).float()
            h = out.reshape(end - start, -1)
        outs.append(h)
        decoded += start >= prompt_len
        if end == prompt_len:
            sets = [[j for j in layer_set if not any(lo <= j < hi for lo, hi in prune)] for layer_set in sets]
        select = end == prompt_len or (start >= prompt_len and interval > 0 and decoded % interval == 0)
        budgets = kvpress_budgets(end, n_layers, budget, sink + window, beta, window)
        if select and any(len(s) > b for s, b in zip(sets, budgets)):
            budgets_seen.append(budgets)
            for layer in range(n_layers):
                cand = sets[layer]
                if len(cand) <= budgets[layer]:
                    continue
                per_kv = [[0.0] * len(cand) for _ in range(hkv)]
                for p in range(end - window, end):
                    visible = [ci for ci, j in enumerate(cand) if j <= p]
                    for head in range(hq):
                        logits = torch.stack([keys[layer][cand[ci], head // group] @ qs[layer][p, head]
                                              for ci in visible]) / d**0.5
                        for ci, pr in zip(visible, logits.softmax(0).tolist()):
                            per_kv[head // group][ci] += pr
                score = [sum(col) for col in zip(*(_pool(row, kernel, pooling) for row in per_kv))]
                middle = range(sink, len(cand) - window)
                best = sorted(middle, key=lambda ci: (-score[ci], ci))[:budgets[layer] - sink - window]
                sets[layer] = [cand[ci] for ci in sorted([*range(sink), *best, *range(len(cand) - window, len(cand))])]
        union_after.append(len(set().union(*sets)))
    return torch.cat(outs), union_after, sets, budgets_seen


def test_layer_budgets_follow_kvpress() -> None:
    for n, layers, budget, fixed, beta, window in [
            (20000, 32, 8192, 96, 20, 32), (9000, 32, 8192, 96, 20, 32), (100, 4, 40, 10, 3, 8), (45, 4, 40, 10, 3, 8),
            (41, 3, 40, 10, 20, 8), (40, 4, 40, 10, 3, 8), (2048, 4, 512, 96, 20, 32), (2048, 4, 512, 80, 20, 16)]:
        got = layer_budgets(n, layers, budget, fixed, beta, window)
        assert got == kvpress_budgets(n, layers, budget, fixed, beta, window)
        assert got == sorted(got, reverse=True) and all(fixed <= b <= n for b in got)
        assert abs(sum(got) / layers - min(n, budget)) <= 0.5  # the layers' mean is the budget (n within: all)
    # Far past the budget: first layer 2 avg - avg / beta, last avg / beta (scored parts).
    assert layer_budgets(10**6, 32, 8192, 96, 20, 32)[0] == 96 + round(2 * 8096 - 8096 / 20)
    assert layer_budgets(10**6, 32, 8192, 96, 20, 32)[-1] == 96 + round(8096 / 20)
    # Just past it: the first layer keeps the whole context (max capped at n - fixed).
    assert layer_budgets(9000, 32, 8192, 96, 20, 32)[0] == 9000
    assert layer_budgets(500, 1, 64, 8, 20, 4) == [64]
    # kvpress's guard: 512 kept of 2,048 at beta 20 gives a smallest layer of 25.6 < the window of 32: uniform (the
    # quality-small case, QUALITY.md); with a window of 16 the pyramid applies.
    assert layer_budgets(2048, 4, 512, 96, 20, 32) == [512] * 4
    assert layer_budgets(2048, 4, 512, 80, 20, 16)[0] > layer_budgets(2048, 4, 512, 80, 20, 16)[-1]


@pytest.mark.parametrize(("budget", "beta", "window", "kernel", "pooling", "sink", "interval"), [
    (24, 20, 4, 3, "avgpool", 2, 0),  # prompt-end selection only; 24 / 20 < window 4: kvpress's guard, uniform
    (24, 3, 4, 5, "maxpool", 0, 0),  # a gentler pyramid, no sink
    (20, 20, 4, 1, "avgpool", 2, 6),  # re-selection every 6 decoded tokens over each layer's own set (uniform)
    (24, 3, 4, 3, "avgpool", 2, 6),  # the same with a pyramid
    (40, 4, 8, 3, "avgpool", 4, 0),  # the first layers keep almost everything (max capped at the context)
])
def test_pyramidkv_equals_plain_reference(budget: int, beta: int, window: int, kernel: int, pooling: str, sink: int,
                                          interval: int) -> None:
    model, tokens, prompt_len, chunk = ToyAttentionStack(n_layers=4), _tokens(76, seed=5), 60, 16
    cfg = {"budget": budget, "beta": beta, "window_size": window, "kernel_size": kernel, "pooling": pooling,
           "sink_tokens": sink, "decode_interval": interval}
    method = create_method("pyramidkv", cfg)
    trace = run_request(method, model, tokens, prompt_len=prompt_len, chunk_size=chunk)
    ref_out, ref_union, ref_sets, ref_budgets = reference_pyramidkv(model, tokens, prompt_len, chunk, budget, beta,
                                                                    window, kernel, pooling, sink, interval)
    assert trace.kept_after_step == ref_union  # what stays resident: the union of the layers' sets
    kept = trace.state.kept
    masks = method.layer_masks(trace.state, model.n_layers)
    assert [kept[masks[layer]].tolist() for layer in range(model.n_layers)] == ref_sets
    assert method.last_budgets == ref_budgets[-1]
    # The layers really keep different amounts, unless kvpress's guard made the budgets uniform.
    assert (len(set(map(len, ref_sets))) > 1) == (budget / beta >= window)
    # Each layer attended to its own set only: the outputs are the reference's (prefill's, then decode's).
    torch.testing.assert_close(trace.outputs, ref_out, rtol=1e-4, atol=1e-4)
    stats = method.stats()
    assert stats["selections"] == len(ref_budgets)
    assert stats["mean_union_tokens"] >= stats["mean_layer_tokens"]


@pytest.mark.parametrize(("budget", "interval", "prune"), [
    (24, 6, [(10, 30)]),  # 40 left: each layer's budget over them, then re-selections over each layer's own set
    (40, 0, [(0, 5), (45, 50)]),  # the 50 left past the budget: the pyramid trims the later layers only
])
def test_pyramidkv_with_a_prune_equals_plain_reference(budget: int, interval: int,
                                                       prune: list[tuple[int, int]]) -> None:
    model, tokens, prompt_len, chunk = ToyAttentionStack(n_layers=4), _tokens(76, seed=5), 60, 16
    cfg = {"budget": budget, "beta": 3, "window_size": 4, "kernel_size": 3, "pooling": "avgpool", "sink_tokens": 2,
           "decode_interval": interval}
    method = create_method("pyramidkv", cfg)
    trace = run_request(method, model, tokens, prompt_len=prompt_len, chunk_size=chunk, prune=prune)
    ref_out, ref_union, ref_sets, ref_budgets = reference_pyramidkv(model, tokens, prompt_len, chunk, budget, 3, 4,
                                                                    3, "avgpool", 2, interval, prune)
    assert trace.kept_after_step == ref_union
    masks = method.layer_masks(trace.state, model.n_layers)
    assert [trace.state.kept[masks[layer]].tolist() for layer in range(model.n_layers)] == ref_sets
    assert method.last_budgets == ref_budgets[-1]
    torch.testing.assert_close(trace.outputs, ref_out, rtol=1e-4, atol=1e-4)
    assert not any(lo <= p < hi for p in trace.state.kept.tolist() for lo, hi in prune)


def test_a_continuation_that_prunes_drops_the_restored_layer_sets_columns() -> None:
    """Turn 2 resumes turn 1's per-layer sets (the payload) and prunes some of their positions and some new ones:
    on_prune drops exactly those columns of the masks (aligned with the kept set the runtime sets next), and the
    prompt-end selection scores each layer over its restored set less the pruned positions plus the new tokens
    left, keeping what a plain reference keeps."""
    cfg = {"budget": 24, "beta": 3, "window_size": 4, "kernel_size": 3, "sink_tokens": 2}
    method = create_method("pyramidkv", cfg)
    method.selector.allocate(KVGeometry(4, 4, 2, 8, 1, 256, torch.float32, torch.device("cpu"),
                                               max_requests=2))
    first = run_request(method, ToyAttentionStack(n_layers=4), _tokens(70), prompt_len=60, chunk_size=16)
    payload = method.on_finish(first.state)
    kept1 = first.state.kept
    restored = [set(kept1[payload.data["pyramidkv_layers"][layer]].tolist()) for layer in range(4)]

    st = method.new_state("turn2")
    st.set_kept(kept1, logical_len=70)
    method.restore_state(st, payload)
    st.advance(30)  # the new prompt's tokens, 70..99
    prune = [(20, 50), (75, 85)]
    gone = torch.tensor([p for p in st.kept.tolist() if any(lo <= p < hi for lo, hi in prune)])
    method.on_prune(st, gone)
    st.set_kept(st.kept[~torch.isin(st.kept, gone)])
    left = st.kept.tolist()
    masks = method.layer_masks(st, 4)
    assert masks.shape == (4, st.num_kept)
    cands = [[p for p in left if p in restored[layer] or p >= 70] for layer in range(4)]
    assert [[p for p, m in zip(left, masks[layer].tolist()) if m] for layer in range(4)] == cands

    g = torch.Generator().manual_seed(2)
    w, scale = 4, 8**-0.5
    queries = [torch.randn(w, 4, 8, generator=g) for _ in range(4)]
    keys = [torch.randn(100, 2, 8, generator=g) for _ in range(4)]
    window = ObservationWindow(queries=dict(enumerate(queries)), q_pos=torch.arange(100 - w, 100),
                               key_buffer=lambda layer: keys[layer], key_rows=st.kept, k_pos=st.kept, num_layers=4,
                               scale=scale)
    step = StepInfo(True, 30, 0, final_prefill=True)
    assert method.wants_observation(st, step)
    method.on_observation(st, window)
    plan = method.on_step_end(st, step)
    budgets = layer_budgets(100, 4, 24, 6, 3, 4)
    want = []
    for layer in range(4):
        cand = cands[layer]
        if len(cand) <= budgets[layer]:
            want.append(cand)
            continue
        per_kv = [[0.0] * len(cand) for _ in range(2)]
        for i, qp in enumerate(range(100 - w, 100)):
            visible = [c for c, p in enumerate(cand) if p <= qp]
            for head in range(4):
                logits = torch.stack([keys[layer][cand[c], head // 2].double() @ queries[layer][i, head].double()
                                      for c in visible]) * scale
                for c, pr in zip(visible, logits.softmax(0).tolist()):
                    per_kv[head // 2][c] += pr
        score = [sum(col) for col in zip(*(_pool(row, 3, "avgpool") for row in per_kv))]
        best = sorted(range(2, len(cand) - w), key=lambda c: (-score[c], c))[:budgets[layer] - 2 - w]
        want.append([cand[c] for c in sorted([0, 1, *best, *range(len(cand) - w, len(cand))])])
    assert plan is not None and plan.keep.tolist() == sorted(set().union(*want))
    masks = st.extra["pyramidkv_layers"]
    assert [plan.keep[masks[layer]].tolist() for layer in range(4)] == want


def test_union_only_reading_would_differ() -> None:
    """The per-layer reading matters: the same selection read as the union in every layer gives other outputs
    (so the equality above cannot come from reading the union)."""
    model, tokens = ToyAttentionStack(n_layers=4), _tokens(76, seed=5)
    cfg = {"budget": 24, "beta": 3, "window_size": 4, "kernel_size": 3, "sink_tokens": 2}
    per_layer = run_request(create_method("pyramidkv", cfg), model, tokens, prompt_len=60, chunk_size=16)
    method = create_method("pyramidkv", cfg)
    method.selector.set_request = lambda state, sets: None  # every layer reads the union (tail 0: all live)
    union = run_request(method, model, tokens, prompt_len=60, chunk_size=16)
    assert union.kept_after_step == per_layer.kept_after_step
    assert not torch.allclose(union.outputs[60:], per_layer.outputs[60:], atol=1e-3)


def test_budget_covering_the_sequence_reproduces_dense() -> None:
    model, tokens = ToyAttentionStack(n_layers=4), _tokens(90)
    dense = run_request(create_method("dense"), model, tokens, prompt_len=70, chunk_size=32)
    sparse = run_request(create_method("pyramidkv", {"budget": 90, "window_size": 8, "sink_tokens": 4,
                                                      "decode_interval": 4}), model, tokens, prompt_len=70,
                         chunk_size=32)
    torch.testing.assert_close(sparse.outputs, dense.outputs, rtol=1e-6, atol=1e-6)
    assert sparse.kept_after_step == dense.kept_after_step
    # One token short of the prompt: every layer drops one (69 / 20 < the window of 8: kvpress's guard, uniform).
    short = run_request(create_method("pyramidkv", {"budget": 69, "window_size": 8, "sink_tokens": 4,
                                                     "decode_interval": 4}), model, tokens, prompt_len=70,
                        chunk_size=32)
    assert not torch.allclose(short.outputs[70:], dense.outputs[70:], atol=1e-4)


def _selector(layers: int = 2, hkv: int = 2) -> LayerKeepSelector:
    sel = LayerKeepSelector(width=16)
    sel.allocate(KVGeometry(layers, 4, hkv, 8, 1, 64, torch.float32, torch.device("cpu"), max_requests=3))
    return sel


def test_selector_rows_are_the_layer_sets_plus_the_tail_and_never_a_previous_owners() -> None:
    sel = _selector()
    r2t = torch.arange(1, 3 * 20 + 1, dtype=torch.int32).view(3, 20)
    r2t[1, [2, 3, 7]] = 0  # evicted (sentinels)
    positions = torch.tensor([0, 1, 4, 5, 6, 8, 9])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 0, 0, 1, 0, 0, 1]], dtype=torch.bool)
    a, b, c = RequestState("a"), RequestState("b"), RequestState("c")
    sel.set_request(a, (positions, mask, 10))
    sel.set_request(b, None)
    sel.bind([a, b, None], [1, 2, 0])
    assert not a.extra and not b.extra  # handed over once
    seq = torch.tensor([13, 5])
    want0 = [0, 1, 4, 5, 6, 8, 9, 10, 11, 12]
    want1 = [0, 5, 9, 10, 11, 12]
    for layer, want in ((0, want0), (1, want1)):
        pages = sel.select(layer, None, r2t, torch.tensor([1, 2]), seq)
        assert pages.shape[0] == 4  # one row per (request, KV head)
        assert pages[0][pages[0] != UNUSED].tolist() == want and torch.equal(pages[0], pages[1])
        assert pages[2][pages[2] != UNUSED].tolist() == list(range(5))  # no sets: every live position
    # A new request in row 1: admitted with no sets, it reads its live positions, not "a"'s sets.
    sel.set_request(c, None)
    sel.bind([c], [1])
    pages = sel.select(1, None, r2t, torch.tensor([1]), torch.tensor([13]))
    assert pages[0][pages[0] != UNUSED].tolist() == [p for p in range(13) if p not in (2, 3, 7)]


def test_layer_sets_survive_chain_cache_through_the_payload() -> None:
    cfg = {"budget": 24, "beta": 3, "window_size": 4, "kernel_size": 3, "sink_tokens": 2}
    method = create_method("pyramidkv", cfg)
    trace = run_request(method, ToyAttentionStack(n_layers=4), _tokens(70), prompt_len=60, chunk_size=16)
    payload = method.on_finish(trace.state)
    assert payload is not None
    masks = payload.data["pyramidkv_layers"]
    assert masks.shape == (4, trace.state.num_kept) and masks[:, -10:].all()  # decoded tokens: every layer
    nxt = method.new_state("next")
    nxt.set_kept(trace.state.kept, logical_len=trace.state.logical_len)  # what the tree's match view gives
    method.restore_state(nxt, payload)
    assert torch.equal(method.layer_masks(nxt, 4), masks)
    positions, mask, tail = nxt.extra[PENDING]
    assert torch.equal(positions, trace.state.kept) and torch.equal(mask, masks) and tail == 70
    # A cut match (inside the record's tail: no payload that fits): every layer reads the union, counted.
    cut = method.new_state("cut")
    cut.set_kept(trace.state.kept[:-3], logical_len=67)
    method.restore_state(cut, payload)
    assert "pyramidkv_layers" not in cut.extra and cut.extra[PENDING] is None
    assert method.stats()["resumed_without_layer_sets"] == 1


def test_continuation_reselects_each_layer_over_its_own_set() -> None:
    """A resumed turn past the budget again: each layer's candidates are its restored set plus the new tokens
    (a position another layer dropped never comes back into it)."""
    method = create_method("pyramidkv", {"budget": 24, "beta": 3, "window_size": 4, "kernel_size": 3,
                                          "sink_tokens": 2})
    method.selector.allocate(KVGeometry(4, 4, 2, 16, 1, 256, torch.float32, torch.device("cpu"),
                                               max_requests=2))
    first = run_request(method, ToyAttentionStack(n_layers=4), _tokens(70), prompt_len=60, chunk_size=16)
    payload = method.on_finish(first.state)
    st = method.new_state("turn2")
    st.set_kept(first.state.kept, logical_len=70)
    method.restore_state(st, payload)
    before = method.layer_masks(st, 4)
    st.advance(30)  # the next prompt's 30 tokens
    step = StepInfo(True, 30, 0, final_prefill=True)
    assert method.wants_observation(st, step)
    scored = []
    for layer in range(4):  # the scores themselves do not matter here: the candidates do
        cand = torch.cat([st.kept[:before.shape[1]][before[layer]], torch.arange(70, 100)])
        scored.append((cand, torch.rand(cand.numel(), generator=torch.Generator().manual_seed(layer))))
    plan = method.select_layers(st, scored, layer_budgets(100, 4, 24, 6, 3, 4))
    assert plan is not None
    masks = st.extra["pyramidkv_layers"]
    for layer in range(4):
        chosen = set(plan.keep[masks[layer]].tolist())
        assert chosen <= set(scored[layer][0].tolist())
        assert len(chosen) == layer_budgets(100, 4, 24, 6, 3, 4)[layer]


def test_config_defaults_and_errors() -> None:
    m = create_method("pyramidkv")
    assert m.config.to_dict() == {"budget": 8192, "beta": 20, "window_size": 32, "kernel_size": 5,
                                  "pooling": "avgpool", "sink_tokens": 64, "decode_interval": 0}
    assert m.observation_window() == 32 and not m.observes_decode() and m.evicts
    assert m.selector.static and m.selector.selects(0)
    assert m.on_finish(RequestState(rid="r")) is None
    assert create_method("pyramidkv", {"decode_interval": 8}).observes_decode()
    for cfg, message in [({"budget": 0}, "field 'budget' must be >= 1"),
                         ({"beta": 0}, "field 'beta' must be >= 1"),
                         ({"budget": 64, "sink_tokens": 40, "window_size": 32}, "field 'sink_tokens'"),
                         ({"kernel_size": 4}, "field 'kernel_size' must be odd"),
                         ({"pooling": "sum"}, "field 'pooling' must be one of"),
                         ({"decode_interval": -1}, "field 'decode_interval' must be >= 0")]:
        with pytest.raises(SparseConfigError, match=message):
            create_method("pyramidkv", cfg)


def test_composition_over_a_store_is_refused() -> None:
    with pytest.raises(SparseConfigError, match="pyramidkv reads each layer's own kept set"):
        create_method("pyramidkv+fp8_kv")


def test_payload_of_a_request_that_never_selected_is_none() -> None:
    method = create_method("pyramidkv", {"budget": 200, "window_size": 4, "sink_tokens": 2})
    trace = run_request(method, ToyAttentionStack(n_layers=4), _tokens(40), prompt_len=30, chunk_size=16)
    assert method.on_finish(trace.state) is None
    assert method.stats()["selections"] == 0
    assert isinstance(TreePayload().data, dict)


def test_launcher_serves_pyramidkv_on_cuda_and_cpu_and_accounts_for_its_layer_sets(
        capsys: pytest.CaptureFixture[str]) -> None:
    from sgl_sparse.integration.launch import parse_args

    args, hand = parse_args(["--model-path", "m", "--device", "cuda", "--sparse-method", "pyramidkv"])
    # the layer sets are per request row, accounted for before the pool is sized: the rows must be known
    assert hand.method == "pyramidkv" and args.max_running_requests is not None
    args, hand = parse_args(["--model-path", "m", "--device", "cpu", "--sparse-method", "pyramidkv"])
    assert hand.method == "pyramidkv" and args.page_size == 1
    with pytest.raises(SystemExit):  # the selection path serves on flashinfer and torch_native only
        parse_args(["--model-path", "m", "--device", "cuda", "--sparse-method", "pyramidkv",
                    "--attention-backend", "triton"])
