"""SkipKV against a plain-torch reference (no server): sentence segmentation, importance, token redundancy and the
sentence-similarity penalty written out per head in float64, selection with sink and recent kept."""

from __future__ import annotations

import pytest
import torch
from toy_reference import attend_retained

from sgl_sparse import SparseConfigError, create_method
from sgl_sparse.methods.eviction import skipkv
from sgl_sparse.methods.eviction.base import WINDOW
from sgl_sparse.reference import ToyAttentionStack, run_request

BOUNDARY = 255  # the toy vocabulary's "." in these tests


def _tokens(n: int, seed: int = 0, boundary_every: int = 0) -> list[int]:
    """Random ids below BOUNDARY; with ``boundary_every``, about one in that many is a boundary."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, BOUNDARY, (n,), generator=g)
    if boundary_every:
        ids[torch.rand(n, generator=g) < 1 / boundary_every] = BOUNDARY
    return ids.tolist()


def reference_sentences(tokens: list[int], prompt_len: int, upto: int, boundaries: set[int], max_tokens: int,
                        min_tokens: int, max_tracked: int) -> list[tuple[int, int]]:
    """The closed sentences of the decoded tokens ``tokens[prompt_len:upto]``, as spans: cut after every boundary
    id and wherever a piece reaches ``max_tokens``; pieces under ``min_tokens`` dropped; the newest ``max_tracked``."""
    spans, start = [], prompt_len
    for pos in range(prompt_len, upto):
        if tokens[pos] in boundaries or pos + 1 - start == max_tokens:
            spans.append((start, pos + 1))
            start = pos + 1
    spans = [(a, b) for a, b in spans if b - a >= min_tokens]
    return spans[max(0, len(spans) - max_tracked):] if max_tracked else []


def reference_layer_scores(keys: torch.Tensor, queries: torch.Tensor, positions: list[int],
                           spans: list[tuple[int, int]], cfg: dict) -> list[float]:
    """One layer's SkipKV score of every retained key (float64 loops; keys ``[n, Hkv, D]`` in retained order at
    ``positions``, queries ``[w, Hq, D]``): importance (R-KV's, per head) minus alpha x R-KV's redundancy among
    the last ``redundancy_window`` candidates, both averaged over heads, minus the sentence penalty."""
    n, hkv, d = keys.shape
    w, kernel, group = cfg["window_size"], cfg["kernel_size"], queries.shape[1] // hkv
    past, hi = n - w, n - cfg["recent_tokens"]
    lo = max(cfg["sink_tokens"], hi - cfg["redundancy_window"])
    score = [0.0] * n
    for h in range(hkv):
        k = keys[:, h].double()
        logits = torch.stack([queries[:, h * group + g].double() @ k[:past].T / d**0.5 for g in range(group)])
        probs = logits.max(dim=0).values.softmax(dim=-1).mean(dim=0)
        for i in range(past):
            score[i] += max(probs[max(0, i - kernel // 2):i + kernel // 2 + 1].tolist()) / hkv
        if hi > lo:
            sub = k[lo:hi]
            unit = sub / (sub.norm(dim=-1, keepdim=True) + 1e-8)
            sim = unit @ unit.T
            m = hi - lo
            for i in range(m):
                sim[i, i] = 0.0
                similar = [j for j in range(m) if sim[i, j] > 0.5]
                sim[i, max(similar) if similar else 0] = 0.0
            red = sim.mean(dim=0).softmax(dim=-1)
            for i in range(m):
                score[lo + i] -= cfg["alpha"] * float(red[i]) / hkv
    # Sentences: mean key over each one's retained tokens (heads concatenated), cosine to later sentences.
    live = [(a, b, [i for i, p in enumerate(positions) if a <= p < b]) for a, b in spans]
    live = [s for s in live if s[2]]
    means = [keys[idx].double().reshape(len(idx), -1).mean(dim=0) for _, _, idx in live]
    for s, (_, _, idx) in enumerate(live):
        cos = [float(means[s] @ means[t] / (means[s].norm() * means[t].norm())) for t in range(s + 1, len(live))]
        if cos and max(cos) >= cfg["sentence_threshold"]:
            for i in idx:
                score[i] -= cfg["sentence_weight"] * max(cos)
    return score


def reference_skipkv(model: ToyAttentionStack, tokens: list[int], prompt_len: int, chunk_size: int, cfg: dict,
                     boundaries: set[int], prune: list[tuple[int, int]] = ()) -> tuple[torch.Tensor, list[int],
                                                                                       list[int]]:
    """SkipKV on the toy stack: attention over the retained tokens, the last ``window_size`` queries of every
    layer cached; every ``evict_interval`` decoded tokens, once over ``budget``, every retained key scored
    (:func:`reference_layer_scores` summed over layers) and the first ``sink_tokens``, the last ``recent_tokens``
    and the best of the rest kept (ties to the earlier position). Returns (last-layer outputs, kept count after
    each step, final kept). ``prune``: ranges the request prunes from its own prompt, gone at the prompt's end."""
    h_all = model.embed[torch.tensor(tokens)]
    keys = [torch.zeros(len(tokens), model.n_kv_heads, model.head_dim) for _ in range(model.n_layers)]
    vals = [torch.zeros_like(keys[0]) for _ in range(model.n_layers)]
    w = cfg["window_size"]
    query_cache: list[torch.Tensor] = [torch.zeros(0, model.n_heads, model.head_dim)] * model.n_layers
    retained: list[int] = []
    outs, kept_after = [], []
    steps = [(s, min(s + chunk_size, prompt_len)) for s in range(0, prompt_len, chunk_size)]
    steps += [(i, i + 1) for i in range(prompt_len, len(tokens))]
    bounded = bool(boundaries)
    for start, end in steps:
        retained += list(range(start, end))
        h = h_all[start:end]
        for layer in range(model.n_layers):
            h = attend_retained(model, layer, h, start, end, retained, keys, vals, query_cache, w)
        outs.append(h)
        if end == prompt_len:
            retained = [j for j in retained if not any(lo <= j < hi for lo, hi in prune)]
        decoded = end - prompt_len
        if start >= prompt_len and decoded % cfg["evict_interval"] == 0 and len(retained) > cfg["budget"]:
            spans = reference_sentences(tokens, prompt_len, end, boundaries,
                                        cfg["sentence_max_tokens"] if bounded else cfg["segment_tokens"],
                                        cfg["sentence_min_tokens"] if bounded else 1, cfg["max_tracked_sentences"])
            score = [0.0] * len(retained)
            for layer in range(model.n_layers):
                s = reference_layer_scores(keys[layer][retained], query_cache[layer], retained, spans, cfg)
                score = [a + b for a, b in zip(score, s)]
            sink, recent = cfg["sink_tokens"], cfg["recent_tokens"]
            middle = range(sink, len(retained) - recent)
            best = sorted(middle, key=lambda i: (-score[i], i))[:cfg["budget"] - sink - recent]
            retained = retained[:sink] + [retained[i] for i in sorted(best)] + retained[len(retained) - recent:]
        kept_after.append(len(retained))
    return torch.cat(outs), kept_after, retained


def _config(**fields: object) -> dict:
    return {**create_method("skipkv").config.to_dict(), **fields}


@pytest.mark.parametrize("fields", [
    # Sentences of ~8 tokens, a low similarity threshold so that the penalty bites on random keys.
    {"sentence_threshold": 0.3, "sentence_min_tokens": 2},
    {"sentence_threshold": 0.5, "alpha": 1.0, "redundancy_window": 6, "sentence_weight": 0.2},
    {"sentence_threshold": 0.3, "sentence_max_tokens": 5, "max_tracked_sentences": 3},  # long ones cut, few kept
    {"sentence_threshold": -1.0, "kernel_size": 1},  # every sentence with a later one is penalized
    {"sentence_weight": 0.0, "alpha": 0.0},  # importance only
    {"sentence_threshold": 0.3, "boundary_token_ids": [], "segment_tokens": 6},  # no boundaries: fixed segments
])
def test_skipkv_equals_plain_reference(fields: dict) -> None:
    model, chunk, prompt_len = ToyAttentionStack(), 16, 40
    tokens = _tokens(100, seed=3, boundary_every=8)
    cfg = _config(**{"budget": 36, "sink_tokens": 4, "recent_tokens": 12, "window_size": 4, "evict_interval": 6,
                     "boundary_token_ids": [BOUNDARY], **fields})
    trace = run_request(create_method("skipkv", cfg), model, tokens, prompt_len=prompt_len, chunk_size=chunk)
    ref_out, ref_kept_after, ref_kept = reference_skipkv(model, tokens, prompt_len, chunk, cfg,
                                                         set(cfg["boundary_token_ids"]))
    assert trace.state.kept.tolist() == ref_kept
    assert trace.kept_after_step == ref_kept_after
    assert torch.allclose(trace.outputs, ref_out, atol=1e-4)
    n_prefill = len(range(0, prompt_len, chunk))
    assert ref_kept_after[n_prefill - 1] == prompt_len  # the prompt is not compressed at its end
    assert max(ref_kept_after) <= max(cfg["budget"], prompt_len) + cfg["evict_interval"] - 1
    assert ref_kept_after[-1] <= cfg["budget"] + (len(tokens) - prompt_len) % cfg["evict_interval"]
    assert ref_kept[:4] == [0, 1, 2, 3] and ref_kept[-12:] == list(range(88, 100))  # sink and recent kept


def test_skipkv_with_a_prune_equals_plain_reference() -> None:
    """A prune of the prompt leaves before the first compaction: sink, recent and budget count what is left (the
    sink is then the first positions after the pruned ones), and every compaction keeps what the reference keeps."""
    model, chunk, prompt_len, prune = ToyAttentionStack(), 16, 40, [(0, 2), (10, 20)]
    tokens = _tokens(100, seed=3, boundary_every=8)
    cfg = _config(**{"budget": 36, "sink_tokens": 4, "recent_tokens": 12, "window_size": 4, "evict_interval": 6,
                     "boundary_token_ids": [BOUNDARY], "sentence_threshold": 0.3, "sentence_min_tokens": 2})
    trace = run_request(create_method("skipkv", cfg), model, tokens, prompt_len=prompt_len, chunk_size=chunk,
                        prune=prune)
    ref_out, ref_kept_after, ref_kept = reference_skipkv(model, tokens, prompt_len, chunk, cfg, {BOUNDARY}, prune)
    assert trace.state.kept.tolist() == ref_kept
    assert trace.kept_after_step == ref_kept_after
    assert torch.allclose(trace.outputs, ref_out, atol=1e-4)
    assert ref_kept_after[2] == 28 and ref_kept[:4] == [2, 3, 4, 5]


def test_sentences_follow_the_reference_segmentation() -> None:
    tokens = _tokens(300, seed=1, boundary_every=9)
    for max_tokens, min_tokens, tracked in [(256, 4, 256), (7, 1, 256), (12, 3, 5)]:
        sentences = skipkv._Sentences()
        for pos in range(50, 300, 3):  # steps of three tokens: segmentation does not depend on the step size
            skipkv.track(sentences, pos, tokens[pos:pos + 3], frozenset({BOUNDARY}), max_tokens, min_tokens, tracked)
        assert sentences.spans == reference_sentences(tokens, 50, 300, {BOUNDARY}, max_tokens, min_tokens, tracked)


def test_budget_covering_the_sequence_reproduces_dense() -> None:
    model, tokens = ToyAttentionStack(), _tokens(90, boundary_every=6)
    dense = run_request(create_method("dense"), model, tokens, prompt_len=50, chunk_size=32)
    sparse = run_request(create_method("skipkv", {"budget": 90, "sink_tokens": 4, "recent_tokens": 8,
                                                  "evict_interval": 2, "boundary_token_ids": [BOUNDARY]}),
                         model, tokens, prompt_len=50, chunk_size=32)
    assert torch.equal(sparse.outputs, dense.outputs)
    assert sparse.kept_after_step == dense.kept_after_step


def _restated_sentence() -> tuple[list[int], dict[str, range]]:
    """A prompt, then decoded sentences U0, A, U1, U2, A again (the same ids: a restatement), U3; each ends in
    the boundary id."""
    g = torch.Generator().manual_seed(11)

    def sentence(n: int) -> list[int]:
        return [*torch.randint(20, 250, (n - 1,), generator=g).tolist(), BOUNDARY]

    prompt, a = torch.randint(20, 250, (8,), generator=g).tolist(), [10, 11, 12, 13, 14, BOUNDARY]
    parts = [("prompt", prompt), ("U0", sentence(6)), ("A1", a), ("U1", sentence(6)), ("U2", sentence(6)),
             ("A2", list(a)), ("U3", sentence(8))]
    tokens, spans = [], {}
    for name, ids in parts:
        spans[name] = range(len(tokens), len(tokens) + len(ids))
        tokens += ids
    return tokens, spans


def test_a_restated_sentence_leaves_whole_where_recency_drops_the_oldest() -> None:
    """One compaction that must drop six tokens. SkipKV drops the earlier copy of the restated sentence, all of
    it, and keeps the oldest unique sentence; a recency-only choice (StreamingLLM, same sink and recent) drops
    the oldest candidates instead; without the sentence term the score spreads the drop elsewhere."""
    tokens, spans = _restated_sentence()
    n, prompt_len = len(tokens), len(spans["prompt"])
    cfg = {"budget": n - 6, "sink_tokens": 4, "recent_tokens": 8, "window_size": 4, "evict_interval": n - prompt_len,
           "boundary_token_ids": [BOUNDARY]}
    model = ToyAttentionStack()
    method = create_method("skipkv", cfg)
    kept = run_request(method, model, tokens, prompt_len, 16).state.kept.tolist()
    dropped = sorted(set(range(n)) - set(kept))
    assert dropped == list(spans["A1"])
    assert method.stats() == {"sentences_closed_total": 6, "sentence_penalized_tokens_total": 6,
                              "sentence_evicted_tokens_total": 6}
    assert set(spans["U0"]) <= set(kept) and set(spans["A2"]) <= set(kept)

    recency = run_request(create_method("streamingllm", {"sink_tokens": 4, "recent_tokens": n - 10,
                                                         "evict_interval": 1}), model, tokens, prompt_len, 16)
    assert sorted(set(range(n)) - set(recency.state.kept.tolist())) == list(range(4, 10))  # the oldest

    plain = run_request(create_method("skipkv", {**cfg, "sentence_weight": 0.0}), model, tokens, prompt_len, 16)
    assert sorted(set(range(n)) - set(plain.state.kept.tolist())) != list(spans["A1"])


def test_sentence_penalty_marks_the_earlier_of_two_similar_sentences() -> None:
    keys = torch.randn(12, 2, 4, generator=torch.Generator().manual_seed(0))
    keys[8:12] = keys[0:4] * 2.0  # the same direction: cosine 1
    positions = torch.arange(100, 112)
    spans = [(100, 104), (104, 108), (108, 112)]
    penalty = skipkv.sentence_penalty(keys, positions, spans, 0.95)
    assert torch.allclose(penalty[:4], torch.ones(4)) and not penalty[4:].any()
    # Only the retained tokens of a sentence embed it: drop the later copy's tokens but one, and it differs.
    keep = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8])
    assert not skipkv.sentence_penalty(keys[keep], positions[keep], spans, 0.95).any()


