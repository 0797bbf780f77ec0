"""KVzip through a real SGLang server on CPU (our launcher, tiny model): the replay prompts derived from the tokenizer
at launch; dense token for token while the budget covers the context (no replay runs); over the budget, the replay
forwards run inside the final prefill step and the server's greedy answer equals a plain-torch reference of the same
model (HF transformers, fp32): the same replays, scored per head and query in float64 loops, the same kept set,
decoded over it; KV slots bounded by the budget; Chain Cache turns; aborts without a leak; kvzip refused per
request and on CUDA.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import torch

from sgl_sparse.methods.eviction import kvzip
from sgl_sparse.server_process import CPU_SERVER_FLAGS, ServerProcess
from tests.server_pool import ServerPool, Spec, spec
from tests.test_eviction_e2e import (
    _assert_idle_and_sound,
    _flush,
    _ids,
    _state,
    abort_mid_prefill_and_mid_decode,
    alone_equals_beside_traffic,
    covering_budget_equals_dense,
    written,
)
from tests.test_kvzip import dense_chunk_scores

pytestmark = pytest.mark.server

FLAGS = [*CPU_SERVER_FLAGS, "--chunked-prefill-size", "128", "--enable-cache-report"]
SMALL = {"budget": 64, "chunk_size": 128}  # sink 4, recent 0, prev_postfix 8: the rest KVzip's


TIGHT_POOL = 2048  # the "tight" server's KV pool: a few dozen cached sequences fill it


def _server(model: str, method: str, config: dict | None = None, flags: tuple[str, ...] = ()) -> Spec:
    extra = ["--sparse-config", json.dumps(config)] if config is not None else []
    return spec(model, [*FLAGS, "--sparse-method", method, *extra, *flags], startup_timeout=900)


@pytest.fixture(scope="module")
def kvzip_servers(server_pool: ServerPool, servers: dict[str, ServerProcess],
                  tiny_model: str) -> Iterator[dict[str, ServerProcess]]:
    tight_pool = ("--max-total-tokens", str(TIGHT_POOL))
    with server_pool.use(_server(tiny_model, "kvzip", SMALL),
                         _server(tiny_model, "kvzip", SMALL, tight_pool)) as (small, tight):
        yield {"dense": servers["ours"], "small": small, "tight": tight}


def _stats(before: dict, after: dict) -> dict[str, int]:
    return {k: after["method_stats"][k] - before.get("method_stats", {}).get(k, 0) for k in after["method_stats"]}


def test_server_info_reports_the_tokenizers_replay_prompts(kvzip_servers: dict, tiny_model: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    cfg = _state(kvzip_servers["small"])["config"]
    assert cfg["prompt_ids"] == tok.encode(kvzip.FIRST_PROMPT, add_special_tokens=False)
    assert cfg["next_prompt_ids"] == tok.encode(kvzip.NEXT_PROMPT, add_special_tokens=False)
    assert tok.decode(cfg["postfix_ids"]) == "<|end|><|assistant|>"  # the tiny chat template's
    assert {k: cfg[k] for k in SMALL} == SMALL


def test_budget_covering_context_equals_dense(kvzip_servers: dict) -> None:
    before, after = covering_budget_equals_dense(kvzip_servers, ((20, 40), (64, 40)))
    assert _stats(before, after)["replay_forwards"] == 0


def _reference(model_dir: str, prompt: list[int], cfg: dict[str, Any], new_tokens: int,
               pruned: frozenset[int] = frozenset()) -> tuple[list[int], list[int]]:
    """HF transformers, fp32: the prompt's cache; each replay of :func:`kvzip.build_replays` run over a copy of it
    (post-RoPE queries and keys recorded per layer), scored by :func:`dense_chunk_scores`, maxed over layers; the sink
    and the best kept; then greedy decoding over the kept cache. Returns (kept positions, output ids). ``pruned``:
    positions the request prunes from its own prompt, gone from the cache the replays read and score (the prompt's
    forward, hence the first output token, read them)."""
    import copy

    from transformers import AutoModelForCausalLM, DynamicCache
    from transformers.models.llama import modeling_llama

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    recorded: list[tuple[torch.Tensor, torch.Tensor]] = []
    original = modeling_llama.apply_rotary_pos_emb

    def record(q, k, *args, **kwargs):  # type: ignore[no-untyped-def]
        q, k = original(q, k, *args, **kwargs)
        recorded.append((q[0].transpose(0, 1), k[0].transpose(0, 1)))  # [r, H, D], [r, Hkv, D]
        return q, k

    n = len(prompt)
    scale = model.config.head_dim**-0.5
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        cache = out.past_key_values
        first = int(out.logits[0, -1].argmax())
        left = [p for p in range(n) if p not in pruned]
        base = DynamicCache()
        for layer in range(model.config.num_hidden_layers):
            base.update(cache.layers[layer].keys[:, :, left], cache.layers[layer].values[:, :, left], layer)
        method_cfg = kvzip.KVzipConfig(**cfg)
        reps = kvzip.build_replays(prompt, torch.tensor(left), n, method_cfg, max_tokens=1 << 20)
        scores = torch.zeros(n, dtype=torch.float64)
        modeling_llama.apply_rotary_pos_emb = record
        try:
            for rep in reps:
                recorded.clear()
                r = len(rep.token_ids)
                model(torch.tensor([rep.token_ids]), past_key_values=copy.deepcopy(base),
                      position_ids=torch.arange(n, n + r)[None], use_cache=True)
                lo, hi = rep.scored
                sink = method_cfg.sink_tokens
                rows = [i for i, p in enumerate(left) if lo <= p < hi]
                for layer, (q, k) in enumerate(recorded):
                    keys = base.layers[layer].keys[0].transpose(0, 1)  # [len(left), Hkv, D], post-RoPE
                    s = dense_chunk_scores(q, keys[:sink], keys[rows], k, scale)
                    at = torch.tensor([left[i] for i in rows])
                    scores[at] = torch.maximum(scores[at], torch.tensor(s, dtype=torch.float64))
        finally:
            modeling_llama.apply_rotary_pos_emb = original
        sink = method_cfg.sink_tokens
        best = sorted(left[sink:], key=lambda p: (-float(scores[p]), p))[:method_cfg.budget - sink]
        kept = sorted([*left[:sink], *best])
        small = DynamicCache()
        for layer in range(model.config.num_hidden_layers):
            small.update(cache.layers[layer].keys[:, :, kept], cache.layers[layer].values[:, :, kept], layer)
        outs, token = [first], first
        for t in range(new_tokens - 1):
            o = model(torch.tensor([[token]]), past_key_values=small, position_ids=torch.tensor([[n + t]]),
                      use_cache=True)
            token = int(o.logits[0, -1].argmax())
            outs.append(token)
    return kept, outs


@pytest.mark.parametrize(("n", "seed"), [(300, 1), (200, 2)])
def test_over_budget_answer_equals_the_plain_torch_reference(kvzip_servers: dict, tiny_model: str, n: int,
                                                             seed: int) -> None:
    server = kvzip_servers["small"]
    before = _assert_idle_and_sound(server)
    prompt = _ids(random.Random(seed), n)
    out = server.generate(input_ids=prompt, max_new_tokens=12, ignore_eos=True)
    after = _assert_idle_and_sound(server)
    cfg = {**after["config"]}
    kept, ref_out = _reference(tiny_model, prompt, cfg, 12)
    assert len(kept) == SMALL["budget"]
    assert out["output_ids"] == ref_out
    stats = _stats(before, after)
    reps = kvzip.build_replays(prompt, torch.arange(n), n, kvzip.KVzipConfig(**cfg), max_tokens=1 << 20)
    assert stats["scored_requests"] == 1 and stats["replay_forwards"] == len(reps) == -(-(n - 4) // 128)
    assert stats["replay_tokens"] == sum(len(r.token_ids) for r in reps)
    # The prompt compacted to the budget after its final chunk; decode appends.
    assert after["evicted_tokens_total"] - before["evicted_tokens_total"] == n - SMALL["budget"]


def test_a_pool_full_of_cached_sequences_leaves_the_replays_and_the_answer_as_on_an_idle_server(
        kvzip_servers: dict, tiny_model: str) -> None:
    """Other requests' cached sequences fill the pool (all evictable): the replay room counts what the tree can
    evict, so the chunks, the kept set and the answer are the plain-torch reference's, as on an idle server.
    Before, the room was the free slots alone: a warm server cut the chunks (or left the prompt unscored), and one
    user's answer depended on what others had left cached (quality-small: 9 of 10 niah_multivalue answers)."""
    server = kvzip_servers["tight"]
    base = _flush(server)
    rng = random.Random(12)
    while _state(server)["kv_slots_used"] < TIGHT_POOL - 100:  # 56 + 4 tokens each: under the budget, kept whole
        server.generate(input_ids=_ids(rng, 56), max_new_tokens=4, ignore_eos=True)
    before = _assert_idle_and_sound(server)
    assert before["tree_evictable_slots"] >= TIGHT_POOL - 100
    n, prompt = 300, _ids(random.Random(1), 300)
    out = server.generate(input_ids=prompt, max_new_tokens=12, ignore_eos=True)
    after = _assert_idle_and_sound(server)
    kept, ref_out = _reference(tiny_model, prompt, {**after["config"]}, 12)
    assert out["output_ids"] == ref_out
    stats = _stats(before, after)
    assert stats["scored_requests"] == 1 and stats["replay_forwards"] == -(-(n - 4) // 128), stats
    assert after["replay_room_memory_bound_total"] == base["replay_room_memory_bound_total"]
    assert after["evicted_tokens_total"] - before["evicted_tokens_total"] == n - SMALL["budget"]


def test_a_request_pruning_its_own_prompt_replays_over_what_is_left(kvzip_servers: dict, tiny_model: str) -> None:
    """custom_params sgl_sparse_prune on a KVzip server: the ranges leave before the replays, so the sink is the
    first positions left, a chunk with nothing left is not replayed, the replays attend and score only the keys
    left, and the budget counts them: the answer equals the HF reference built the same way."""
    server = kvzip_servers["small"]
    before = _assert_idle_and_sound(server)
    n, ranges = 300, [[2, 40], [168, 298]]  # sink 0, 1, 40, 41; chunks from 42: [170, 298) has nothing left
    prompt = _ids(random.Random(3), n)
    cp = {"sgl_sparse_prune": json.dumps({"ranges": ranges})}
    out = server.generate(input_ids=prompt, max_new_tokens=12, ignore_eos=True, custom_params=cp)
    after = _assert_idle_and_sound(server)
    pruned = frozenset(p for lo, hi in ranges for p in range(lo, hi))
    kept, ref_out = _reference(tiny_model, prompt, {**after["config"]}, 12, pruned)
    assert len(kept) == SMALL["budget"] and not pruned & set(kept)
    assert out["output_ids"] == ref_out
    stats = _stats(before, after)
    assert stats["scored_requests"] == 1 and stats["replay_forwards"] == 2
    assert after["evicted_tokens_total"] - before["evicted_tokens_total"] == n - SMALL["budget"]


def test_chain_cache_three_turns(kvzip_servers: dict) -> None:
    server = kvzip_servers["small"]
    assert requests.post(f"{server.base_url}/flush_cache", timeout=30).status_code == 200
    base = _assert_idle_and_sound(server)
    rng = random.Random(9)
    history, prev_len = _ids(rng, 400), None
    for turn in range(3):
        out = server.generate(input_ids=history, max_new_tokens=20, ignore_eos=True)
        meta = out["meta_info"]
        if prev_len is not None:  # the whole previous sequence matches; only the new suffix is prefilled
            assert meta["cached_tokens"] == prev_len, (turn, meta, prev_len)
            assert meta["prompt_tokens"] - meta["cached_tokens"] == 41  # the last answer token and 40 new
        st = _assert_idle_and_sound(server)
        # Each turn: the kept set + 41 new tokens replayed and compacted to 64 at the prompt's end, then 19 decoded
        # positions written (written()).
        assert st["kv_slots_used"] - base["kv_slots_used"] == SMALL["budget"] + 19, (turn, st)
        prev_len = written(len(history), out["output_ids"])
        history = history + out["output_ids"] + _ids(rng, 40)
    st = _state(server)
    assert st["chain_hits_total"] - base["chain_hits_total"] == 2
    assert _stats(base, st)["scored_requests"] == 3


def test_aborts_mid_prefill_and_mid_decode_do_not_leak(kvzip_servers: dict) -> None:
    abort_mid_prefill_and_mid_decode(kvzip_servers["small"], random.Random(4), "kvzip")


def test_kvzip_cannot_be_chosen_per_request(kvzip_servers: dict) -> None:
    r = requests.post(f"{kvzip_servers['small'].base_url}/generate", timeout=60, json={
        "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "custom_params": {
            "sgl_sparse_method": "kvzip", "sgl_sparse_config": json.dumps({"budget": 32})}}})
    assert r.status_code == 400 and "sgl_sparse_method" in r.text and "per request" in r.text, r.text


def test_an_answer_alone_equals_beside_and_after_other_traffic(kvzip_servers: dict) -> None:
    alone_equals_beside_traffic(kvzip_servers["small"], random.Random(47), 300)
