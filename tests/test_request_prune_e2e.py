"""A request that prunes its own prompt under a scoring method (``custom_params`` ``sgl_sparse_method`` +
``sgl_sparse_prune``), through a real SGLang server on CPU with the small trained model (fp32): one dense server
whose requests choose their method (``--sparse-request-methods eviction``), shared by the module.

* SnapKV with a budget that covers what the prune leaves (not the prompt): its decode equals a plain HF
  transformers reference that prefills the whole prompt and then decodes over its KV less the pruned positions,
  exactly the pruned tokens are evicted (the budget counts what is left), and the next turn is a cache hit that
  decodes as the reference's next turn over the same KV;
* SnapKV under a small budget: a fact outside the pruned ranges is still answered, the fact inside them is not
  (the first output token saw it, the decode cannot), the pruned ranges stay hidden in the tree, and the next
  turn is a hit that keeps hiding them and answers again;
* every other scoring method per request, pruning a continuation's restored prefix (H2O's restored scores and the
  others' kept sets): hidden, leak-free, the turn after a hit.

SGLang's strict leak check (``_assert_idle_and_sound``) holds after each.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import torch

from sgl_sparse.server_process import CPU_SERVER_FLAGS, ServerProcess
from tests.server_pool import ServerPool, spec
from tests.test_eviction_e2e import _assert_idle_and_sound, _flush, _state

pytestmark = pytest.mark.server

N_OUT = 12
QUESTION = "\nQuestion: What is the special magic number for {key}?\nAnswer:"


@pytest.fixture(scope="module")
def small(server_pool: ServerPool) -> Iterator[dict[str, Any]]:
    """The server, the model directory, its tokenizer and one niah_multikey example (~1K tokens) with the token
    span of each needle."""
    from transformers import AutoTokenizer

    from sgl_sparse.quality.eval import fit_example, render
    from sgl_sparse.quality.models import small_model_path

    model = str(small_model_path())
    tok = AutoTokenizer.from_pretrained(model)
    example = fit_example("niah_multikey", 10_000, tok, 1024)
    ids = render(example, tok, chain=False).turns[0]
    offsets = tok(example.prompt, add_special_tokens=True, return_offsets_mapping=True)["offset_mapping"]
    needles = {}
    for m in re.finditer(r"The special magic number for (\w+) is (\d+)\.", example.prompt):
        toks = [i for i, (s, e) in enumerate(offsets) if s < m.end() and e > m.start()]
        needles[m.group(1)] = (m.group(2), toks[0], toks[-1] + 1)
    asked = next(k for k, (v, _, _) in needles.items() if v == example.answer)
    with server_pool.use(spec(model, [*CPU_SERVER_FLAGS, "--chunked-prefill-size", "256", "--enable-cache-report",
                                      "--sparse-request-methods", "eviction"]), once=True) as (proc,):
        yield {"server": proc, "model": model, "tok": tok, "example": example, "ids": ids, "needles": needles,
               "asked": asked}


def _gen(server: ServerProcess, ids: list[int], method: str, config: dict, prune: list[list[int]] | None = None,
         n: int = N_OUT, ignore_eos: bool = True) -> dict:
    cp = {"sgl_sparse_method": method, "sgl_sparse_config": json.dumps(config)}
    if prune is not None:
        cp["sgl_sparse_prune"] = json.dumps({"ranges": prune})
    return server.generate(input_ids=ids, max_new_tokens=n, ignore_eos=ignore_eos, custom_params=cp)


def _prefix(server: ServerProcess, op: str, ids: list[int], method: str, config: dict) -> dict:
    body = {"token_ids": ids, "sgl_sparse_method": method, "sgl_sparse_config": json.dumps(config)}
    r = requests.post(f"{server.base_url}/v1/prefix_cache/{op}", json=body, timeout=60)
    assert r.status_code == 200, r.text[:300]
    return r.json()


def _hidden(inspect: dict) -> set[int]:
    return {p for lo, hi in inspect["hidden_ranges"] for p in range(lo, hi)}


def _masked_reference(model_dir: str, prompt: list[int], pruned: set[int], later: list[list[int]],
                      n_out: int) -> list[list[int]]:
    """HF transformers, fp32: the prompt prefilled whole (its first output token sees every position), then greedy
    decoding over its KV less the ``pruned`` positions; each of the ``later`` turns' new tokens then extends that
    KV (after the previous reply's last token, whose KV its own turn never computed) and decodes over it, so no
    query after the first prompt's forward reads a pruned position. Returns each turn's output ids."""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    n = len(prompt)
    keep = [p for p in range(n) if p not in pruned]

    def greedy(logits: torch.Tensor, at: int) -> list[int]:
        token, outs = int(logits.argmax()), []
        for t in range(n_out):
            outs.append(token)
            if t < n_out - 1:
                o = model(torch.tensor([[token]]), past_key_values=cache, position_ids=torch.tensor([[at + t]]),
                          use_cache=True)
                token = int(o.logits[0, -1].argmax())
        return outs

    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        cache = DynamicCache()
        for layer in range(model.config.num_hidden_layers):
            full = out.past_key_values.layers[layer]
            cache.update(full.keys[:, :, keep], full.values[:, :, keep], layer)
        replies = [greedy(out.logits[0, -1], n)]
        seq = prompt + replies[0]
        for new in later:
            feed = [seq[-1], *new]
            o = model(torch.tensor([feed]), past_key_values=cache,
                      position_ids=torch.arange(len(seq) - 1, len(seq) - 1 + len(feed))[None], use_cache=True)
            replies.append(greedy(o.logits[0, -1], len(seq) + len(new)))
            seq = seq + new + replies[-1]
    return replies


def test_snapkv_decodes_as_attention_without_the_pruned_ranges(small: dict) -> None:
    """SnapKV's budget covers what the prune leaves but not the prompt: it evicts exactly the pruned tokens (its
    budget counts what is left), and both this turn's decode and the next turn's answer equal the reference that
    reads every position but the pruned ones after the prompt's forward."""
    server, ids, tok = small["server"], small["ids"], small["tok"]
    ranges = [[100, 250], [400, 480], [600, 670]]
    pruned = {p for lo, hi in ranges for p in range(lo, hi)}
    cfg = {"budget": len(ids) - len(pruned) + 64, "window_size": 16, "sink_tokens": 8}  # + turn 2
    assert cfg["budget"] < len(ids)
    before = _flush(server)
    first = _gen(server, ids, "snapkv", cfg, ranges)
    after = _assert_idle_and_sound(server)
    assert after["evicted_tokens_total"] - before["evicted_tokens_total"] == len(pruned)
    seq = ids + first["output_ids"]
    inspect = _prefix(server, "inspect", seq, "snapkv", cfg)
    assert _hidden(inspect) == pruned and inspect["matched_tokens"] >= len(seq) - 1, inspect

    question = tok.encode(QUESTION.format(key=small["asked"]), add_special_tokens=False)
    nxt = _gen(server, seq + question, "snapkv", cfg)
    assert nxt["meta_info"]["cached_tokens"] == inspect["matched_tokens"], nxt["meta_info"]
    ref = _masked_reference(small["model"], ids, pruned, [question], N_OUT)
    assert [first["output_ids"], nxt["output_ids"]] == ref
    end = _assert_idle_and_sound(server)
    assert end["evicted_tokens_total"] - before["evicted_tokens_total"] == len(pruned)  # turn 2 fit the budget
    assert _hidden(_prefix(server, "inspect", seq + question + nxt["output_ids"], "snapkv", cfg)) == pruned


