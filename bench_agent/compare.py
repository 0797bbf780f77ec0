"""Side by side in one run: vanilla SGLang, then sgl_sparse, on the same trace, GPU and flags."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench_agent.replay import RunResult, replay
from bench_agent.workload import Trace
from sgl_sparse.server_process import CPU_SERVER_FLAGS, VANILLA_CPU_FLAGS, ServerProcess

# Both servers report cached tokens in OpenAI usage only with --enable-cache-report.
COMMON = ["--enable-cache-report"]
GPU_VANILLA = ["--attention-backend", "triton"]


def compare(model_path: str, trace: Trace, tokenizer: Any, methods: list[tuple[str, str]], client: str = "openai",
            cpu: bool = False, server_args: list[str] | None = None, out_dir: str | Path = "bench_out",
            time_scale: float = 1.0, skip_vanilla: bool = False) -> list[RunResult]:
    """``methods``: (sparse_method, sparse_config JSON) pairs replayed after vanilla."""
    base = [*COMMON, *(CPU_SERVER_FLAGS if cpu else []), *(server_args or [])]
    runs: list[tuple[str, str, list[str]]] = []
    if not skip_vanilla:
        runs.append(("vanilla", "sglang.launch_server", [*base, *(VANILLA_CPU_FLAGS if cpu else GPU_VANILLA)]))
    for name, cfg in methods:
        runs.append((f"sgl_sparse:{name}", "sgl_sparse.launch_server",
                     [*base, "--sparse-method", name, "--sparse-config", cfg]))
    results = []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for label, module, flags in runs:
        log = out / f"{label.replace(':', '-')}.server.log"
        with ServerProcess(model_path, flags, module=module, startup_timeout=900, log_path=str(log)) as srv:
            results.append(replay(srv.base_url, trace, tokenizer, client=client, label=label,
                                  time_scale=time_scale))
    return results
