"""The main job in one command: start our server, run a multi-turn agent program, print, stop.

    python -m sgl_sparse.demo [--model-path DIR] [--sparse-method NAME --sparse-config JSON] [--device cpu]

Without ``--model-path`` it serves the small model we trained and ship (``sgl_sparse/assets/quality-small``,
~4M parameters, 2K context). The program is an SGLang frontend-language function: an agent session whose
tool results carry facts (service ports); each turn appends a tool result and generates, so every turn
extends the previous one's prefix and the server reports the reused (cached) tokens; the last turn asks
for a fact from an earlier tool result, and the model answers it from the KV cache.
"""

from __future__ import annotations

import argparse

import sglang as sgl

from sgl_sparse.quality.models import small_model_path
from sgl_sparse.server_process import CPU_SERVER_FLAGS, ServerProcess

TOOL_RESULTS = [
    "ls: README.md pyproject.toml sgl_sparse tests. The port of service amber is 48213. Listed four entries.",
    "cat pyproject.toml: the package is sgl-sparse, it depends on sglang. The port of service cobalt is 90417.",
    "pytest: all tests passed. The port of service raven is 31562. Coverage was not measured.",
]
QUESTION, ANSWER = "What is the port of service cobalt?", "90417"


@sgl.function
def agent_session(s, task: str, tool_results: list[str], question: str):  # type: ignore[no-untyped-def]
    # The chat template the model was trained with (tiny_model.CHAT_TEMPLATE), written out.
    s += f"<|system|>You are a coding agent.<|end|><|user|>{task}<|end|>"
    for i, result in enumerate(tool_results):
        s += "<|assistant|>"
        s += sgl.gen(f"turn{i}", max_tokens=8, temperature=0, stop="<|end|>")
        s += f"<|end|><|tool|>{result}<|end|>"
    s += f"<|user|>{question}<|end|><|assistant|>"
    s += sgl.gen("answer", max_tokens=12, temperature=0, stop="<|end|>")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="default: the small trained model we ship")
    p.add_argument("--sparse-method", default="dense")
    p.add_argument("--sparse-config", default="{}")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = p.parse_args(argv)

    model = args.model_path or str(small_model_path())
    flags = CPU_SERVER_FLAGS if args.device == "cpu" else []
    flags = [*flags, "--sparse-method", args.sparse_method, "--sparse-config", args.sparse_config]
    print(f"starting: python -m sgl_sparse.launch_server --model-path {model} {' '.join(flags)}")
    with ServerProcess(model, flags) as server:
        state = agent_session.run(task="Inspect the service configuration.", tool_results=TOOL_RESULTS,
                                  question=QUESTION, backend=sgl.RuntimeEndpoint(server.base_url))
        names = [f"turn{i}" for i in range(len(TOOL_RESULTS))] + ["answer"]
        print(f"\n{'turn':<7}{'prompt tokens':>14}{'cached tokens':>15}  generated")
        for name in names:
            meta = state.get_meta_info(name)
            print(f"{name:<7}{meta['prompt_tokens']:>14}{meta['cached_tokens']:>15}  {state[name]!r}")
        print(f"\nquestion: {QUESTION}\nanswer:   {state['answer'].strip()!r} (expected {ANSWER!r})")
        sparse = server.server_info()["internal_states"][0]["sgl_sparse"]
        print(f"\nserver: method={sparse['method']} tree={sparse['tree_class']} "
              f"attention={sparse['attention_backend_class']} kv_slots_used={sparse['kv_slots_used']}")
    print("server stopped")


if __name__ == "__main__":
    main()