def test_snapkv_answers_from_outside_the_pruned_ranges_only(small: dict) -> None:
    """SnapKV 256 on a ~1K-token prompt with four needles: pruning the three it is not asked about keeps the answer;
    pruning the asked one loses it (the prompt's forward read it, the decode cannot). The pruned ranges stay hidden
    in the tree and the next turn, asking again, is a hit that still answers from what is left."""
    from sgl_sparse.quality.tasks import score

    server, ids, tok, example = small["server"], small["ids"], small["tok"], small["example"]
    needles, asked = small["needles"], small["asked"]
    cfg = {"budget": 256, "window_size": 16, "sink_tokens": 8}
    _flush(server)
    assert score(example, server.generate(input_ids=ids, max_new_tokens=N_OUT)["text"])  # dense, no prune

    others = [[lo, hi] for key, (_, lo, hi) in needles.items() if key != asked]
    kept_fact = _gen(server, ids, "snapkv", cfg, others, ignore_eos=False)  # an answer ends at EOS
    assert score(example, kept_fact["text"]), kept_fact["text"]
    seq = ids + kept_fact["output_ids"]
    inspect = _prefix(server, "inspect", seq, "snapkv", cfg)
    assert {p for lo, hi in others for p in range(lo, hi)} <= _hidden(inspect), inspect["hidden_ranges"]
    assert inspect["resident_tokens"] == cfg["budget"] + inspect["matched_tokens"] - len(ids), inspect
    _assert_idle_and_sound(server)

    question = tok.encode(QUESTION.format(key=asked), add_special_tokens=False)
    again = _gen(server, seq + question, "snapkv", cfg, ignore_eos=False)
    assert again["meta_info"]["cached_tokens"] == inspect["matched_tokens"], again["meta_info"]
    assert score(example, again["text"]), again["text"]
    inspect2 = _prefix(server, "inspect", seq + question + again["output_ids"], "snapkv", cfg)
    assert {p for lo, hi in others for p in range(lo, hi)} <= _hidden(inspect2)
    _assert_idle_and_sound(server)

    _, lo, hi = needles[asked]
    lost = _gen(server, ids, "snapkv", cfg, [[lo, hi]], ignore_eos=False)
    assert not score(example, lost["text"]), lost["text"]
    assert set(range(lo, hi)) <= _hidden(_prefix(server, "inspect", ids + lost["output_ids"], "snapkv", cfg))
    _assert_idle_and_sound(server)