def test_boundary_ids_from_vocabulary_text() -> None:
    pieces = ["the", ".", " end.", "?\n", "\n\n", "!", " ", "e.g", ". ", "a:", ""]
    assert skipkv.boundary_ids(pieces) == [1, 2, 3, 4, 5, 8]


def test_config_defaults_and_errors() -> None:
    m = create_method("skipkv")
    assert m.config.to_dict() == {
        "budget": 1024, "sink_tokens": 64, "recent_tokens": 512, "window_size": 8, "kernel_size": 7,
        "evict_interval": 128, "alpha": 0.1, "redundancy_window": 64, "sentence_weight": 1.0,
        "sentence_threshold": 0.95, "sentence_min_tokens": 4, "sentence_max_tokens": 256,
        "max_tracked_sentences": 256, "segment_tokens": 32, "boundary_token_ids": []}
    assert m.observation_window() == 8 and m.observes_decode() and m.needs_token_ids()
    assert create_method("skipkv", {"boundary_token_ids": [3, 5]}).config.fingerprint() != m.config.fingerprint()
    for cfg, message in [({"budget": 576}, "field 'budget' must be > sink_tokens"),
                         ({"recent_tokens": 4}, "field 'recent_tokens' must be >= window_size"),
                         ({"kernel_size": 4}, "field 'kernel_size' must be odd"),
                         ({"sentence_threshold": 1.5}, "field 'sentence_threshold' must be in"),
                         ({"sentence_max_tokens": 2}, "field 'sentence_max_tokens' must be >="),
                         ({"evict_interval": 0}, "field 'evict_interval' must be >= 1"),
                         ({"boundary_token_ids": [1, -2]}, "field 'boundary_token_ids' must be a list"),
                         ({"boundary_token_ids": "13"}, "field 'boundary_token_ids' must be a list")]:
        with pytest.raises(SparseConfigError, match=message):
            create_method("skipkv", cfg)


