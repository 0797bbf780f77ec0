"""A conversation's next turn under a method that evicts during decode must not depend on other traffic (CPU
servers, tiny model; found by a review).

* Copy-on-write: when every position a conversation hid lies in a prefix another conversation shares, nothing is
  freed, so its path has no hole. A next turn that leaves the previous answer before the record's ``since`` (no
  Chain Cache continuation) got a "dense" match running on into the positions the conversation computed under its
  sparse view; alone, the hole stopped the match first. The tree now marks a finished sequence's K/V computed under
  a sparse view (``RequestState.sparse_from``) and a dense match stops there.
* Overlap scheduling (SGLang's default, on CPU too) launches a decode forward before it sees that the previous
  one finished a request, so that forward writes the finished request's last token. Its step used to run like any
  other (an eviction due at that count changed the turn's record), and whether it ran at all depended on the next
  iteration being a decode rather than another request's prefill. A decode token's step now waits for the
  previous results (``integration/step.py``) and skips finished requests; the tree frees that last position.
"""

from __future__ import annotations

import json
import random

import pytest

from sgl_sparse.server_process import CPU_SERVER_FLAGS, ServerProcess
from tests.server_pool import ServerPool, spec
from tests.test_eviction_e2e import _assert_idle_and_sound as _idle
from tests.test_eviction_e2e import _flush, _state, streaming_spec

pytestmark = pytest.mark.server
FLAGS = [*CPU_SERVER_FLAGS, "--chunked-prefill-size", "128", "--enable-cache-report"]


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(8, 2000) for _ in range(n)]


def _gen(server: ServerProcess, ids: list[int], n: int) -> dict:
    return server.generate(input_ids=ids, max_new_tokens=n, ignore_eos=True)


def test_a_shared_prefix_does_not_let_a_next_turn_read_kv_computed_under_a_sparse_view(
        tiny_model: str, server_pool: ServerPool) -> None:
    """StreamingLLM (sink 16, recent 128): A's first turn (a 140-token system prompt + 10) evicts only positions of
    the system prompt, which B shares after B ran first. A's next turn leaves the answer 10 tokens before its end
    (before the last eviction: not a continuation). With or without B it must read only K/V computed with a dense
    view (the prompt, up to A's first eviction) and answer the same."""
    rng = random.Random(11)
    system, a, b, q = _ids(rng, 140), _ids(rng, 10), _ids(rng, 4), _ids(rng, 5)
    with server_pool.use(streaming_spec(tiny_model)) as (server,):
        def conversation_a() -> dict:
            first = _gen(server, system + a, 40)["output_ids"]
            _idle(server)
            second = _gen(server, system + a + first[:30] + q, 16)
            _idle(server)
            return {"first": first, "cached": second["meta_info"]["cached_tokens"], "second": second["output_ids"]}

        _flush(server)
        alone = conversation_a()
        _flush(server)
        _gen(server, system + b, 2)  # B: 144 tokens, within the budget: evicts nothing, keeps the prompt whole
        _idle(server)
        after_b = conversation_a()
    assert alone["first"] == after_b["first"]
    # A's prompt (150 tokens) evicted at its end: positions past it were computed under the sparse view.
    assert alone["cached"] <= 150 and after_b["cached"] <= 150, (alone["cached"], after_b["cached"])
    assert after_b["second"] == alone["second"]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_no_step_runs_for_a_request_after_its_last_token(tiny_model: str, server_pool: ServerPool,
                                                         overlap: bool) -> None:
    """StreamingLLM (sink 4, recent 16, interval 8) compacts once more than 28 positions are retained: a 40-token
    prompt keeps 20, and 9 new tokens take 8 decode forwards, which bring it to 28. Without overlap scheduling
    nothing more runs. With it, a 9th forward writes the last token; its step used to evict (29 > 28) and leave a
    record of 20 positions of 49. Now the record is the one without overlap: 28 of 48, and the next turn resumes
    from 48 cached tokens, with and without ``--disable-overlap-schedule``."""
    rng = random.Random(5)
    prompt, q = _ids(rng, 40), _ids(rng, 6)
    config = json.dumps({"sink_tokens": 4, "recent_tokens": 16, "evict_interval": 8})
    flags = [*FLAGS, "--sparse-method", "streamingllm", "--sparse-config", config,
             *([] if overlap else ["--disable-overlap-schedule"])]
    with server_pool.use(spec(tiny_model, flags), once=True) as (server,):
        base = _flush(server)
        out = _gen(server, prompt, 9)["output_ids"]
        st = _idle(server)
        assert st["eviction_steps_total"] - base["eviction_steps_total"] == 1, st  # the prompt's only
        assert st["kv_slots_used"] - base["kv_slots_used"] == 28, st
        nxt = _gen(server, prompt + out + q, 2)
        _idle(server)
        assert nxt["meta_info"]["cached_tokens"] == 48, nxt["meta_info"]
        assert _state(server)["chain_hits_total"] - base["chain_hits_total"] == 1
