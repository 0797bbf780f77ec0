"""KV pool capacity per quantized layout and bit width, and the largest batch of long requests that fits, from each
store's own sizing (``KVStore.bytes_per_token`` and ``fixed_bytes``, what SGLang's memory planner divides the KV
budget by in our server) against a measured budget. No GPU needed.

    python benchmarks/pool_capacity.py [--budget-tokens 788603] [--request-tokens 130256]

``--budget-tokens``: vanilla's pool on the machine (tokens of a bf16 cell; 788,603 on an H200 at
``--mem-fraction-static 0.80`` with Llama-3-8B's shape, BENCHMARKS.md), so the budget is that times the bf16 cell.
``--request-tokens``: one request's tokens (130,000 in + 256 out). ``--max-running-requests``: the per-request rows a
layout with per-request buffers (KIVI's residual) takes from the budget (the launcher's default, 64, + 1). The
served FP8 run checks the arithmetic: 1,529,411 computed, 1,529,413 served.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from sgl_sparse.contract import KVGeometry
from sgl_sparse.registry import create_method

LAYOUTS: list[tuple[str, dict[str, Any]]] = [
    ("fp8_kv", {}), ("kivi", {"bits": 4}), ("kivi", {"bits": 2}), ("turboquant", {"bits": 4}),
    ("turboquant", {"bits": 3}), ("turboquant", {"bits": 2}), ("turboquant", {"bits": 4, "qjl": True}),
    ("turboquant", {"bits": 2, "qjl": True}),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-tokens", type=int, default=788_603)
    p.add_argument("--request-tokens", type=int, default=130_256)
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    a = p.parse_args()

    def geometry(page: int) -> KVGeometry:
        return KVGeometry(num_layers=a.layers, num_q_heads=4 * a.kv_heads, num_kv_heads=a.kv_heads,
                          head_dim=a.head_dim, page_size=page, num_slots=1, dtype=torch.bfloat16,
                          device=torch.device("cpu"), max_requests=a.max_running_requests + 1)

    bf16_cell = a.layers * 2 * a.kv_heads * a.head_dim * 2
    budget = a.budget_tokens * bf16_cell
    print(f"KV budget {budget / 1e9:.1f} GB ({a.budget_tokens:,} bf16 tokens of {bf16_cell:,} bytes), requests of "
          f"{a.request_tokens:,} tokens")
    print("| layout | bytes / token | fixed bytes | pool tokens | x bf16 | largest batch |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(f"| vanilla bf16 | {bf16_cell:,} | 0 | {a.budget_tokens:,} | 1.00 | {a.budget_tokens // a.request_tokens} |")
    for name, config in LAYOUTS:
        store = create_method(name, config).store
        assert store is not None
        page = max(1, store.page_size)
        g = geometry(page)
        per_token, fixed = store.bytes_per_token(g), store.fixed_bytes(g)
        tokens = (budget - fixed) // per_token // page * page
        per_request = -(-a.request_tokens // page) * page
        label = f"{name} {config}" if config else name
        print(f"| {label} | {per_token:,} | {fixed:,} | {tokens:,} | {tokens / a.budget_tokens:.2f} | "
              f"{tokens // per_request} |")


if __name__ == "__main__":
    main()
