"""R-KV against a plain-torch reference (no server): importance x redundancy written out per head in float64."""

from __future__ import annotations

import pytest
import torch
from toy_reference import attend_retained

from sgl_sparse import SparseConfigError, create_method
from sgl_sparse.methods.eviction import rkv
from sgl_sparse.methods.eviction.base import WINDOW
from sgl_sparse.reference import ToyAttentionStack, run_request


def _tokens(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_scores(keys: torch.Tensor, queries: torch.Tensor, window: int, kernel: int, lam: float,
                     threshold: float) -> list[float]:
    """One layer's R-KV score of each retained key but the last ``window``, written after
    ``rkv/compression/r1_kv.py`` and ``rkv/utils.py`` of Zefan-Cai/R-KV, per KV head in float64 loops, then
    averaged over the KV heads. ``keys`` ``[n, Hkv, D]`` (retained order), ``queries`` ``[w, Hq, D]``."""
    n, hkv, d = keys.shape
    group = queries.shape[1] // hkv
    past = n - window
    per_head = []
    for h in range(hkv):
        k = keys[:, h].double()
        # Importance: each query head's logits over the past keys, max over the group, softmax, mean over queries.
        logits = torch.stack([queries[:, h * group + g].double() @ k[:past].T / d**0.5 for g in range(group)])
        probs = logits.max(dim=0).values.softmax(dim=-1).mean(dim=0)
        pooled = [max(probs[max(0, i - kernel // 2):i + kernel // 2 + 1].tolist()) for i in range(past)]
        # Redundancy: cosines, diagonal zeroed, each row's most recent near-duplicate (else column 0) zeroed.
        unit = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
        sim = unit @ unit.T
        for i in range(n):
            sim[i, i] = 0.0
            similar = [j for j in range(n) if sim[i, j] > threshold]
            sim[i, max(similar) if similar else 0] = 0.0
        red = sim.mean(dim=0).softmax(dim=-1)
        per_head.append([lam * pooled[i] - (1 - lam) * float(red[i]) for i in range(past)])
    return [sum(col) / hkv for col in zip(*per_head)]


def reference_rkv(model: ToyAttentionStack, tokens: list[int], prompt_len: int, chunk_size: int, budget: int,
                  window: int, kernel: int, lam: float, threshold: float, interval: int,
                  prune: list[tuple[int, int]] = ()) -> tuple[torch.Tensor, list[int], list[int]]:
    """R-KV written out on the toy stack: attention over the retained tokens; the last ``window`` queries of
    every layer cached across steps (the original's ``query_cache``); at the prompt's end and every
    ``interval`` decoded tokens, once over ``budget``, every retained key but the last ``window`` scored
    (:func:`reference_scores` summed over layers) and the top ``budget - window`` kept (ties to the earlier
    position) with the last ``window``. Returns (last-layer outputs, kept count after each step, final kept).
    ``prune``: ranges the request prunes from its own prompt, gone at the prompt's end before its compaction."""
    h_all = model.embed[torch.tensor(tokens)]
    keys = [torch.zeros(len(tokens), model.n_kv_heads, model.head_dim) for _ in range(model.n_layers)]
    vals = [torch.zeros_like(keys[0]) for _ in range(model.n_layers)]
    query_cache: list[torch.Tensor] = [torch.zeros(0, model.n_heads, model.head_dim)] * model.n_layers
    retained: list[int] = []
    outs, kept_after = [], []
    steps = [(s, min(s + chunk_size, prompt_len)) for s in range(0, prompt_len, chunk_size)]
    steps += [(i, i + 1) for i in range(prompt_len, len(tokens))]
    for start, end in steps:
        decode = start >= prompt_len
        retained += list(range(start, end))
        h = h_all[start:end]
        for layer in range(model.n_layers):
            h = attend_retained(model, layer, h, start, end, retained, keys, vals, query_cache, window)
        outs.append(h)
        if end == prompt_len:
            retained = [j for j in retained if not any(lo <= j < hi for lo, hi in prune)]
        due = (end == prompt_len) if not decode else ((end - prompt_len) % interval == 0)
        if due and len(retained) > budget:
            score = [0.0] * (len(retained) - window)
            for layer in range(model.n_layers):
                s = reference_scores(keys[layer][retained], query_cache[layer], window, kernel, lam, threshold)
                score = [a + b for a, b in zip(score, s)]
            past = sorted(range(len(score)), key=lambda i: (-score[i], i))[:budget - window]
            retained = [retained[i] for i in sorted(past)] + retained[len(retained) - window:]
        kept_after.append(len(retained))
    return torch.cat(outs), kept_after, retained


@pytest.mark.parametrize(("budget", "window", "kernel", "lam", "interval", "prompt_len"), [
    (24, 4, 7, 0.1, 8, 60),  # the original's mix and pool: prompt compressed, then every 8 decoded tokens
    (24, 8, 7, 0.1, 5, 60),
    (20, 4, 1, 1.0, 6, 60),  # importance only, no pooling
    (20, 4, 3, 0.0, 6, 60),  # redundancy only
    (40, 4, 7, 0.1, 6, 36),  # prompt under budget: decode compressions only
])
def test_rkv_equals_plain_reference(budget: int, window: int, kernel: int, lam: float, interval: int,
                                    prompt_len: int) -> None:
    model, tokens, chunk = ToyAttentionStack(), _tokens(84, seed=3), 16
    cfg = {"budget": budget, "window_size": window, "kernel_size": kernel, "mix_lambda": lam,
           "evict_interval": interval}
    trace = run_request(create_method("rkv", cfg), model, tokens, prompt_len=prompt_len, chunk_size=chunk)
    ref_out, ref_kept_after, ref_kept = reference_rkv(model, tokens, prompt_len, chunk, budget, window, kernel,
                                                      lam, 0.5, interval)
    assert trace.state.kept.tolist() == ref_kept
    assert trace.kept_after_step == ref_kept_after
    assert torch.allclose(trace.outputs, ref_out, atol=1e-4)
    n_prefill = len(range(0, prompt_len, chunk))
    if prompt_len > budget:
        assert ref_kept_after[n_prefill - 1] == budget  # the prompt compressed at its end
    assert max(ref_kept_after[n_prefill:]) <= max(budget, prompt_len) + interval
    assert ref_kept[-window:] == list(range(len(tokens) - window, len(tokens)))  # observation tokens kept


@pytest.mark.parametrize(("budget", "lam", "prune"), [
    (24, 0.1, [(10, 30)]),  # 40 left, compressed to 24, then every 6 decoded tokens
    (20, 0.1, [(5, 15), (54, 60)]),  # the prompt's last tokens pruned: the observation tokens are what is left
    (40, 0.1, [(20, 40)]),  # the 40 left fit the budget: decode compressions only
])
def test_rkv_with_a_prune_equals_plain_reference(budget: int, lam: float, prune: list[tuple[int, int]]) -> None:
    model, tokens, prompt_len, chunk = ToyAttentionStack(), _tokens(84, seed=3), 60, 16
    cfg = {"budget": budget, "window_size": 4, "kernel_size": 7, "mix_lambda": lam, "evict_interval": 6}
    trace = run_request(create_method("rkv", cfg), model, tokens, prompt_len=prompt_len, chunk_size=chunk,
                        prune=prune)
    ref_out, ref_kept_after, ref_kept = reference_rkv(model, tokens, prompt_len, chunk, budget, 4, 7, lam, 0.5, 6,
                                                      prune)
    assert trace.state.kept.tolist() == ref_kept
    assert trace.kept_after_step == ref_kept_after
    assert torch.allclose(trace.outputs, ref_out, atol=1e-4)
    assert ref_kept_after[3] == min(budget, prompt_len - sum(hi - lo for lo, hi in prune))
    assert not any(lo <= p < hi for p in ref_kept for lo, hi in prune)


def test_budget_covering_the_sequence_reproduces_dense() -> None:
    model, tokens = ToyAttentionStack(), _tokens(90)
    dense = run_request(create_method("dense"), model, tokens, prompt_len=70, chunk_size=32)
    sparse = run_request(create_method("rkv", {"budget": 90, "evict_interval": 4}), model, tokens,
                         prompt_len=70, chunk_size=32)
    assert torch.equal(sparse.outputs, dense.outputs)
    assert sparse.kept_after_step == dense.kept_after_step


def test_redundancy_marks_older_duplicates() -> None:
    """Three copies of one key among orthogonal ones: the oldest copy is the most redundant, the newest is spared
    (each copy's most recent near-duplicate does not count against it), distinct keys score the baseline."""
    keys = torch.eye(8).repeat_interleave(1, 0)[:, None, :].clone()  # [8, 1, 8], orthogonal
    for p in (0, 3, 5):
        keys[p, 0] = torch.eye(8)[0] * (1 + p)  # same direction, different norms
    red = rkv.redundancy(keys, 0.5)[0]
    base = red[1]
    assert red[0] > red[3] > base
    assert torch.allclose(red[5], base) and torch.allclose(red[[1, 2, 4, 6, 7]], base.expand(5))


def test_redundancy_row_blocks_match_one_block(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = torch.randn(37, 3, 16, generator=torch.Generator().manual_seed(5))
    keys[20] = keys[4]
    whole = rkv.redundancy(keys, 0.2)
    monkeypatch.setattr(rkv, "SIMILARITY_BLOCK_ELEMENTS", 3 * 37 * 4)  # four rows a block
    assert torch.allclose(rkv.redundancy(keys, 0.2), whole, atol=1e-7)


def test_config_defaults_and_errors() -> None:
    m = create_method("rkv")
    assert m.config.to_dict() == {"budget": 1024, "window_size": 8, "kernel_size": 7, "mix_lambda": 0.1,
                                  "similarity_threshold": 0.5, "evict_interval": 128}
    assert m.observation_window() == 8 and m.observes_decode()
    for cfg, message in [({"budget": 8}, "field 'budget' must be > window_size"),
                         ({"window_size": 0}, "field 'window_size' must be >= 1"),
                         ({"kernel_size": 4}, "field 'kernel_size' must be odd"),
                         ({"mix_lambda": 1.5}, "field 'mix_lambda' must be in"),
                         ({"similarity_threshold": 2.0}, "field 'similarity_threshold' must be in"),
                         ({"evict_interval": 0}, "field 'evict_interval' must be >= 1")]:
        with pytest.raises(SparseConfigError, match=message):
            create_method("rkv", cfg)


def test_chain_cache_needs_no_payload() -> None:
    method = create_method("rkv", {"budget": 24, "window_size": 4, "evict_interval": 4})
    trace = run_request(method, ToyAttentionStack(), _tokens(72), prompt_len=60, chunk_size=16)
    assert trace.state.num_kept <= 24 + 4
    assert method.on_finish(trace.state) is None
    assert WINDOW not in trace.state.extra  # nothing left over between compactions