@pytest.mark.parametrize(("method", "config"), [
    ("h2o", {"budget": 256, "window_size": 16, "evict_interval": 8}),
    ("rkv", {"budget": 256, "window_size": 8, "evict_interval": 8}),
    ("skipkv", {"budget": 256, "sink_tokens": 8, "recent_tokens": 64, "evict_interval": 8}),
    ("streamingllm", {"sink_tokens": 8, "recent_tokens": 248, "evict_interval": 8}),
])
def test_a_continuation_prunes_its_restored_prefix(small: dict, method: str, config: dict) -> None:
    """Turn 1 evicts under the method (H2O leaves its scores in the tree); turn 2 resumes it (a hit) and prunes
    ranges of turn 1's prompt, some of them already evicted (what leaves is the union): they end hidden, the method's
    restored state follows (on_prune), nothing leaks, and turn 3 is a hit that keeps them hidden."""
    server, ids, tok = small["server"], small["ids"], small["tok"]
    _flush(server)
    first = _gen(server, ids, method, config)
    seq = ids + first["output_ids"]
    matched = _prefix(server, "match", seq, method, config)["matched_tokens"]
    question = tok.encode(QUESTION.format(key=small["asked"]), add_special_tokens=False)
    ranges = [[20, 200], [500, 700]]
    second = _gen(server, seq + question, method, config, ranges)
    assert second["meta_info"]["cached_tokens"] == matched, second["meta_info"]
    seq2 = seq + question + second["output_ids"]
    inspect = _prefix(server, "inspect", seq2, method, config)
    assert {p for lo, hi in ranges for p in range(lo, hi)} <= _hidden(inspect), inspect["hidden_ranges"]
    _assert_idle_and_sound(server)
    third = _gen(server, seq2 + question, method, config, n=4)
    assert third["meta_info"]["cached_tokens"] == inspect["matched_tokens"], third["meta_info"]
    assert {p for lo, hi in ranges for p in range(lo, hi)} <= _hidden(
        _prefix(server, "inspect", seq2 + question + third["output_ids"], method, config))
    assert _state(server)["requests_tracked"] == 0
    _assert_idle_and_sound(server)


