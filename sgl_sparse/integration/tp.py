"""Tensor parallelism: the all-reduce an evicting method's scores go through before it selects.

Under ``--tp-size N`` every TP rank runs its own scheduler, prefix tree and allocator over the same requests,
and SGLang keeps them in lock-step only by running the same decisions on the same inputs (no per-step sync of
allocator or tree state; docs/parallelism.md). Each rank's attention holds its own shard of the heads, so the
window scores a rank computes cover its heads only: kept sets picked from them would differ between ranks,
their free counts and admissions would diverge, and the next collective of the model would hang. The methods
therefore sum their per-position scores over the TP group (:meth:`ObservationWindow.reduce_heads`) through
the reducer this module hands to every observation window.
"""

from __future__ import annotations

import functools

import torch

from sgl_sparse.contract import AllReduce


@functools.cache
def scores_all_reduce() -> AllReduce | None:
    """The sum over this scheduler's TP group (``None`` with one rank): SGLang's own group coordinator, so on
    GPU it is NCCL (or SGLang's custom all-reduce) on the current stream and on CPU gloo (or SGLang's
    shared-memory kernel), as the model's own all-reduces. Resolved once per process, after SGLang set up its
    groups (the first observation runs after the model's first forward)."""
    from sglang.srt.distributed.parallel_state import get_attn_tp_group, get_tp_group

    group = get_tp_group()
    if group.world_size == 1:
        return None
    attn = get_attn_tp_group()
    if attn.world_size != group.world_size:
        # The heads are sharded over the attention TP group; with DP attention (refused by the launcher) it is
        # smaller than the TP group and the ranks do not share requests, so a sum over the TP group is wrong.
        raise RuntimeError(f"sgl_sparse: attention TP size {attn.world_size} != TP size {group.world_size} "
                           "(DP attention): eviction scores cannot be summed over the TP group")

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        # SGLang's all_reduce may work in place and return its input: reduce a copy, so the caller's
        # tensor stays this rank's.
        return group.all_reduce(t.clone())

    return all_reduce
