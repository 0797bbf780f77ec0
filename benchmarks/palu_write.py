"""Palu's per-layer write at Llama-3-8B heads (8 KV heads of 128, a pool of 1M slots, bf16): the Triton kernel
(``kernels/palu_write.py``, what ``PaluStore.write`` runs on CUDA) against the store's torch path, each replayed
as a CUDA graph, at a few decode batches and a prefill chunk.

    python benchmarks/palu_write.py [--tokens 1 16 48 2048] [--ratios 0.5 0.75]
"""

from __future__ import annotations

import argparse

import torch
from graph_timing import graph_us
from quant_decode import HKV, HQ, D, llama3_model_kv

from sgl_sparse.contract import KVGeometry
from sgl_sparse.methods.compression.palu import PaluStore

SLOTS = 1 << 20


def _times(store: PaluStore, n: int) -> tuple[float, float]:
    """Microseconds a replay of one write of ``n`` tokens: the kernel's, the torch path's."""
    k, v = (torch.randn(n, HKV, D, device="cuda").to(torch.bfloat16) for _ in range(2))
    positions = torch.randint(0, 131072, (n,), device="cuda")
    loc = torch.randperm(SLOTS, device="cuda")[:n]
    rows = torch.zeros(n, dtype=torch.int64, device="cuda")
    kernel = graph_us(lambda: store.write(0, loc, k, v, rows, decode=True, positions=positions))
    return kernel, graph_us(lambda: store._write_torch(0, loc, k, v, positions))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 48, 2048])
    p.add_argument("--ratios", nargs="+", type=float, default=[0.5, 0.75])
    args = p.parse_args()
    model = llama3_model_kv()
    print("rank_ratio  tokens  kernel_us  torch_us")
    for ratio in args.ratios:
        store = PaluStore(ratio, 1)
        store.load_model(model)
        store.allocate(KVGeometry(1, HQ, HKV, D, 1, SLOTS, torch.bfloat16, torch.device("cuda")))
        for n in args.tokens:
            kernel, plain = _times(store, n)
            print(f"{ratio:10}  {n:6}  {kernel:9.1f}  {plain:8.1f}", flush=True)

if __name__ == "__main__":
    main()
