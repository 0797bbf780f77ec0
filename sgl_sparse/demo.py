"""The main job in one command: start our server, run a multi-turn agent program, print, stop.

    python -m sgl_sparse.demo [--model-path DIR] [--sparse-method NAME --sparse-config JSON] [--device cpu]

Without ``--model-path`` it writes the tiny test model (random weights: the text is noise, the
serving path is real) to a temporary folder. The program is an SGLang frontend-language function:
each turn appends a tool result and generates, so every turn extends the previous one's prefix and
the server reports the reused (cached) tokens.
"""

from __future__ import annotations

import argparse
import tempfile

import sglang as sgl

from sgl_sparse.server_process import CPU_SERVER_FLAGS, ServerProcess
from sgl_sparse.tiny_model import write_tiny_model

TOOL_RESULTS = [
    "ls: README.md pyproject.toml sgl_sparse/ tests/",
    "cat pyproject.toml: name = sgl-sparse, dependencies = sglang==0.5.17",
    "pytest: 40 passed",
]


@sgl.function
def agent_session(s, task: str, tool_results: list[str]):  # type: ignore[no-untyped-def]
    s += f"<|system|>You are a coding agent.<|end|><|user|>{task}<|end|>"
    for i, result in enumerate(tool_results):
        s += "<|assistant|>"
        s += sgl.gen(f"turn{i}", max_tokens=16, temperature=0)
        s += f"<|end|><|tool|>{result}<|end|>"
    s += "<|assistant|>"
    s += sgl.gen("final", max_tokens=16, temperature=0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="default: the tiny test model, written to a temp dir")
    p.add_argument("--sparse-method", default="dense")
    p.add_argument("--sparse-config", default="{}")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model_path or str(write_tiny_model(tmp))
        flags = CPU_SERVER_FLAGS if args.device == "cpu" else []
        flags = [*flags, "--sparse-method", args.sparse_method, "--sparse-config", args.sparse_config]
        print(f"starting: python -m sgl_sparse.launch_server --model-path {model} {' '.join(flags)}")
        with ServerProcess(model, flags) as server:
            state = agent_session.run(task="Find the package name.", tool_results=TOOL_RESULTS,
                                      backend=sgl.RuntimeEndpoint(server.base_url))
            names = [f"turn{i}" for i in range(len(TOOL_RESULTS))] + ["final"]
            print(f"\n{'turn':<7}{'prompt tokens':>14}{'cached tokens':>15}  generated")
            for name in names:
                meta = state.get_meta_info(name)
                print(f"{name:<7}{meta['prompt_tokens']:>14}{meta['cached_tokens']:>15}  {state[name]!r}")
            sparse = server.server_info()["internal_states"][0]["sgl_sparse"]
            print(f"\nserver: method={sparse['method']} tree={sparse['tree_class']} "
                  f"attention={sparse['attention_backend_class']} kv_slots_used={sparse['kv_slots_used']}")
        print("server stopped")


if __name__ == "__main__":
    main()
