"""KVzip against a plain-torch reference (no server): the reconstruction replays, their scores and the kept set
written out per KV head, query head and query in float64 loops, after KVzip's ``self_task`` and ``_get_score``
(snu-mllab/KVzip, model/wrapper.py and attention/score.py), token-shared by a max over heads and layers."""

from __future__ import annotations

import pytest
import torch

from sgl_sparse import SparseConfigError, create_method
from sgl_sparse.contract import PrefillChunk, StepInfo
from sgl_sparse.methods.eviction import kvzip
from sgl_sparse.reference import ToyAttentionStack, attend, run_request

PROMPT, NEXT, POSTFIX = [201, 202, 203], [211, 212], [221]
IDS = {"prompt_ids": PROMPT, "next_prompt_ids": NEXT, "postfix_ids": POSTFIX}


def _tokens(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def dense_chunk_scores(q: torch.Tensor, k_sink: torch.Tensor, k_chunk: torch.Tensor, k_rep: torch.Tensor,
                       scale: float) -> list[float]:
    """Per KV head h, query head g of its group and replay query i: the softmax of ``q[i, g]`` over the sink keys,
    the chunk keys and replay keys ``0..i``; each chunk key's score is its largest probability over (h, g, i)."""
    r, n_heads, _ = q.shape
    n_kv = k_chunk.shape[1]
    group = n_heads // n_kv
    s, c = k_sink.shape[0], k_chunk.shape[0]
    best = [0.0] * c
    for h in range(n_kv):
        for g in range(group):
            for i in range(r):
                keys = torch.cat([k_sink[:, h], k_chunk[:, h], k_rep[:i + 1, h]]).double()
                probs = (keys @ q[i, h * group + g].double() * scale).softmax(0)
                for j in range(c):
                    best[j] = max(best[j], float(probs[s + j]))
    return best


def _dense_prefill(model: ToyAttentionStack, tokens: list[int],
                   prompt_len: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """The prompt prefilled densely: every layer's K and V, and the last layer's outputs."""
    keys, vals = [], []
    h = model.embed[torch.tensor(tokens[:prompt_len])]
    pos = torch.arange(prompt_len)
    for layer in range(model.n_layers):
        q, k, v = model.project(layer, h)
        keys.append(k)
        vals.append(v)
        h = attend(q, k, v, pos, pos).reshape(prompt_len, -1)
    return keys, vals, [h]


def _decode_over(model: ToyAttentionStack, tokens: list[int], prompt_len: int, kept: list[int],
                 keys: list[torch.Tensor], vals: list[torch.Tensor],
                 outs: list[torch.Tensor]) -> tuple[list[int], torch.Tensor]:
    """Teacher-forced decode of ``tokens[prompt_len:]`` over the ``kept`` prompt positions plus every decoded
    token; -> (the prompt's kept positions, every output)."""
    kept = list(kept)
    for t in range(prompt_len, len(tokens)):
        kept.append(t)
        kv_pos = torch.tensor(kept)
        h = model.embed[torch.tensor([tokens[t]])]
        for layer in range(model.n_layers):
            q, k, v = model.project(layer, h)
            keys[layer] = torch.cat([keys[layer], k])
            vals[layer] = torch.cat([vals[layer], v])
            h = attend(q, keys[layer][kv_pos], vals[layer][kv_pos], torch.tensor([t]), kv_pos).reshape(1, -1)
        outs.append(h)
    return kept[:len(kept) - (len(tokens) - prompt_len)], torch.cat(outs)


def reference_kvzip(model: ToyAttentionStack, tokens: list[int], prompt_len: int, cfg: dict,
                    prune: list[tuple[int, int]] = ()) -> tuple[list[int], torch.Tensor]:
    """The kept set after the prompt and every token's last-layer output (teacher forcing): the prompt prefilled
    densely, replays built as KVzip's self_task (chunks after the sink), scored per layer with
    :func:`dense_chunk_scores`, maximised over layers, the sink + recent + best (ties: earlier) kept. ``prune``:
    ranges the request prunes from its own prompt, gone before the replays: the replays attend the keys left, the
    sink is the first of them, a chunk with none left is not replayed, and only the keys left are scored."""
    n_layers, d = model.n_layers, model.head_dim
    scale = d**-0.5
    budget, sink, recent = cfg["budget"], cfg.get("sink_tokens", 4), cfg.get("recent_tokens", 0)
    chunk, prev = cfg.get("chunk_size", 2048), cfg.get("prev_postfix_size", 8)
    keys, vals, outs = _dense_prefill(model, tokens, prompt_len)
    kept = [p for p in range(prompt_len) if not any(lo <= p < hi for lo, hi in prune)]
    if len(kept) > budget:
        left = torch.tensor(kept)
        scores = [0.0] * prompt_len
        start = kept[sink] if len(kept) > sink else prompt_len
        for a in range(start, prompt_len, chunk):
            b = min(a + chunk, prompt_len)
            in_chunk = [p for p in kept if a <= p < b]
            if not in_chunk:
                continue
            head = PROMPT if a == start else NEXT + tokens[max(start, a - prev):a]
            replay = head + POSTFIX + tokens[a:b]
            r = len(replay)
            hr = model.embed[torch.tensor(replay)]
            q_pos = torch.arange(prompt_len, prompt_len + r)
            for layer in range(n_layers):
                q, k, v = model.project(layer, hr)
                layer_scores = dense_chunk_scores(q, keys[layer][kept[:sink]], keys[layer][in_chunk], k, scale)
                for p, sc in zip(in_chunk, layer_scores):
                    scores[p] = max(scores[p], sc)
                kv_pos = torch.cat([left, q_pos])
                hr = attend(q, torch.cat([keys[layer][left], k]), torch.cat([vals[layer][left], v]), q_pos,
                            kv_pos).reshape(r, -1)
        n = len(kept)
        best = sorted(kept[sink:n - recent], key=lambda p: (-scores[p], p))[:budget - sink - recent]
        kept = sorted([*kept[:sink], *best, *kept[n - recent:]])
    return _decode_over(model, tokens, prompt_len, kept, keys, vals, outs)


@pytest.mark.parametrize("block", [1, 3, 256])
def test_chunk_scores_equal_the_dense_loop(block: int) -> None:
    g = torch.Generator().manual_seed(1)
    q, k_sink = torch.randn(7, 4, 8, generator=g), torch.randn(2, 2, 8, generator=g)
    k_chunk, k_rep = torch.randn(5, 2, 8, generator=g), torch.randn(7, 2, 8, generator=g)
    got = kvzip.chunk_scores(q, k_sink, k_chunk, k_rep, 0.35, block=block)
    assert torch.allclose(got, torch.tensor(dense_chunk_scores(q, k_sink, k_chunk, k_rep, 0.35),
                                            dtype=torch.float32), atol=1e-6)
    # No sink: the softmax spans the chunk and the replay only.
    got = kvzip.chunk_scores(q, k_sink[:0], k_chunk, k_rep, 0.35, block=block)
    assert torch.allclose(got, torch.tensor(dense_chunk_scores(q, k_sink[:0], k_chunk, k_rep, 0.35),
                                            dtype=torch.float32), atol=1e-6)


@pytest.mark.parametrize(("budget", "chunk", "sink", "recent", "prev", "prefill_chunk"), [
    (24, 2048, 4, 0, 8, 16),  # the defaults but budget: one replay
    (24, 17, 4, 0, 8, 16),  # several replays, the previous chunk's tail in each later prompt
    (30, 20, 0, 6, 3, 64),  # no sink, a recent window, one prefill chunk
    (20, 16, 2, 2, 0, 7),
])
def test_kvzip_equals_plain_reference(budget: int, chunk: int, sink: int, recent: int, prev: int,
                                      prefill_chunk: int) -> None:
    model, tokens, prompt_len = ToyAttentionStack(), _tokens(70, seed=3), 60
    cfg = {"budget": budget, "chunk_size": chunk, "sink_tokens": sink, "recent_tokens": recent,
           "prev_postfix_size": prev, **IDS}
    method = create_method("kvzip", cfg)
    trace = run_request(method, model, tokens, prompt_len=prompt_len, chunk_size=prefill_chunk)
    ref_kept, ref_out = reference_kvzip(model, tokens, prompt_len, cfg)
    n_prefill = len(range(0, prompt_len, prefill_chunk))
    assert trace.kept_after_step[n_prefill - 1] == budget
    assert trace.state.kept.tolist() == ref_kept + list(range(prompt_len, len(tokens)))
    assert torch.allclose(trace.outputs, ref_out, atol=1e-4)
    stats = method.stats()
    assert stats["scored_requests"] == 1 and stats["replay_forwards"] == len(range(sink, prompt_len, chunk))


@pytest.mark.parametrize(("budget", "chunk", "prune", "replays"), [
    (24, 16, [(2, 6), (20, 40)], 3),  # sink 0, 1, 6, 7; chunks from 8: [24, 40) has nothing left, not replayed
    (20, 2048, [(30, 50)], 1),  # one replay, its text whole, scoring only the keys left
])
def test_kvzip_with_a_prune_equals_plain_reference(budget: int, chunk: int, prune: list[tuple[int, int]],
                                                   replays: int) -> None:
    model, tokens, prompt_len = ToyAttentionStack(), _tokens(70, seed=3), 60
    cfg = {"budget": budget, "chunk_size": chunk, "sink_tokens": 4, "recent_tokens": 2, "prev_postfix_size": 3,
           **IDS}
    method = create_method("kvzip", cfg)
    trace = run_request(method, model, tokens, prompt_len=prompt_len, chunk_size=16, prune=prune)
    ref_kept, ref_out = reference_kvzip(model, tokens, prompt_len, cfg, prune)
    assert trace.kept_after_step[3] == budget  # the budget counts the tokens left after the prune
    assert trace.state.kept.tolist() == ref_kept + list(range(prompt_len, len(tokens)))
    assert torch.allclose(trace.outputs, ref_out, atol=1e-4)
    assert not any(lo <= p < hi for p in ref_kept for lo, hi in prune)
    assert method.stats()["replay_forwards"] == replays


def test_ratio_keeps_a_share_of_the_prompt() -> None:
    model, tokens = ToyAttentionStack(), _tokens(64, seed=5)
    trace = run_request(create_method("kvzip", {"ratio": 0.3, "chunk_size": 20, **IDS}), model, tokens,
                        prompt_len=60, chunk_size=32)
    assert trace.kept_after_step[1] == 18  # ceil(0.3 * 60)
    ref_kept, ref_out = reference_kvzip(model, tokens, 60, {"budget": 18, "chunk_size": 20})
    assert trace.state.kept.tolist()[:18] == ref_kept
    assert torch.allclose(trace.outputs, ref_out, atol=1e-4)


def test_budget_covering_the_context_reproduces_dense() -> None:
    model, tokens = ToyAttentionStack(), _tokens(90)
    dense = run_request(create_method("dense"), model, tokens, prompt_len=70, chunk_size=32)
    method = create_method("kvzip", {"budget": 70, "chunk_size": 16, **IDS})
    sparse = run_request(method, model, tokens, prompt_len=70, chunk_size=32)
    assert torch.equal(sparse.outputs, dense.outputs)
    assert sparse.kept_after_step == dense.kept_after_step
    assert method.stats()["replay_forwards"] == 0  # nothing to compress, nothing replayed


def test_replays_follow_self_task_and_fit_the_room() -> None:
    cfg = create_method("kvzip", {"chunk_size": 16, "prev_postfix_size": 2, "sink_tokens": 4, **IDS}).config
    ids = list(range(100, 150))
    kept = torch.arange(50)
    reps = kvzip.build_replays(ids, kept, 50, cfg, max_tokens=1 << 30)
    assert [r.scored for r in reps] == [(4, 20), (20, 36), (36, 50)]
    assert reps[0].token_ids == PROMPT + POSTFIX + ids[4:20]
    assert reps[1].token_ids == NEXT + ids[18:20] + POSTFIX + ids[20:36]
    # Room for 25 replay tokens: a 32-token chunk shrinks to 25 - overhead (max(3, 2 + 2) + 1 = 5) = 20.
    wide = create_method("kvzip", {"chunk_size": 32, "prev_postfix_size": 2, **IDS}).config
    reps = kvzip.build_replays(ids, kept, 50, wide, max_tokens=25)
    assert [r.scored for r in reps] == [(4, 24), (24, 44), (44, 50)]
    assert all(len(r.token_ids) <= 25 for r in reps)
    assert kvzip.build_replays(ids, kept, 50, cfg, max_tokens=cfg.overhead + kvzip.MIN_CHUNK - 1) == []
    # A Chain Cache prefix with holes: a chunk with no retained position is not replayed.
    # Chunks start at the first retained position after the sink.
    holes = torch.cat([torch.arange(4), torch.tensor([5]), torch.arange(40, 50)])
    reps = kvzip.build_replays(ids, holes, 50, cfg, max_tokens=1 << 30)
    assert [r.scored for r in reps] == [(5, 21), (37, 50)]
    assert reps[1].token_ids == NEXT + ids[35:37] + POSTFIX + ids[37:50]


def test_no_room_leaves_the_prompt_whole(caplog: pytest.LogCaptureFixture) -> None:
    method = create_method("kvzip", {"budget": 8, "chunk_size": 16, **IDS})
    st = method.new_state("r")
    st.advance(40)
    step = StepInfo(True, 40, 0, final_prefill=True, token_ids=lambda a, b: list(range(a, b)))
    method.on_prefill_chunk(st, PrefillChunk(0, 40, 40))
    assert method.replays(st, step, max_tokens=10) == []
    assert method.on_step_end(st, step) is None
    assert method.stats()["unscored_requests"] == 1
    # said in the log, so an uncompressed answer does not pass for KVzip's
    assert "kvzip: a 40-token prompt left no room for a replay (10 tokens" in caplog.text


def test_config_defaults_and_errors() -> None:
    cfg = create_method("kvzip").config
    assert (cfg.budget, cfg.ratio, cfg.chunk_size, cfg.prev_postfix_size, cfg.sink_tokens, cfg.recent_tokens) == (
        4096, 0.0, 2048, 8, 4, 0)
    for bad in ({"budget": 0}, {"ratio": 1.5}, {"chunk_size": 4}, {"sink_tokens": 10, "budget": 8},
                {"prompt_ids": [-1]}, {"postfix_ids": "x"}, {"prev_postfix_size": -1}):
        with pytest.raises(SparseConfigError):
            create_method("kvzip", bad)


@pytest.mark.parametrize("flags", [
    ["--device", "cuda"],  # served on CUDA: tests/gpu/test_gpu_kvzip.py
    ["--device", "cpu", "--tp-size", "2"],  # the scores' maximum over the ranks (tests/test_tp_e2e.py)
    ["--device", "cpu", "--dp-size", "2"],
])
def test_launcher_serves_kvzip_on_cuda_and_under_tp_and_dp(flags: list[str]) -> None:
    from sgl_sparse.integration.launch import parse_args

    _, hand = parse_args(["--model-path", "m", "--sparse-method", "kvzip", *flags])
    assert hand.method == "kvzip"


def test_compositions_and_per_request_choice_are_refused() -> None:
    from sgl_sparse.request_methods import EVICTION, MethodResolver, RequestMethodError

    with pytest.raises(SparseConfigError, match="replay forwards"):
        create_method("kvzip+fp8_kv")
    resolver = MethodResolver(create_method("snapkv"), EVICTION)
    with pytest.raises(RequestMethodError, match="per request"):
        resolver.resolve({"sgl_sparse_method": "kvzip"})
    own = MethodResolver(create_method("kvzip"), EVICTION)  # the server's own config is served
    assert own.resolve({"sgl_sparse_method": "kvzip"}).method is own.default.method


# -- Prefix-Cache Pruning's kvzip_global: a request's own prune keeps the positions its ranges' reconstruction scores

def reference_kvzip_prune(model: ToyAttentionStack, tokens: list[int], prompt_len: int,
                          ranges: list[tuple[int, int]], keep: int, cfg: dict) -> tuple[list[int], torch.Tensor]:
    """Plain loops: the prompt prefilled densely; each range cut into ``chunk_size`` chunks, each replayed as
    KVzip's instruction (the first one at position 0, else the next-part one with the ``prev_postfix_size`` tokens
    before the chunk) + postfix + the chunk, after the whole prompt; a chunk key's score is
    :func:`dense_chunk_scores` over the sink (the first ``sink_tokens`` positions before the chunk), the chunk and
    the replay, maximised over layers; the ``keep`` best of the ranges' positions stay (ties: earlier), the rest
    leave; then the decode over what stays. Returns the prompt's retained positions and every output."""
    n_layers, scale = model.n_layers, model.head_dim**-0.5
    sink, chunk, prev = cfg.get("sink_tokens", 4), cfg.get("chunk_size", 2048), cfg.get("prev_postfix_size", 8)
    keys, vals, outs = _dense_prefill(model, tokens, prompt_len)
    pos = torch.arange(prompt_len)
    scores = [0.0] * prompt_len
    for lo, hi in ranges:
        for a in range(lo, hi, chunk):
            b = min(a + chunk, hi)
            head = PROMPT if a == 0 else NEXT + tokens[max(0, a - prev):a]
            replay = head + POSTFIX + tokens[a:b]
            r = len(replay)
            hr = model.embed[torch.tensor(replay)]
            q_pos = torch.arange(prompt_len, prompt_len + r)
            for layer in range(n_layers):
                q, k, v = model.project(layer, hr)
                sinks = list(range(min(sink, a)))
                for p, sc in zip(range(a, b), dense_chunk_scores(q, keys[layer][sinks], keys[layer][a:b], k, scale)):
                    scores[p] = max(scores[p], sc)
                hr = attend(q, torch.cat([keys[layer], k]), torch.cat([vals[layer], v]), q_pos,
                            torch.cat([pos, q_pos])).reshape(r, -1)
    candidates = [p for lo, hi in ranges for p in range(lo, hi)]
    best = set(sorted(candidates, key=lambda p: (-scores[p], p))[:keep])
    kept = [p for p in range(prompt_len) if p in best or p not in set(candidates)]
    return _decode_over(model, tokens, prompt_len, kept, keys, vals, outs)


@pytest.mark.parametrize(("ranges", "keep", "cfg"), [
    ([(5, 20), (30, 41)], 7, {}),  # one replay per range, one budget over both
    ([(5, 20), (30, 41)], 7, {"chunk_size": 16, "prev_postfix_size": 3, "sink_tokens": 2}),  # chunks across a range
    ([(0, 12), (44, 58)], 9, {"chunk_size": 16}),  # a range at position 0: KVzip's first instruction, no sink
])
def test_a_request_kvzip_global_keep_equals_plain_loops(ranges: list[tuple[int, int]], keep: int, cfg: dict) -> None:
    from sgl_sparse.prune.spec import PruneSpec

    model, tokens, prompt_len = ToyAttentionStack(), _tokens(66, seed=7), 60
    config = kvzip.KVzipConfig(**IDS, **cfg)
    trace = run_request(create_method("dense"), model, tokens, prompt_len=prompt_len, chunk_size=16,
                        prune=PruneSpec(tuple(ranges), keep, "kvzip_global"), prune_replays=config)
    ref_kept, ref_out = reference_kvzip_prune(model, tokens, prompt_len, ranges, keep, cfg)
    assert trace.state.kept.tolist() == ref_kept + list(range(prompt_len, len(tokens)))
    kept_in_ranges = [p for p in ref_kept if any(lo <= p < hi for lo, hi in ranges)]
    candidates = [p for lo, hi in ranges for p in range(lo, hi)]
    assert len(kept_in_ranges) == keep and kept_in_ranges not in (candidates[:keep], candidates[-keep:])
    assert torch.allclose(trace.outputs, ref_out, atol=1e-4)


def test_range_replays_cut_each_range_and_fit_the_room() -> None:
    cfg = kvzip.KVzipConfig(chunk_size=16, prev_postfix_size=2, **IDS)
    ids = list(range(100, 160))
    reps = kvzip.range_replays(ids, torch.arange(60), [(0, 10), (20, 50)], cfg, max_tokens=1 << 30)
    assert [r.scored for r in reps] == [(0, 10), (20, 36), (36, 50)]
    assert reps[0].token_ids == PROMPT + POSTFIX + ids[0:10]
    assert reps[1].token_ids == NEXT + ids[18:20] + POSTFIX + ids[20:36]
    # A chunk whose positions are all gone (an earlier eviction) is not replayed; the room bounds every replay.
    holes = torch.cat([torch.arange(20), torch.arange(40, 60)])
    assert [r.scored for r in kvzip.range_replays(ids, holes, [(20, 50)], cfg, 1 << 30)] == [(36, 50)]
    assert all(len(r.token_ids) <= 21 for r in kvzip.range_replays(ids, torch.arange(60), [(20, 50)], cfg, 21))
    assert kvzip.range_replays(ids, torch.arange(60), [(20, 50)], cfg, cfg.overhead + kvzip.MIN_CHUNK - 1) == []


def test_a_kvzip_global_keep_without_room_prunes_nothing_and_says_so() -> None:
    from sgl_sparse.prune.keep import PruneUnscored, ReplayInputs, request_prune_leaves
    from sgl_sparse.prune.spec import PruneSpec

    def never(*_: object) -> None:
        raise AssertionError("no replay fits: none may run")

    spec = PruneSpec(((5, 40),), 8, "kvzip_global")
    inputs = ReplayInputs(list(range(60)), kvzip.KVzipConfig(**IDS), 10, never)
    with pytest.raises(PruneUnscored, match="no room for a replay"):
        request_prune_leaves(torch.arange(60), spec, lambda: None, inputs)
    with pytest.raises(PruneUnscored, match="runs no replay"):
        request_prune_leaves(torch.arange(60), spec, lambda: None, None)
    # Nothing to choose (keep covers what is left): no replay is needed, none leaves.
    assert not request_prune_leaves(torch.arange(8), spec, lambda: None, inputs).any()


def test_replays_refuse_requests_with_multimodal_inputs() -> None:
    """A replay runs text tokens after the context; with images or video their M-RoPE positions would need the
    request's multimodal inputs, which a replay batch does not carry: such a request is refused at admission (for
    KVzip, or a kvzip_global prune of its own), a text request on the same server is not."""
    from types import SimpleNamespace

    from sgl_sparse.integration.runtime import multimodal_replay_problem
    from sgl_sparse.prune.spec import PruneSpec

    image, text = SimpleNamespace(multimodal_inputs=object()), SimpleNamespace(multimodal_inputs=None)
    kvzip, snapkv = create_method("kvzip"), create_method("snapkv")
    replayed = PruneSpec(((0, 8),), keep_tokens=2, policy="kvzip_global")
    assert "replay forwards" in (multimodal_replay_problem(image, kvzip, None) or "")
    assert "kvzip_global" in (multimodal_replay_problem(image, snapkv, replayed) or "")
    assert multimodal_replay_problem(image, snapkv, PruneSpec(((0, 8),), keep_tokens=2, policy="knorm")) is None
    assert multimodal_replay_problem(text, kvzip, replayed) is None