def _reference_scores(model_dir: str, prompt: list[int], policy: str,
                      ranges: list[list[int]] | None = None) -> torch.Tensor:
    """The scored keep's score of every prompt position, from HF transformers (fp32, eager attention) over the
    whole prompt: ``snapkv_global``: the softmax attention of the prompt's last 32 queries, summed over each KV
    head's query group and the window, average-pooled over 5 positions per KV head, summed over heads and layers
    (SnapKV's score, prune/keep.py); ``knorm``: minus each post-RoPE key's L2 norm, summed over heads and layers;
    ``kvzip_global``: see :func:`_kvzip_reference_scores` (``ranges`` needed)."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    if policy == "kvzip_global":
        assert ranges is not None
        return _kvzip_reference_scores(model, model_dir, prompt, ranges)
    n, hkv = len(prompt), model.config.num_key_value_heads
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True, output_attentions=True)
    total = torch.zeros(n, dtype=torch.float64)
    for layer in range(model.config.num_hidden_layers):
        if policy == "snapkv_global":
            per_head = out.attentions[layer][0, :, -32:, :].reshape(hkv, -1, n).sum(1)  # [Hkv, n]
            pooled = F.avg_pool1d(per_head[:, None, :], 5, stride=1, padding=2, count_include_pad=False)[:, 0]
            total += pooled.sum(0).double()
        else:
            total -= torch.linalg.vector_norm(out.past_key_values.layers[layer].keys[0], dim=-1).double().sum(0)
    return total


def _kvzip_reference_scores(model: Any, model_dir: str, prompt: list[int], ranges: list[list[int]]) -> torch.Tensor:
    """``kvzip_global``'s score of the ranges' positions (0 elsewhere): per range (each one chunk of at most 2,048),
    the replay KVzip's next-part instruction (the first one at position 0) + the 8 tokens before the range + the
    chat postfix + the range's tokens, run after the whole prompt (one forward of prompt + replay, its rows after the
    prompt); each replay query's softmax probabilities restricted to the sink (the first 4 positions before the
    range), the range and the replay's own keys and renormalised there (a softmax over a subset of the keys is the
    full softmax renormalised over it), maximised over queries, heads and layers (KVzip's token-shared score)."""
    from types import SimpleNamespace

    from sgl_sparse.integration.launch import replay_prompt_ids

    ids = replay_prompt_ids(SimpleNamespace(tokenizer_path=None, model_path=model_dir, trust_remote_code=False))
    n = len(prompt)
    scores = torch.zeros(n, dtype=torch.float64)
    for lo, hi in ranges:
        assert hi - lo <= 2048
        head = ids["prompt_ids"] if lo == 0 else [*ids["next_prompt_ids"], *prompt[max(0, lo - 8):lo]]
        replay = [*head, *ids["postfix_ids"], *prompt[lo:hi]]
        with torch.no_grad():
            out = model(torch.tensor([prompt + replay]), output_attentions=True)
        sink = list(range(min(4, lo)))
        for a in out.attentions:
            probs = a[0, :, n:, :].double()  # [H, r, n + r]: the replay's queries (causal: 0 past each query)
            local = probs[:, :, sink].sum(-1) + probs[:, :, lo:hi].sum(-1) + probs[:, :, n:].sum(-1)
            best = (probs[:, :, lo:hi] / local[..., None]).amax(dim=(0, 1))
            scores[lo:hi] = torch.maximum(scores[lo:hi], best)
    return scores


@pytest.mark.parametrize("policy", ["snapkv_global", "knorm", "kvzip_global"])
def test_a_scored_keep_keeps_the_best_scored_positions_of_its_ranges(small: dict, policy: str) -> None:
    """A dense request prunes two ranges of its own prompt but keeps 64 of their 400 tokens, the ones its policy
    scores highest (one budget over both): exactly 336 end hidden, the 64 kept are the reference's top 64 (up to
    float near-ties), and its decode equals the HF reference that reads every position but the hidden ones after
    the prompt's forward (kvzip_global's replays leave the request's KV and output as they were). Leak-free."""
    server, ids = small["server"], small["ids"]
    ranges, keep = [[100, 300], [500, 700]], 64
    candidates = [p for lo, hi in ranges for p in range(lo, hi)]
    _flush(server)
    out = server.generate(input_ids=ids, max_new_tokens=N_OUT, ignore_eos=True, custom_params={
        "sgl_sparse_prune": json.dumps({"ranges": ranges, "keep_tokens": keep, "policy": policy})})
    _assert_idle_and_sound(server)
    assert out["meta_info"]["sgl_sparse"]["prune"] == {
        "status": "applied", "policy": policy, "pruned_tokens": len(candidates) - keep, "kept_tokens": keep}
    r = requests.post(f"{server.base_url}/v1/prefix_cache/inspect", json={"token_ids": ids + out["output_ids"]},
                      timeout=60)
    assert r.status_code == 200, r.text[:300]
    hidden = _hidden(r.json())
    assert hidden <= set(candidates) and len(hidden) == len(candidates) - keep, sorted(hidden)[:20]
    kept = sorted(set(candidates) - hidden)
    assert kept != candidates[:keep] and kept != candidates[-keep:]  # scored, not positional

    scores = _reference_scores(small["model"], ids, policy, ranges)
    ranked = scores[torch.tensor(candidates)].sort(descending=True).values
    kth, tol = float(ranked[keep - 1]), 1e-5 * float(ranked.abs().max())
    assert min(float(scores[p]) for p in kept) >= kth - tol, (policy, kth)
    assert max(float(scores[p]) for p in hidden) <= kth + tol, (policy, kth)
    assert out["output_ids"] == _masked_reference(small["model"], ids, hidden, [], N_OUT)[0]


def test_the_route_serves_snapkv_global_through_a_pruning_request(small: dict) -> None:
    """``POST /v1/prefix_cache/prune`` with ``policy: snapkv_global``: a cached prompt's two ranges keep the 64 of their
    400 positions that the prompt's last 32 queries attend to most (the HF reference's scores over the whole prompt:
    the route's internal request re-forwards exactly those 32 tokens), the other 336 end hidden and their slots go back
    to the pool (the path is the sequence's own), the result says so, the next turn is a hit through the whole prompt,
    and nothing leaks."""
    server, ids, tok = small["server"], small["ids"], small["tok"]
    ranges, keep = [[100, 300], [500, 700]], 64
    candidates = [p for lo, hi in ranges for p in range(lo, hi)]
    base = _flush(server)
    server.generate(input_ids=ids, max_new_tokens=1, ignore_eos=True)
    used = _assert_idle_and_sound(server)["kv_slots_used"] - base["kv_slots_used"]
    assert used >= len(ids), used
    r = requests.post(f"{server.base_url}/v1/prefix_cache/prune", timeout=120, json={
        "token_ids": ids, "ranges": ranges, "keep_tokens": keep, "policy": "snapkv_global"})
    assert r.status_code == 202, r.text[:300]
    res = r.json()
    assert res["status"] == "completed" and res["policy"] == "snapkv_global", res
    assert (res["pruned_tokens"], res["kept_tokens"], res["freed_slots"]) == (400, 64, 336), res
    assert res["matched_tokens"] == len(ids) and res["resident_tokens"] == len(ids) - 336, res
    after = _assert_idle_and_sound(server)
    assert after["kv_slots_used"] - base["kv_slots_used"] == used - 336
    r = requests.post(f"{server.base_url}/v1/prefix_cache/inspect", json={"token_ids": ids}, timeout=60)
    hidden = _hidden(r.json())
    assert hidden <= set(candidates) and len(hidden) == len(candidates) - keep, sorted(hidden)[:20]
    kept = sorted(set(candidates) - hidden)
    scores = _reference_scores(small["model"], ids, "snapkv_global")
    ranked = scores[torch.tensor(candidates)].sort(descending=True).values
    kth, tol = float(ranked[keep - 1]), 1e-5 * float(ranked.abs().max())
    assert min(float(scores[p]) for p in kept) >= kth - tol, kth
    assert max(float(scores[p]) for p in hidden) <= kth + tol, kth

    # A sequence that already hides positions is refused (the request would not continue its record and would undo
    # it), as is a namespace whose method evicts on its own (400 naming policy): nothing changes.
    body = {"token_ids": ids, "ranges": [[750, 900]], "keep_tokens": 16, "policy": "snapkv_global"}
    again = requests.post(f"{server.base_url}/v1/prefix_cache/prune", json=body, timeout=120).json()
    assert again["status"] == "failed" and "already hides 336" in again["message"], again
    assert (again["pruned_tokens"], again["freed_slots"]) == (0, 0), again
    r = requests.post(f"{server.base_url}/v1/prefix_cache/prune", timeout=60, json={
        **body, "sgl_sparse_method": "snapkv", "sgl_sparse_config": json.dumps({"budget": 256})})
    assert r.status_code == 400 and r.json()["param"] == "policy" and "evicts on its own" in r.text, r.text
    assert _hidden(requests.post(f"{server.base_url}/v1/prefix_cache/inspect", json={"token_ids": ids},
                                 timeout=60).json()) == hidden
    question = tok.encode(QUESTION.format(key=small["asked"]), add_special_tokens=False)
    nxt = server.generate(input_ids=ids + question, max_new_tokens=4, ignore_eos=True)
    assert nxt["meta_info"]["cached_tokens"] == len(ids), nxt["meta_info"]
    assert _hidden(requests.post(f"{server.base_url}/v1/prefix_cache/inspect", timeout=60,
                                 json={"token_ids": ids + question}).json()) == hidden
    _assert_idle_and_sound(server)


def test_the_route_serves_kvzip_global_through_a_pruning_request(small: dict) -> None:
    """``POST /v1/prefix_cache/prune`` with ``policy: kvzip_global``: the internal request's final step replays the
    ranges' reconstruction, and the 64 of their 400 positions kept are the HF reference's best KVzip scores; 336 slots
    go back, the next turn is a hit through the whole prompt, nothing leaks."""
    server, ids, tok = small["server"], small["ids"], small["tok"]
    ranges, keep = [[120, 320], [520, 720]], 64
    candidates = [p for lo, hi in ranges for p in range(lo, hi)]
    base = _flush(server)
    server.generate(input_ids=ids, max_new_tokens=1, ignore_eos=True)
    used = _assert_idle_and_sound(server)["kv_slots_used"] - base["kv_slots_used"]
    r = requests.post(f"{server.base_url}/v1/prefix_cache/prune", timeout=300, json={
        "token_ids": ids, "ranges": ranges, "keep_tokens": keep, "policy": "kvzip_global"})
    assert r.status_code == 202, r.text[:300]
    res = r.json()
    assert res["status"] == "completed" and res["policy"] == "kvzip_global" and "window_tokens" not in res, res
    assert (res["pruned_tokens"], res["kept_tokens"], res["freed_slots"]) == (400, 64, 336), res
    assert _assert_idle_and_sound(server)["kv_slots_used"] - base["kv_slots_used"] == used - 336
    hidden = _hidden(requests.post(f"{server.base_url}/v1/prefix_cache/inspect", json={"token_ids": ids},
                                   timeout=60).json())
    assert hidden <= set(candidates) and len(hidden) == len(candidates) - keep, sorted(hidden)[:20]
    kept = sorted(set(candidates) - hidden)
    scores = _reference_scores(small["model"], ids, "kvzip_global", ranges)
    ranked = scores[torch.tensor(candidates)].sort(descending=True).values
    kth, tol = float(ranked[keep - 1]), 1e-5 * float(ranked.abs().max())
    assert min(float(scores[p]) for p in kept) >= kth - tol, kth
    assert max(float(scores[p]) for p in hidden) <= kth + tol, kth
    question = tok.encode(QUESTION.format(key=small["asked"]), add_special_tokens=False)
    nxt = server.generate(input_ids=ids + question, max_new_tokens=4, ignore_eos=True)
    assert nxt["meta_info"]["cached_tokens"] == len(ids), nxt["meta_info"]
    _assert_idle_and_sound(server)


def test_a_kvzip_global_prune_without_room_for_a_replay_says_so(small: dict) -> None:
    """A prompt that leaves 8 positions of the model's context (4,096) cannot hold a replay: nothing is pruned, the
    request answers as the same request without a prune, and its response says why (``"status": "unscored"``);
    ``/server_info`` counts it. Leak-free."""
    server, ids = small["server"], small["ids"]
    with open(f"{small['model']}/config.json") as f:
        context = int(json.load(f)["max_position_embeddings"])  # the server's context: no --context-length
    long_ids = (ids * (context // len(ids) + 1))[:context - 8]
    prune = {"ranges": [[100, 300]], "keep_tokens": 64, "policy": "kvzip_global"}
    _flush(server)
    before = _state(server)["unscored_prunes_total"]
    out = server.generate(input_ids=long_ids, max_new_tokens=4, ignore_eos=True,
                          custom_params={"sgl_sparse_prune": json.dumps(prune)})
    _assert_idle_and_sound(server)
    report = out["meta_info"]["sgl_sparse"]["prune"]
    assert report["status"] == "unscored" and "no room for a replay" in report["message"], report
    assert (report["policy"], report["pruned_tokens"], report["kept_tokens"]) == ("kvzip_global", 0, 200), report
    assert _state(server)["unscored_prunes_total"] == before + 1
    r = requests.post(f"{server.base_url}/v1/prefix_cache/inspect", json={"token_ids": long_ids + out["output_ids"]},
                      timeout=60)
    assert r.status_code == 200 and _hidden(r.json()) == set(), r.text[:300]
    _flush(server)
    plain = server.generate(input_ids=long_ids, max_new_tokens=4, ignore_eos=True)
    assert "prune" not in plain["meta_info"]["sgl_sparse"]
    assert out["output_ids"] == plain["output_ids"]
    _assert_idle_and_sound(server)


def _runs(positions: list[int]) -> list[list[int]]:
    """Sorted positions as ``[start, end)`` runs."""
    out: list[list[int]] = []
    for p in positions:
        if out and out[-1][1] == p:
            out[-1][1] = p + 1
        else:
            out.append([p, p + 1])
    return out


def test_kvzip_global_replays_leave_the_methods_window_alone(small: dict) -> None:
    """A SnapKV request pruning by ``kvzip_global`` evicts exactly as a SnapKV request that drops the positions
    kvzip_global takes away (a dense request's same prune tells which: its replays attend the whole prompt either
    way), and decodes the same tokens: the replays, which run under the request's id before SnapKV observes, leave
    SnapKV's window to the prompt's last queries."""
    server, ids = small["server"], small["ids"]
    prune = {"ranges": [[100, 300], [500, 700]], "keep_tokens": 64, "policy": "kvzip_global"}
    cfg = {"budget": 400, "window_size": 16, "sink_tokens": 8}
    _flush(server)
    dense = server.generate(input_ids=ids, max_new_tokens=N_OUT, ignore_eos=True,
                            custom_params={"sgl_sparse_prune": json.dumps(prune)})
    r = requests.post(f"{server.base_url}/v1/prefix_cache/inspect", json={"token_ids": ids + dense["output_ids"]},
                      timeout=60)
    gone = sorted(_hidden(r.json()))
    assert len(gone) == 336, len(gone)

    def snapkv(own_prune: dict) -> tuple[list[int], set[int]]:
        _flush(server)
        out = server.generate(input_ids=ids, max_new_tokens=N_OUT, ignore_eos=True, custom_params={
            "sgl_sparse_method": "snapkv", "sgl_sparse_config": json.dumps(cfg),
            "sgl_sparse_prune": json.dumps(own_prune)})
        _assert_idle_and_sound(server)
        return out["output_ids"], _hidden(_prefix(server, "inspect", ids + out["output_ids"], "snapkv", cfg))

    out_kvzip, hidden_kvzip = snapkv(prune)
    out_drop, hidden_drop = snapkv({"ranges": _runs(gone)})
    assert set(gone) < hidden_kvzip  # SnapKV evicted past the prune
    assert hidden_kvzip == hidden_drop, (sorted(hidden_kvzip ^ hidden_drop)[:20], len(hidden_kvzip ^ hidden_drop))
    assert out_kvzip == out_drop
