"""SkipKV through real SGLang servers on CPU (our launcher, tiny model): one SkipKV server and a dense one. Sentence
boundaries derived from the tiny model's tokenizer at launch; dense token for token while the budget covers the
context; KV slots bounded by budget + evict_interval as decode keeps compressing (a prompt over the budget stays
whole until the first decode compaction); the decoded tokens' real ids close the sentences the method counts;
Chain Cache turns; aborts without a leak (SGLang's strict idle check is on).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import pytest

from sgl_sparse.methods.eviction.skipkv import boundary_ids
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

pytestmark = pytest.mark.server

FLAGS = [*CPU_SERVER_FLAGS, "--chunked-prefill-size", "128", "--enable-cache-report"]
SMALL = {"budget": 512, "recent_tokens": 128, "evict_interval": 16}  # sink 64, window 8, the rest SkipKV's


def _server(model: str, method: str, config: dict | None = None) -> Spec:
    extra = ["--sparse-config", json.dumps(config)] if config is not None else []
    return spec(model, [*FLAGS, "--sparse-method", method, *extra], startup_timeout=900)


@pytest.fixture(scope="module")
def skipkv_servers(server_pool: ServerPool, servers: dict[str, ServerProcess],
                   tiny_model: str) -> Iterator[dict[str, ServerProcess]]:
    with server_pool.use(_server(tiny_model, "skipkv", SMALL), once=True) as (small,):
        yield {"dense": servers["ours"], "small": small}


def _closed_sentences(ids: list[int], boundaries: set[int], min_tokens: int = 4, max_tokens: int = 256) -> int:
    """How many sentences SkipKV closes and tracks over these decoded ids (its defaults: 4 to 256 tokens)."""
    closed, length = 0, 0
    for token in ids:
        length += 1
        if token in boundaries or length == max_tokens:
            closed += length >= min_tokens
            length = 0
    return closed


def test_server_info_reports_skipkv_with_the_tokenizers_boundaries(skipkv_servers: dict, tiny_model: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    st = _state(skipkv_servers["small"])
    assert st["method"] == "skipkv" and st["family"] == "eviction"
    assert st["config"]["boundary_token_ids"] == boundary_ids([tok.decode([i]) for i in range(len(tok))])
    assert {k: st["config"][k] for k in SMALL} == SMALL and st["config"]["sentence_threshold"] == 0.95


def test_budget_covering_context_equals_dense(skipkv_servers: dict) -> None:
    """Contexts within the budget (multi-chunk prompts, decode past many intervals): queries and token ids are
    collected every step, nothing is compressed, the tokens are dense's."""
    covering_budget_equals_dense(skipkv_servers, ((40, 24), (200, 150), (450, 62)))


def test_small_budget_bounds_kv_slots_and_sentences_follow_the_ids(skipkv_servers: dict) -> None:
    server = skipkv_servers["small"]
    before = _flush(server)
    out = server.generate(input_ids=_ids(random.Random(1), 1500), max_new_tokens=200, ignore_eos=True)
    assert out["meta_info"]["completion_tokens"] == 200
    after = _assert_idle_and_sound(server)
    used = after["kv_slots_used"] - before["kv_slots_used"]
    # The prompt stays whole; decode compresses to the budget every 16 decoded positions: the 200 tokens wrote
    # 199 (written()), 12 x 16 + 7.
    assert used == SMALL["budget"] + 199 % SMALL["evict_interval"], used
    assert after["evicted_tokens_total"] - before["evicted_tokens_total"] == 1699 - used
    assert after["eviction_steps_total"] - before["eviction_steps_total"] == 199 // SMALL["evict_interval"]
    # The method segmented the output by its real ids: every output token but the last had its K/V written, and
    # each id is known when its step runs, so exactly those were segmented.
    stats = {k: after["method_stats"][k] - before.get("method_stats", {}).get(k, 0) for k in after["method_stats"]}
    boundaries = set(after["config"]["boundary_token_ids"])
    assert stats["sentences_closed_total"] == _closed_sentences(out["output_ids"][:-1], boundaries) > 0, stats
    assert stats["sentence_evicted_tokens_total"] <= stats["sentence_penalized_tokens_total"]


def test_chain_cache_three_turns(skipkv_servers: dict) -> None:
    server = skipkv_servers["small"]
    base = _flush(server)
    rng = random.Random(9)
    history, prev_len = _ids(rng, 700), None
    for turn in range(3):
        out = server.generate(input_ids=history, max_new_tokens=20, ignore_eos=True)
        meta = out["meta_info"]
        if prev_len is not None:  # the whole previous sequence matches; only the new suffix is prefilled
            assert meta["cached_tokens"] == prev_len, (turn, meta, prev_len)
            assert meta["prompt_tokens"] - meta["cached_tokens"] == 41  # the last answer token and 40 new
        st = _assert_idle_and_sound(server)
        # Each turn: the kept set + 41 new tokens, compressed to 512 at decoded 16, then 3 more (19 written).
        assert st["kv_slots_used"] - base["kv_slots_used"] == SMALL["budget"] + 3, (turn, st)
        prev_len = written(len(history), out["output_ids"])
        history = history + out["output_ids"] + _ids(rng, 40)
    assert _state(server)["chain_hits_total"] - base["chain_hits_total"] == 2


def test_aborts_mid_prefill_and_mid_decode_do_not_leak(skipkv_servers: dict) -> None:
    abort_mid_prefill_and_mid_decode(skipkv_servers["small"], random.Random(4), "skipkv")


def test_an_answer_alone_equals_beside_and_after_other_traffic(skipkv_servers: dict) -> None:
    alone_equals_beside_traffic(skipkv_servers["small"], random.Random(45), 900)
