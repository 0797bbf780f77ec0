"""Side by side in one run: vanilla SGLang, then sgl_sparse, on the same trace, GPU and flags."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench_agent import report
from bench_agent.replay import RunResult, replay
from bench_agent.workload import Trace
from sgl_sparse.server_process import CPU_SERVER_FLAGS, VANILLA_CPU_FLAGS, ServerProcess

# Both servers report cached tokens in OpenAI usage only with --enable-cache-report.
COMMON = ["--enable-cache-report"]
# Vanilla's attention backend on GPU: FlashInfer (the fastest on the H200, and what ours wraps by default)
# or Triton. It comes after --server-args, so it wins over an --attention-backend there.
VANILLA_GPU_BACKENDS = ("flashinfer", "triton")


def compare(model_path: str, trace: Trace, tokenizer: Any, methods: list[tuple[str, str]], client: str = "openai",
            cpu: bool = False, server_args: list[str] | None = None, out_dir: str | Path = "bench_out",
            time_scale: float = 1.0, skip_vanilla: bool = False,
            vanilla_backend: str = "flashinfer", prune_lag: int | None = None,
            prune_roles: list[str] | None = None, prune_keep_ratio: float = 0.0,
            prune_policy: str = "knorm", prune_only: bool = False) -> list[RunResult]:
    """``methods``: (sparse_method, sparse_config JSON) pairs replayed after vanilla. ``vanilla_backend``:
    vanilla's ``--attention-backend`` on GPU (on CPU it is torch_native, as ours). ``prune_lag``: each method
    is replayed a second time in pruning mode (bench_agent/replay.py), labelled ``sgl_sparse:NAME+prune``;
    ``prune_only``: only in pruning mode (one replay fewer a method, where its plain run is measured already)."""
    if prune_only and prune_lag is None:
        raise ValueError("prune_only replays each method in pruning mode only: give prune_lag")
    if vanilla_backend not in VANILLA_GPU_BACKENDS:
        raise ValueError(f"vanilla_backend {vanilla_backend!r}: one of {', '.join(VANILLA_GPU_BACKENDS)}")
    base = [*COMMON, *(CPU_SERVER_FLAGS if cpu else []), *(server_args or [])]
    runs: list[tuple[str, str, list[str], int | None]] = []
    if not skip_vanilla:
        vanilla = VANILLA_CPU_FLAGS if cpu else ["--attention-backend", vanilla_backend]
        runs.append(("vanilla", "sglang.launch_server", [*base, *vanilla], None))
    for name, cfg in methods:
        flags = [*base, "--sparse-method", name, "--sparse-config", cfg]
        if not prune_only:
            runs.append((f"sgl_sparse:{name}", "sgl_sparse.launch_server", flags, None))
        if prune_lag is not None:
            # A dense server prunes only with compacted attention lists, which this flag turns on (an eviction
            # server has them already; a selection or quantization server cannot prune and its prunes fail).
            extra = ["--sparse-request-methods", "eviction"] if name == "dense" else []
            runs.append((f"sgl_sparse:{name}+prune", "sgl_sparse.launch_server", [*flags, *extra], prune_lag))
    results = []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for label, module, flags, lag in runs:
        log = out / f"{label.replace(':', '-')}.server.log"
        with ServerProcess(model_path, flags, module=module, startup_timeout=900, log_path=str(log)) as srv:
            results.append(replay(srv.base_url, trace, tokenizer, client=client, label=label,
                                  time_scale=time_scale, prune_lag=lag, prune_roles=prune_roles,
                                  prune_keep_ratio=prune_keep_ratio, prune_policy=prune_policy))
        # Each finished run is on disk before the next server starts (a run cut short keeps them).
        report.save(results, out, plots=False)
    return results
