"""Union held vs per-layer sets read by PyramidKV on the CPU server (method_stats of /server_info): the tiny random
test model and quality-small (trained). Run from the repository root with the server lock held:

    flock /tmp/sgl_sparse_server.lock python benchmarks/results/2026-12-02-pyramidkv-cpu/union_vs_layers.py
"""

from __future__ import annotations

import json
import random
import tempfile

from sgl_sparse.quality.tasks import make_example
from sgl_sparse.server_process import CPU_SERVER_FLAGS, ServerProcess
from sgl_sparse.tiny_model import write_tiny_model


def _server(model: str, config: dict) -> ServerProcess:
    return ServerProcess(model, [*CPU_SERVER_FLAGS, "--chunked-prefill-size", "512", "--sparse-method", "pyramidkv",
                                 "--sparse-config", json.dumps(config)], startup_timeout=900)


def _stats(srv: ServerProcess) -> dict:
    return srv.server_info()["internal_states"][0]["sgl_sparse"]["method_stats"]


def main() -> None:
    rng = random.Random(1)
    tiny = str(write_tiny_model(tempfile.mkdtemp()))
    with _server(tiny, {"budget": 512, "window_size": 16, "sink_tokens": 8}) as srv:
        for _ in range(3):
            srv.generate(input_ids=[rng.randrange(8, 2048) for _ in range(1500)], max_new_tokens=4, ignore_eos=True)
        print("tiny random, budget 512:", json.dumps(_stats(srv)))
    prompts = [make_example(t, 10_000 + i, 1500).prompt
               for t in ("niah_single", "niah_multivalue", "vartrack", "freqword") for i in range(2)]
    with _server("sgl_sparse/assets/quality-small", {"budget": 512}) as srv:
        lens = [srv.generate(text=p, max_new_tokens=4, ignore_eos=True)["meta_info"]["prompt_tokens"] for p in prompts]
        print("quality-small, budget 512, prompt tokens", lens, ":", json.dumps(_stats(srv)))


if __name__ == "__main__":
    main()
