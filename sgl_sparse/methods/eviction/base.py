"""Shared logic of the eviction family: :class:`ScoredEviction`, the base of every method that scores the retained
positions and keeps the best (as kvpress's ``ScorerPress``), the window scores SnapKV-like methods share, and the
budgeted selections.

A scored method writes :meth:`ScoredEviction.score` (this rank's heads' score of each retained position),
:meth:`ScoredEviction.budget` and when to score (``wants_observation``); the base reduces the scores over the
tensor-parallel group and keeps the top ones. Under ``--tp-size N`` each rank holds a shard of the heads, and every
rank must keep the identical set (each frees the same slots of its own pool and its scheduler admits from the same
free count; diverging sets mean diverging allocators, then a hang in the next collective of the model). The base
sums the scores over the ranks before selecting, once per scored window on every rank (the window exists on every
rank exactly when ``wants_observation``, which reads replicated data only), and :func:`topk_keep` breaks ties by
position, so every rank picks the same set.
"""

from __future__ import annotations

import dataclasses
from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar, TypeVar, final

import torch
import torch.nn.functional as F

from sgl_sparse.config import MethodConfig
from sgl_sparse.contract import Family, KeepPlan, ObservationWindow, RequestState, SparseMethod, StepInfo
from sgl_sparse.slots import to_device

POOLINGS = ("avgpool", "maxpool")
WINDOW = "eviction_window"  # state.extra: this step's observation window, scored in on_step_end

C = TypeVar("C", bound=MethodConfig)


def sink_recent_keep(kept: torch.Tensor, sink: int, recent: int) -> torch.Tensor:
    """The first ``sink`` and last ``recent`` retained positions (StreamingLLM's attention sink)."""
    if kept.numel() <= sink + recent:
        return kept
    return torch.cat([kept[:sink], kept[kept.numel() - recent:]])


def topk_keep(kept: torch.Tensor, scores: torch.Tensor, budget: int, sink: int, window: int) -> torch.Tensor:
    """Keep ``budget`` of the retained positions ``kept`` (sorted): the first ``sink``, the last
    ``window``, and the highest ``scores`` (aligned with ``kept``) among the rest. Ties go to the
    earlier position (``torch.topk`` on CPU is not stable, so the order is made explicit)."""
    n = kept.numel()
    if n <= budget:
        return kept
    lo, hi = min(sink, n), max(n - window, min(sink, n))
    middle = scores[lo:hi].float().cpu()
    take = budget - lo - (n - hi)
    if take <= 0:
        chosen = torch.empty(0, dtype=torch.long)
    else:
        # Stable: sort by (-score, index).
        order = torch.argsort(-middle, stable=True)[:take]
        chosen = order.sort().values + lo
    idx = torch.cat([torch.arange(lo), chosen, torch.arange(hi, n)])
    return kept[idx]


def compacts_now(state: RequestState, step: StepInfo, budget: int, interval: int, prompt: bool = True) -> bool:
    """Whether a method that compacts over ``budget`` does so this step: more than ``budget`` retained, and the
    prompt's end (``prompt``) or every ``interval``-th decoded token (0: never in decode). Replicated data only."""
    if state.num_kept <= budget:
        return False
    if step.is_prefill:
        return prompt and step.final_prefill
    return interval > 0 and step.decoded_tokens % interval == 0


