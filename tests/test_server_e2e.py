"""End to end against real SGLang 0.5.17 servers on CPU: ours (``dense``) and vanilla, tiny model.

Marked ``server``: each module start costs ~30 s on two cores (both servers start in parallel).
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests
import sglang as sgl

from sgl_sparse.server_process import ServerProcess

pytestmark = pytest.mark.server


def test_server_uses_our_tree_and_attention_backend(server: ServerProcess) -> None:
    info = server.server_info()
    assert info["attention_backend"] == "sgl_sparse"
    assert info["radix_cache_backend"] == "sgl_sparse"
    state = info["internal_states"][0]["sgl_sparse"]
    assert state["method"] == "dense"
    assert state["tree_class"] == "SparseRadixCache"
    assert state["attention_backend_class"] == "SparseTorchNativeBackend"
    assert state["kv_slots_total"] == 16384
    assert 0 <= state["kv_slots_used"] <= state["kv_slots_total"]


def test_vanilla_server_does_not_report_sgl_sparse(servers: dict[str, ServerProcess]) -> None:
    info = servers["vanilla"].server_info()
    assert info["attention_backend"] == "torch_native"
    assert "sgl_sparse" not in info["internal_states"][0]


def test_generate(server: ServerProcess) -> None:
    out = server.generate("def parse_args(argv):", max_new_tokens=12)
    assert len(out["output_ids"]) == 12
    assert out["meta_info"]["completion_tokens"] == 12
    assert isinstance(out["text"], str) and out["text"]


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    lengths = [5, 37, 128, 300, 700]  # 300 and 700 span several 128-token prefill chunks
    return [[rng.randrange(8, 2048) for _ in range(n)] for n in lengths]


def test_greedy_equals_vanilla_token_for_token(servers: dict[str, ServerProcess]) -> None:
    for ids in _prompts():
        ours = servers["ours"].generate(input_ids=ids, max_new_tokens=24, ignore_eos=True)
        vanilla = servers["vanilla"].generate(input_ids=ids, max_new_tokens=24, ignore_eos=True)
        assert ours["output_ids"] == vanilla["output_ids"], f"prompt of {len(ids)} tokens diverged"


def test_greedy_equals_vanilla_concurrent_batch(servers: dict[str, ServerProcess]) -> None:
    """Batched decode (several requests in one forward) must not change tokens either."""
    prompts = _prompts()

    def run(name: str) -> list[list[int]]:
        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = pool.map(lambda ids: servers[name].generate(input_ids=ids, max_new_tokens=16,
                                                               ignore_eos=True), prompts)
            return [o["output_ids"] for o in outs]

    assert run("ours") == run("vanilla")


def _multi_turn(server: ServerProcess, seed: int) -> list[dict]:
    rng = random.Random(seed)
    history: list[int] = [rng.randrange(8, 2048) for _ in range(200)]
    turns = []
    for _ in range(4):
        out = server.generate(input_ids=history, max_new_tokens=20, ignore_eos=True)
        turns.append({"prompt_len": len(history), **out})
        history = history + out["output_ids"] + [rng.randrange(8, 2048) for _ in range(60)]
    return turns


def test_four_turn_conversation_cached_tokens_grow(servers: dict[str, ServerProcess]) -> None:
    turns = _multi_turn(servers["ours"], seed=11)
    cached = [t["meta_info"]["cached_tokens"] for t in turns]
    assert all(b > a for a, b in zip(cached, cached[1:])), cached
    for prev, cur in zip(turns, turns[1:]):
        # The previous prompt and (all but possibly the last) output token are reused.
        assert cur["meta_info"]["cached_tokens"] >= prev["prompt_len"] + len(prev["output_ids"]) - 1
    vanilla = _multi_turn(servers["vanilla"], seed=11)
    assert [t["output_ids"] for t in turns] == [t["output_ids"] for t in vanilla]


def test_openai_chat_completions_http_and_client(server: ServerProcess) -> None:
    messages = [
        {"role": "system", "content": "You are a helpful agent."},
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": "Calling ls."},
        {"role": "tool", "content": "README.md\npyproject.toml\nsgl_sparse/"},
        {"role": "user", "content": "Which one is the package?"},
    ]
    r = requests.post(f"{server.base_url}/v1/chat/completions", timeout=120,
                      json={"model": "tiny", "messages": messages, "max_tokens": 10, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 10
    http_text = body["choices"][0]["message"]["content"]

    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    resp = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert resp.choices[0].message.content == http_text
    assert resp.usage is not None and resp.usage.prompt_tokens == body["usage"]["prompt_tokens"]
    # Same prompt again: the prefix comes from the tree.
    assert resp.usage.prompt_tokens_details is None or resp.usage.prompt_tokens_details.cached_tokens > 0


def test_openai_rejects_bad_request(server: ServerProcess) -> None:
    r = requests.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                      json={"model": "tiny", "messages": "not a list"})
    assert 400 <= r.status_code < 500


@sgl.function
def _agent_program(s, task: str):  # type: ignore[no-untyped-def]
    s += "Task: " + task + "\n"
    for i in range(3):
        s += f"Step {i}: "
        s += sgl.gen(f"step{i}", max_tokens=8, temperature=0)
        s += f"\nTool result {i}: ok\n"


def test_frontend_language_program(server: ServerProcess) -> None:
    backend = sgl.RuntimeEndpoint(server.base_url)
    state = _agent_program.run(task="summarise the repository", backend=backend)
    steps = [state[f"step{i}"] for i in range(3)]
    assert all(isinstance(s, str) for s in steps)
    assert "Tool result 2: ok" in state.text()
    # Each sgl.gen extends the same prefix, so later calls hit the tree.
    assert state.get_meta_info("step2")["cached_tokens"] > state.get_meta_info("step0")["cached_tokens"]