def test_ids_a_step_late_segment_the_same_sentences() -> None:
    """Under overlap scheduling a decoded token's id is known one step after its K/V was written: the method
    segments it then, and closes the same sentences."""
    from sgl_sparse.contract import StepInfo

    tokens = _tokens(120, seed=2, boundary_every=6)
    for lag in (0, 1):
        method = create_method("skipkv", {"boundary_token_ids": [BOUNDARY]})
        state = method.new_state("r")
        state.advance(20)  # the prompt
        for pos in range(20, 120):
            state.advance(1)
            known = pos + 1 - lag
            method.on_step_end(state, StepInfo(False, 1, pos - 19, token_ids=lambda a, b, k=known: tokens[a:min(b, k)]))
        expected = reference_sentences(tokens, 20, 120 - lag, {BOUNDARY}, 256, 4, 256)
        assert expected and state.extra[skipkv.SENTENCES].spans == expected, lag


def test_chain_cache_needs_no_payload() -> None:
    method = create_method("skipkv", {"budget": 30, "sink_tokens": 4, "recent_tokens": 8, "window_size": 4,
                                      "evict_interval": 4, "boundary_token_ids": [BOUNDARY]})
    trace = run_request(method, ToyAttentionStack(), _tokens(80, boundary_every=5), prompt_len=40, chunk_size=16)
    assert trace.state.num_kept <= 30 + 4
    assert method.on_finish(trace.state) is None
    assert WINDOW not in trace.state.extra  # no window left over between steps