def per_head_scores_torch(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """``[Hkv, n]``: each key's softmax probability summed over window queries and GQA group (the CPU
    path; materializes ``[Hkv, G, w, n]`` float32 logits)."""
    w, n_heads, d = q.shape
    n_kv = k.shape[1]
    qf = q.float().view(w, n_kv, n_heads // n_kv, d)
    logits = torch.einsum("wgjd,ngd->gjwn", qf, k.float()) * scale
    logits = logits.masked_fill(k_pos[None, None, None, :] > q_pos[None, None, :, None], float("-inf"))
    return logits.softmax(-1).nan_to_num(0.0).sum(dim=(1, 2))


def window_scores(q: torch.Tensor, k_buffer: torch.Tensor, k_rows: torch.Tensor, q_pos: torch.Tensor,
                  k_pos: torch.Tensor, scale: float, kernel_size: int, pooling: str) -> torch.Tensor:
    """Score of each key position for one layer: ``[n]`` (float32).

    q ``[w, H, D]``; key ``i`` is ``k_buffer[k_rows[i]]`` (``[Hkv, D]``) at position ``k_pos[i]``.
    Causal by logical position (a window query never sees a later key). On GPU a Triton kernel
    streams the keys from the buffer in place (:mod:`sgl_sparse.kernels.window_scores`)."""
    if k_buffer.is_cuda:
        from sgl_sparse.kernels.window_scores import window_scores_per_head

        per_head: torch.Tensor = window_scores_per_head(q, k_buffer, q_pos, k_pos, scale, k_rows=k_rows)
    else:
        per_head = per_head_scores_torch(q, k_buffer[k_rows], q_pos, k_pos, scale)
    pad = kernel_size // 2
    if kernel_size > 1:
        if pooling == "avgpool":
            pooled = F.avg_pool1d(per_head[:, None, :], kernel_size, stride=1, padding=pad, count_include_pad=False)
        else:
            pooled = F.max_pool1d(per_head[:, None, :], kernel_size, stride=1, padding=pad)
        per_head = pooled[:, 0, :]
    return per_head.sum(0)


def observation_scores(window: ObservationWindow, kernel_size: int, pooling: str) -> torch.Tensor:
    """``[n]``: :func:`window_scores` of ``window``'s retained keys summed over its layers (this rank's heads). Also
    the scored keep ``snapkv_global`` of a request's own prune (:mod:`sgl_sparse.prune.keep`)."""
    total: torch.Tensor | None = None
    on_device: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # copied once, not per layer
    for layer in range(window.num_layers):
        buf = window.key_buffer(layer)
        if on_device is None:
            on_device = (to_device(window.key_rows, buf.device), to_device(window.q_pos, buf.device),
                         to_device(window.k_pos, buf.device))
        s = window_scores(window.queries[layer], buf, *on_device, window.scale, kernel_size, pooling)
        total = s if total is None else total + s
    assert total is not None
    return total


def last_queries(window: ObservationWindow, n: int) -> ObservationWindow:
    """``window`` with only its last ``n`` queries of every layer."""
    return dataclasses.replace(window, queries={layer: q[-n:] for layer, q in window.queries.items()},
                               q_pos=window.q_pos[-n:])


def over_all_heads(window: ObservationWindow, scores: torch.Tensor, mean: bool = False) -> torch.Tensor:
    """``scores`` of this rank's heads -> of every head of the model: their sum over the TP group, or (``mean``, for
    scores averaged over this rank's KV heads) the mean over every KV head. After it every rank holds bitwise the
    same scores (NCCL and gloo return one result to all ranks). Identity without TP."""
    if window.all_reduce is None:
        return scores
    if not mean:
        return window.all_reduce(scores.float().contiguous())
    # The mean over every head is the sum over the ranks of (local mean x local heads) over the sum of the ranks'
    # head counts: one all-reduce carries both.
    heads = window.key_buffer(0).shape[1] if window.num_layers else 0
    both = window.all_reduce(torch.cat([scores * heads, scores.new_tensor([float(heads)])]).float().contiguous())
    return both[:-1] / both[-1]


@dataclass(frozen=True)
class Budget:
    """What a compaction keeps: ``keep`` retained positions, the first ``sink`` and the last ``recent`` of them
    whatever their scores, the best-scored others up to ``keep``."""

    keep: int
    sink: int = 0
    recent: int = 0


class ScoredEviction(SparseMethod[C]):
    """An eviction method that scores the retained positions with an observation window and keeps the best.

    Write :meth:`score`, :meth:`budget`, ``observation_window`` and ``wants_observation`` (when to score; e.g.
    :func:`compacts_now`). The base keeps the window of the step (``on_observation``) and, at its end
    (``on_step_end``), scores it, reduces the scores over the TP group (:func:`over_all_heads`; ``head_mean``:
    the scores are means over this rank's KV heads, else sums over its heads) and returns the top positions by
    :meth:`budget`. Scoring at the step's end lets a method first take in the step's tokens (SkipKV's sentences).
    """

    family = Family.EVICTION
    evicts = True
    head_mean: ClassVar[bool] = False

    @abstractmethod
    def score(self, state: RequestState, window: ObservationWindow) -> torch.Tensor:
        """``[m]`` float scores of the first ``m`` retained positions (``window.k_pos[:m]``; ``m < n`` only when the
        positions after them are kept regardless, :attr:`Budget.recent`), from this rank's heads only."""

    @abstractmethod
    def budget(self) -> Budget:
        """What a compaction keeps."""

    def on_observation(self, state: RequestState, window: ObservationWindow) -> None:
        state.extra[WINDOW] = window

    def on_step_end(self, state: RequestState, step: StepInfo) -> KeepPlan | None:
        scored = self.scores(state)
        return None if scored is None else self.keep(state, *scored)

    @final
    def scores(self, state: RequestState) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This step's window scored over every head: (positions ``[n]`` CPU, scores ``[m]`` on the keys' device);
        ``None`` when nothing was observed this step. Takes the window: call it once per step."""
        window: ObservationWindow | None = state.extra.pop(WINDOW, None)
        if window is None:
            return None
        return window.k_pos.cpu(), over_all_heads(window, self.score(state, window), self.head_mean)

    def keep_set(self, positions: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """The positions :meth:`budget` keeps of ``positions`` (sorted) by ``scores`` (the first ``m`` of them)."""
        b = self.budget()
        scores = scores.cpu()
        if scores.numel() < positions.numel():  # the unscored recent positions: kept regardless
            scores = torch.cat([scores, scores.new_zeros(positions.numel() - scores.numel())])
        return topk_keep(positions, scores, b.keep, b.sink, b.recent)

    def keep(self, state: RequestState, positions: torch.Tensor, scores: torch.Tensor) -> KeepPlan | None:
        """The plan from this step's scores (``None``: everything stays)."""
        keep = self.keep_set(positions, scores)
        return KeepPlan(keep) if keep.numel() < positions.numel() else None
