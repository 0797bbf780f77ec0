"""Tensor parallelism: the all-reduce an evicting method's scores go through before it selects.

Under ``--tp-size N`` every TP rank runs its own scheduler, prefix tree and allocator over the same requests,
and SGLang keeps them in lock-step only by running the same decisions on the same inputs (no per-step sync of
allocator or tree state; docs/parallelism.md). Each rank's attention holds its own shard of the heads, so the
window scores a rank computes cover its heads only: kept sets picked from them would differ between ranks,
their free counts and admissions would diverge, and the next collective of the model would hang. The scored-eviction
base (:class:`sgl_sparse.methods.eviction.base.ScoredEviction`) therefore sums its methods' per-position scores over
the TP group through the reducer this module hands to every observation window; scores that are maxima over heads
(KVzip's replay forwards, a prune's ``kvzip_global``) take their maximum over the ranks instead
(``StepInfo.max_over_ranks``).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from sgl_sparse.contract import AllReduce, MaxOverRanks

# SGLSPARSE_TP_CHECK=1: after every eviction step, check that every TP rank planned the same keep sets (one
# extra all-reduce per step; the TP server tests turn it on). Read once: the schedulers inherit it.
TP_CHECK = os.environ.get("SGLSPARSE_TP_CHECK") == "1"


@functools.cache
def _tp_group() -> Any:
    """SGLang's TP group coordinator of this scheduler (``None`` with one rank). Resolved once per process, after
    SGLang set up its groups (the first eviction step runs after the model's first forward)."""
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
    return group


@functools.cache
def scores_all_reduce() -> AllReduce | None:
    """The sum over this scheduler's TP group (``None`` with one rank): SGLang's own group coordinator, so on
    GPU NCCL (or SGLang's custom all-reduce) on the current stream, on CPU gloo (or SGLang's shared-memory
    kernel), as the model's own all-reduces."""
    group = _tp_group()
    if group is None:
        return None

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        # SGLang's all_reduce may work in place and return its input: reduce a copy, so the caller's
        # tensor stays this rank's.
        return group.all_reduce(t.clone())

    return all_reduce


@functools.cache
def scores_max_over_ranks() -> MaxOverRanks | None:
    """The element-wise maximum over this scheduler's TP group (``None`` with one rank), for scores that are
    maxima over heads (KVzip's replays): through the group's gloo group on the host, where those scores live (a
    device tensor comes back to its device), so it needs no NCCL max and no device sync beyond the copy."""
    group = _tp_group()
    if group is None:
        return None

    def max_over_ranks(t: torch.Tensor) -> torch.Tensor:
        host = t.detach().to("cpu", torch.float32, copy=True).contiguous()
        torch.distributed.all_reduce(host, op=torch.distributed.ReduceOp.MAX, group=group.cpu_group)
        return host.to(t.device)

    return max_over_ranks


def check_ranks_agree(keeps: list[torch.Tensor]) -> None:
    """Raise if another TP rank planned other keep sets this step (``SGLSPARSE_TP_CHECK``). Diverged sets would
    otherwise show only later (different free counts, then admissions, then a hang in a model collective).

    Every rank calls it once per step, plans or none, so the collectives stay matched even when the ranks
    disagree on whether to evict. A rank's digest ``v`` (plan count, kept count, sum of positions, a bounded sum
    of squares; float64, exact for these sizes) equals the group's mean exactly when every rank's does."""
    group = _tp_group()
    if group is None:
        return
    digest = torch.zeros(4, dtype=torch.float64)
    digest[0] = len(keeps)
    for k in keeps:
        k64 = k.to(torch.float64)
        digest[1] += k.numel()
        digest[2] += k64.sum()
        digest[3] += ((k % 9973).to(torch.float64) ** 2).sum()
    # On the host, through the group's gloo group: the digest is built from host keep sets (no device copy).
    total = digest.clone()
    torch.distributed.all_reduce(total, group=group.cpu_group)
    if not torch.equal(total, digest * group.world_size):
        raise RuntimeError(f"sgl_sparse: TP ranks planned different keep sets this step (this rank's digest "
                           f"{digest.tolist()}, the group's sum {total.tolist()} over {group.world_size} ranks)")
