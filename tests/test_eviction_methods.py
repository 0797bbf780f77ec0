"""StreamingLLM and SnapKV against plain-torch references (no server)."""

from __future__ import annotations

import pytest
import torch
from toy_reference import attend_retained

from sgl_sparse import SparseConfigError, create_method
from sgl_sparse.contract import ObservationWindow, RequestState, StepInfo
from sgl_sparse.methods.eviction.base import topk_keep
from sgl_sparse.reference import ToyAttentionStack, run_request


def _tokens(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize(("name", "config"), [
    ("streamingllm", {"sink_tokens": 4, "recent_tokens": 200, "evict_interval": 8}),
    ("snapkv", {"budget": 200, "window_size": 8, "sink_tokens": 4}),
    ("snapkv", {"budget": 200, "window_size": 8, "sink_tokens": 4, "decode_interval": 3}),
])
def test_budget_covering_the_sequence_reproduces_dense(name: str, config: dict) -> None:
    model = ToyAttentionStack()
    tokens = _tokens(90)
    dense = run_request(create_method("dense"), model, tokens, prompt_len=70, chunk_size=32)
    sparse = run_request(create_method(name, config), model, tokens, prompt_len=70, chunk_size=32)
    assert torch.equal(sparse.outputs, dense.outputs)
    assert sparse.kept_after_step == dense.kept_after_step


def test_streamingllm_keeps_sinks_and_recent_with_interval() -> None:
    cfg = {"sink_tokens": 4, "recent_tokens": 16, "evict_interval": 8}
    trace = run_request(create_method("streamingllm", cfg), ToyAttentionStack(), _tokens(90), prompt_len=60,
                        chunk_size=25)
    # Chunks of 25, 25 (no eviction mid-prompt), 10 (final: compact to 20), then +1 per decode step
    # up to 28 = budget + interval, then back to 20.
    assert trace.kept_after_step[:3] == [25, 50, 20]
    assert max(trace.kept_after_step[3:]) == 28 and min(trace.kept_after_step[3:]) == 20
    kept = trace.state.kept.tolist()
    assert kept[:4] == [0, 1, 2, 3] and kept[4:] == list(range(90 - (len(kept) - 4), 90))


def reference_snapkv_keep(q_win: list[torch.Tensor], keys: list[torch.Tensor], budget: int, window: int,
                          sink: int, kernel: int, pooling: str) -> list[int]:
    """Plain loops: per layer, per KV head, per group query head: softmax over causal keys."""
    n = keys[0].shape[0]
    w = q_win[0].shape[0]
    total = torch.zeros(n, dtype=torch.float64)
    for q, k in zip(q_win, keys):
        n_heads, n_kv, d = q.shape[1], k.shape[1], q.shape[2]
        for kv in range(n_kv):
            head_score = torch.zeros(n, dtype=torch.float64)
            for h in range(kv * (n_heads // n_kv), (kv + 1) * (n_heads // n_kv)):
                for i in range(w):
                    qpos = n - w + i
                    logits = (k[: qpos + 1, kv].double() @ q[i, h].double()) / d**0.5
                    head_score[: qpos + 1] += logits.softmax(0)
            pad = kernel // 2
            pooled = torch.zeros(n, dtype=torch.float64)
            for j in range(n):
                seg = head_score[max(0, j - pad): j + pad + 1]
                pooled[j] = seg.mean() if pooling == "avgpool" else seg.max()
            total += pooled
    middle = list(range(sink, n - window))
    ranked = sorted(middle, key=lambda j: (-float(total[j]), j))[: budget - sink - window]
    return sorted(list(range(sink)) + ranked + list(range(n - window, n)))


@pytest.mark.parametrize("pooling", ["avgpool", "maxpool"])
def test_snapkv_selection_equals_plain_reference(pooling: str) -> None:
    g = torch.Generator().manual_seed(1)
    n, w, layers = 40, 6, 2
    q_win = [torch.randn(w, 4, 8, generator=g) for _ in range(layers)]
    keys = [torch.randn(n, 2, 8, generator=g) for _ in range(layers)]
    m = create_method("snapkv", {"budget": 20, "window_size": w, "sink_tokens": 3, "kernel_size": 5,
                                 "pooling": pooling})
    state = RequestState(rid="r", logical_len=n, num_kept=n)
    # The keys sit at scattered rows of a larger buffer, as retained slots do in a KV pool.
    rows = torch.randperm(3 * n, generator=g)[:n]
    buffers = [torch.zeros(3 * n, 2, 8).index_copy_(0, rows, k) for k in keys]
    window = ObservationWindow(queries=dict(enumerate(q_win)), q_pos=torch.arange(n - w, n),
                               key_buffer=lambda layer: buffers[layer], key_rows=rows, k_pos=torch.arange(n),
                               num_layers=layers, scale=8**-0.5)
    step = StepInfo(is_prefill=True, new_tokens=n, decoded_tokens=0, final_prefill=True)
    assert m.wants_observation(state, step)
    m.on_observation(state, window)
    plan = m.on_step_end(state, step)
    assert plan is not None
    assert plan.keep.tolist() == reference_snapkv_keep(q_win, keys, 20, w, 3, 5, pooling)


def test_snapkv_under_budget_in_reference_runtime() -> None:
    m = create_method("snapkv", {"budget": 24, "window_size": 4, "sink_tokens": 2})
    trace = run_request(m, ToyAttentionStack(), _tokens(70), prompt_len=60, chunk_size=16)
    assert trace.kept_after_step[3] == 24  # final prefill chunk compacted to the budget
    assert trace.kept_after_step[-1] == 24 + 10  # decode appends (no decode re-selection)
    kept = trace.state.kept.tolist()
    assert kept[:2] == [0, 1] and kept[-14:] == list(range(56, 70))


def test_snapkv_decode_interval_reselects() -> None:
    m = create_method("snapkv", {"budget": 24, "window_size": 4, "sink_tokens": 2, "decode_interval": 5})
    trace = run_request(m, ToyAttentionStack(), _tokens(72), prompt_len=60, chunk_size=16)
    decode_kept = trace.kept_after_step[4:]
    assert decode_kept[4] == 24 and decode_kept[9] == 24 and max(decode_kept) <= 28


def reference_snapkv(model: ToyAttentionStack, tokens: list[int], prompt_len: int, chunk_size: int, budget: int,
                     window: int, sink: int, kernel: int, pooling: str, interval: int,
                     prune: list[tuple[int, int]]) -> tuple[torch.Tensor, list[int], list[int]]:
    """SnapKV with a request's own prune, written out on the toy stack: attention over the retained tokens (float64
    loops per query head), the last ``window`` queries of every layer cached; at the prompt's end the ``prune``
    ranges leave first, then (and every ``interval`` decoded tokens), once more than ``budget`` are retained, each
    retained key scores the softmax probability the cached queries give it among the retained keys (causal), summed
    over each KV head's group and the queries, pooled along the retained order per KV head, summed over heads and
    layers; the first ``sink``, the last ``window`` and the best of the rest are kept (ties to the earlier).
    Returns (last-layer outputs, kept count after each step, final kept positions)."""
    h_all = model.embed[torch.tensor(tokens)]
    hq, hkv, d = model.n_heads, model.n_kv_heads, model.head_dim
    group = hq // hkv
    keys = [torch.zeros(len(tokens), hkv, d) for _ in range(model.n_layers)]
    vals = [torch.zeros_like(keys[0]) for _ in range(model.n_layers)]
    query_cache: list[torch.Tensor] = [torch.zeros(0, hq, d)] * model.n_layers
    retained: list[int] = []
    outs, kept_after = [], []
    steps = [(s, min(s + chunk_size, prompt_len)) for s in range(0, prompt_len, chunk_size)]
    steps += [(i, i + 1) for i in range(prompt_len, len(tokens))]
    for start, end in steps:
        retained += list(range(start, end))
        h = h_all[start:end]
        for layer in range(model.n_layers):
            h = attend_retained(model, layer, h, start, end, retained, keys, vals, query_cache, window, double=True)
        outs.append(h)
        if end == prompt_len:
            retained = [j for j in retained if not any(lo <= j < hi for lo, hi in prune)]
        due = end == prompt_len or (start >= prompt_len and interval > 0 and (end - prompt_len) % interval == 0)
        if due and len(retained) > budget:
            n = len(retained)
            total = [0.0] * n
            for layer in range(model.n_layers):
                for kv in range(hkv):
                    per_key = [0.0] * n
                    for i, p in enumerate(range(end - window, end)):
                        visible = [c for c in range(n) if retained[c] <= p]
                        for head in range(kv * group, (kv + 1) * group):
                            logits = torch.stack([keys[layer][retained[c], kv].double()
                                                  @ query_cache[layer][i, head].double() for c in visible]) / d**0.5
                            for c, pr in zip(visible, logits.softmax(0).tolist()):
                                per_key[c] += pr
                    for c in range(n):
                        seg = per_key[max(0, c - kernel // 2):c + kernel // 2 + 1]
                        total[c] += sum(seg) / len(seg) if pooling == "avgpool" else max(seg)
            best = sorted(range(sink, n - window), key=lambda c: (-total[c], c))[:budget - sink - window]
            retained = [retained[c] for c in sorted([*range(sink), *best, *range(n - window, n)])]
        kept_after.append(len(retained))
    return torch.cat(outs), kept_after, retained


@pytest.mark.parametrize(("budget", "pooling", "interval", "prune"), [
    (24, "avgpool", 5, [(10, 30)]),  # compacted to 24 of the 40 left, then every 5 decoded tokens
    (20, "maxpool", 4, [(0, 3), (40, 44), (57, 60)]),  # sink and window of what is left, not of the prompt
    (40, "avgpool", 6, [(10, 30)]),  # the 40 left fit the budget: nothing more at the prompt's end
])
def test_snapkv_with_a_prune_equals_plain_reference(budget: int, pooling: str, interval: int,
                                                    prune: list[tuple[int, int]]) -> None:
    """A request that prunes its own prompt: the ranges leave before SnapKV scores (its window attends only what is
    left), the budget counts what is left, and every later re-selection picks what the reference picks."""
    model, tokens, prompt_len, chunk = ToyAttentionStack(), _tokens(72, seed=3), 60, 16
    cfg = {"budget": budget, "window_size": 4, "sink_tokens": 2, "kernel_size": 5, "pooling": pooling,
           "decode_interval": interval}
    trace = run_request(create_method("snapkv", cfg), model, tokens, prompt_len=prompt_len, chunk_size=chunk,
                        prune=prune)
    ref_out, ref_kept_after, ref_kept = reference_snapkv(model, tokens, prompt_len, chunk, budget, 4, 2, 5, pooling,
                                                         interval, prune)
    assert trace.state.kept.tolist() == ref_kept
    assert trace.kept_after_step == ref_kept_after
    torch.testing.assert_close(trace.outputs, ref_out, rtol=1e-4, atol=1e-4)
    left = prompt_len - sum(hi - lo for lo, hi in prune)
    assert ref_kept_after[3] == min(budget, left)  # the budget counts the tokens left after the prune
    assert not any(lo <= p < hi for p in ref_kept for lo, hi in prune)


def test_streamingllm_with_a_prune_keeps_sinks_and_recent_of_what_is_left() -> None:
    cfg = {"sink_tokens": 4, "recent_tokens": 16, "evict_interval": 8}
    trace = run_request(create_method("streamingllm", cfg), ToyAttentionStack(), _tokens(62), prompt_len=60,
                        chunk_size=25, prune=[(50, 60)])
    assert trace.kept_after_step == [25, 50, 20, 21, 22]
    assert trace.state.kept.tolist() == [0, 1, 2, 3, *range(34, 50), 60, 61]


def test_topk_keep_ties_prefer_earlier_positions() -> None:
    kept = torch.arange(10, 20)
    keep = topk_keep(kept, torch.zeros(10), budget=5, sink=1, window=1)
    assert keep.tolist() == [10, 11, 12, 13, 19]


@pytest.mark.parametrize(("name", "config", "message"), [
    ("snapkv", {"budget": -5}, "field 'budget' must be >= 1"),
    ("snapkv", {"budget": 16, "window_size": 32}, "field 'window_size' must be <= budget"),
    ("snapkv", {"pooling": "median"}, "field 'pooling' must be one of"),
    ("snapkv", {"kernel_size": 4}, "field 'kernel_size' must be odd"),
    ("snapkv", {"budget": 40, "sink_tokens": 20, "window_size": 32}, "field 'sink_tokens' \\+ window_size"),
    ("streamingllm", {"recent_tokens": 0}, "field 'recent_tokens' must be >= 1"),
    ("streamingllm", {"evict_interval": 0}, "field 'evict_interval' must be >= 1"),
])
def test_bad_configs(name: str, config: dict, message: str) -> None:
    with pytest.raises(SparseConfigError, match=message):
        create_method(name, config)
