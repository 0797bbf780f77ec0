"""PyramidKV (Cai et al., 2024, arXiv:2406.02069): SnapKV's window scoring with a budget per layer that falls
linearly from the first layer to the last (a pyramid), the mean over layers being ``budget``.

Selection. At the end of the prompt (and every ``decode_interval`` decoded tokens, as SnapKV's), for each layer
``l`` on its own: the last ``window_size`` queries' softmax attention over that layer's candidates (GQA query
heads of a group summed), pooled along positions (``kernel_size``, ``pooling``), summed over KV heads (one set
per layer, shared by its KV heads, as our SnapKV's one set; the original selects per head), then the first
``sink_tokens`` and the last ``window_size`` candidates plus the best-scored others up to ``budgets[l]``
(:func:`layer_budgets`). A layer's candidates are what it reads: every position at the first selection, then
its own kept set plus everything appended since.

The schedule (:func:`layer_budgets`) is kvpress's ``PyramidKVPress.get_layer_budget`` (itself KVCache-Factory's
``PyramidKVCluster``), with our ``budget`` as KVCache-Factory's ``max_capacity_prompt`` (the mean retained per
layer) and sink + window as its fixed part: the scored budget of layer ``l`` of ``L`` over a context of ``n`` is
``round(max_num - l * (max_num - min_num) / (L - 1))`` with ``min_num = (budget - fixed) / beta`` and
``max_num = 2 (budget - fixed) - min_num``, ``max_num`` capped at ``n - fixed`` (then ``min_num = 2 (budget -
fixed) - max_num``), so the layers' mean stays ``budget`` (up to rounding); where kvpress's guard fails (its
smallest layer, ``budget / beta``, would not hold the window: :func:`pyramid_applies`) every layer keeps ``budget``,
as kvpress does. A context within ``budget`` keeps
everything in every layer (KVCache-Factory's ``q_len < max_capacity_prompt``), so a budget that covers the
context is dense.

Physical retention. One pool slot holds a token's K/V for every layer, so what is freed is what *no* layer keeps:
the :class:`KeepPlan` is the union of the layers' sets. Each layer then reads only its own set (plus the tokens
appended since the selection) through :class:`LayerKeepSelector`, a static :class:`PageSelector`: the selection
is per request and layer, set between steps by this method, and read by decode attention and by the cached
prefix of an extend (a Chain Cache continuation's prompt). Memory saved is therefore the union's, which lies
between the largest layer budget and their sum; :meth:`PyramidKV.stats` reports, over all selections, the union
sizes beside the per-layer set sizes (``/server_info`` ``method_stats``). The per-layer masks go into the
:class:`TreePayload`, so the next turn resumes with every layer's set; a resume without it (a match inside a
record's tail, which the tree gives no payload) reads the union in every layer until its next selection
(counted in ``stats()['resumed_without_layer_sets']``). A request that prunes its own prompt drops the pruned
positions' columns of the restored masks (:meth:`PyramidKV.on_prune`) before its layers score: each layer's
candidates are then its set less the pruned positions, and its budget counts what is left.

Defaults: ``beta`` 20 (kvpress and KVCache-Factory); ``budget`` 8,192, ``window_size`` 32, ``kernel_size`` 5,
``pooling`` avgpool, ``sink_tokens`` 64, ``decode_interval`` 0 are our SnapKV's (SnapKV's original window,
kernel and pooling; kvpress's PyramidKV uses window 64), so ``pyramidkv`` and ``snapkv`` at one config differ
only in the per-layer schedule. Decode reads each layer's set through one kernel a layer on CUDA
(:mod:`sgl_sparse.kernels.layer_sets`, CUDA-graph safe) and its torch reference on CPU; on CUDA a Chain Cache turn's
prefill reads its cached prefix through FlashInfer's lists, the union (docs/methods/pyramidkv.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sgl_sparse.config import MethodConfig
from sgl_sparse.contract import (
    KeepPlan,
    KVGeometry,
    ObservationWindow,
    PageSelector,
    RequestState,
    StepInfo,
    TreePayload,
)
from sgl_sparse.kernels import layer_sets
from sgl_sparse.methods.eviction.base import POOLINGS, Budget, ScoredEviction, topk_keep, window_scores
from sgl_sparse.registry import register_method
from sgl_sparse.slots import SENTINEL_SLOT, to_device

LAYERS = "pyramidkv_layers"  # state.extra / payload: [L, m] bool, layer l keeps state.kept[i] (i < m; later: all)
SCORED = "pyramidkv_scored"  # state.extra: this step's per-layer candidates and budgets
PENDING = "pyramidkv_pending"  # state.extra: the LayerSets its selector writes into its row at the next bind
# (positions [m], mask [L, m] of which layer keeps each, the tail from which every position is read)
LayerSets = tuple[torch.Tensor, torch.Tensor, int]
UNUSED = 2**62  # a selection entry past every row's length


@dataclass(frozen=True)
class PyramidKVConfig(MethodConfig):
    method_name = "pyramidkv"
    budget: int = 8192  # mean retained tokens per layer, sink and window included
    beta: int = 20  # pyramid steepness: the last layer's scored budget is about (budget - fixed) / beta
    window_size: int = 32
    kernel_size: int = 5
    pooling: str = "avgpool"
    sink_tokens: int = 64
    decode_interval: int = 0  # 0: select once at prefill end; N: re-select every N decoded tokens

    @property
    def fixed(self) -> int:
        """Tokens every layer keeps whatever the scores: the sink and the window."""
        return self.sink_tokens + self.window_size

    def validate(self) -> None:
        self.require(self.budget >= 1, "budget", "must be >= 1")
        self.require(self.beta >= 1, "beta", "must be >= 1")
        self.require(self.window_size >= 1, "window_size", "must be >= 1")
        self.require(self.sink_tokens >= 0, "sink_tokens", "must be >= 0")
        self.require(self.sink_tokens + self.window_size <= self.budget, "sink_tokens",
                     f"+ window_size must be <= budget ({self.budget})")
        self.require(self.kernel_size >= 1 and self.kernel_size % 2 == 1, "kernel_size", "must be odd and >= 1")
        self.require(self.pooling in POOLINGS, "pooling", f"must be one of {list(POOLINGS)}")
        self.require(self.decode_interval >= 0, "decode_interval", "must be >= 0")


def _span(mean: float, beta: int, room: int) -> tuple[float, float]:
    """kvpress's smallest and largest layer amounts of a pyramid of mean ``mean``: ``mean / beta`` and the rest up
    to twice the mean, the largest capped at ``room`` (then the smallest takes the difference)."""
    min_num = mean / beta
    max_num = 2 * mean - min_num
    if max_num >= room:
        max_num = room
        min_num = 2 * mean - max_num
    return min_num, max_num


def pyramid_applies(n: int, budget: int, window: int, beta: int) -> bool:
    """kvpress's guard (``PyramidKVPress.get_layer_budget``, kvpress 0.5.5) in its own terms, ``budget`` tokens kept
    of ``n`` with a ``window``: its pyramid's smallest layer, ``budget / beta``, must still hold the window (and the
    capped largest fit the context), else every layer keeps ``budget``. Without it a small budget starves the last
    layers (quality-small at 512 of 2K, beta 20, window 32: 0.19, against kvpress's 0.91 with the guard; QUALITY.md)."""
    min_num, max_num = _span(budget, beta, n - window)
    return n >= max_num >= min_num >= window


def layer_budgets(n: int, num_layers: int, budget: int, fixed: int, beta: int, window: int) -> list[int]:
    """Tokens each layer keeps of a context of ``n`` (kvpress's schedule; module docstring): all ``n`` when
    ``n <= budget``; ``budget`` in every layer where kvpress's guard says so (:func:`pyramid_applies`); else
    ``fixed`` plus a scored part falling linearly over the layers, mean ``budget``."""
    if n <= budget:
        return [n] * num_layers
    if num_layers == 1 or not pyramid_applies(n, budget, window, beta):
        return [budget] * num_layers
    min_num, max_num = _span(budget - fixed, beta, n - fixed)
    step = (max_num - min_num) / (num_layers - 1)
    return [fixed + round(max_num - layer * step) for layer in range(num_layers)]


def max_layer_set(cfg: PyramidKVConfig) -> int:
    """The most positions one layer's set can hold: the largest layer budget of any context, under twice the
    mean (:func:`_span`: the largest layer's scored part is ``2 (budget - fixed) - min_num``)."""
    return 2 * cfg.budget


class LayerKeepSelector(PageSelector):
    """Each layer reads its own kept set: per request row and layer, the positions the last selection kept
    (``keep[layer, row, :count[layer, row]]``, ascending), plus every position from ``tail[row]`` on (appended
    since). A row the method set no sets for has ``count`` and ``tail`` 0: every live position (sentinels
    skipped), i.e. the union. The method hands a request's sets over in its state (:meth:`set_request`) and
    :meth:`bind` writes them into the request's row before the next forward step reads it; every admission hands
    a row over, so a reused row never shows its previous owner's sets.

    Decode reads the sets through one kernel a layer (:mod:`sgl_sparse.kernels.layer_sets`: list lengths on the
    device, fixed shapes, so CUDA graphs capture it); an extend's cached prefix reads them on the CPU server
    (:meth:`select`). Memory: fixed buffers of ``width`` positions per layer and request row (int32), taken from
    the KV budget before the pool is sized (:meth:`fixed_bytes`)."""

    page_size = 1
    static = True
    attends = True

    def __init__(self, width: int) -> None:
        self.width = width  # the most positions one layer's set holds
        self.num_layers = 0
        self.num_kv_heads = 1
        self.keep = torch.empty(0, 0, 0, dtype=torch.int32)  # [L, rows, width]
        self.count = torch.empty(0, 0, dtype=torch.int32)  # [L, rows]
        self.tail = torch.empty(0, dtype=torch.int32)  # [rows]

    def selects(self, layer_id: int) -> bool:
        return True

    def fixed_bytes(self, g: KVGeometry) -> int:
        return g.max_requests * 4 * (g.num_layers * (self.width + 1) + 1)

    def allocate(self, g: KVGeometry) -> None:
        if g.max_requests < 1:
            raise ValueError("LayerKeepSelector needs the request rows (KVGeometry.max_requests)")
        self.num_layers, self.num_kv_heads = g.num_layers, g.num_kv_heads
        self.keep = torch.zeros(g.num_layers, g.max_requests, self.width, dtype=torch.int32, device=g.device)
        self.count = torch.zeros(g.num_layers, g.max_requests, dtype=torch.int32, device=g.device)
        self.tail = torch.zeros(g.max_requests, dtype=torch.int32, device=g.device)

    def set_request(self, state: RequestState, sets: LayerSets | None) -> None:
        """Hand ``state``'s sets over, written into its row at the next :meth:`bind`; ``None``: no sets."""
        state.extra[PENDING] = sets

    def bind(self, states: Sequence[RequestState | None], rows: Sequence[int]) -> None:
        device = self.keep.device
        for state, row in zip(states, rows, strict=True):
            if state is None or PENDING not in state.extra:
                continue
            sets = state.extra.pop(PENDING)
            keep = torch.zeros(self.num_layers, self.width, dtype=torch.int32)
            count = torch.zeros(self.num_layers, dtype=torch.int32)
            tail = 0
            if sets is not None:
                positions, mask, tail = sets
                for layer in range(self.num_layers):
                    p = positions[mask[layer]]
                    if p.numel() > self.width:
                        raise RuntimeError(f"pyramidkv: layer {layer} keeps {p.numel()} positions, more than the "
                                           f"selector's {self.width}")
                    keep[layer, : p.numel()] = p.to(torch.int32)
                    count[layer] = p.numel()
            # Host -> device through pinned memory without blocking: enqueued on the stream before the forward
            # that reads them, so a captured decode graph replays over the new sets.
            self.keep[:, row] = to_device(keep, device)
            self.count[:, row] = to_device(count, device)
            self.tail[row : row + 1] = to_device(torch.tensor([tail], dtype=torch.int32), device)

    def visible(self, layer_id: int, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                seq_lens: torch.Tensor) -> torch.Tensor:
        """``[bs, width]`` bool: the positions each row reads at this layer (``width = max(seq_lens)``)."""
        rows = req_pool_indices.long()
        width = int(seq_lens.max()) if rows.numel() else 0
        pos = torch.arange(width, device=rows.device)
        live = (req_to_token[rows, :width] != SENTINEL_SLOT) & (pos[None, :] < seq_lens[:, None])
        listed = torch.arange(self.width, device=rows.device)[None, :] < self.count[layer_id, rows][:, None]
        keep = torch.where(listed, self.keep[layer_id, rows].long(), width).clamp(max=width)
        member = torch.zeros(rows.numel(), width + 1, dtype=torch.bool, device=rows.device)
        member.scatter_(1, keep, True)
        return live & (member[:, :width] | (pos[None, :] >= self.tail[rows][:, None]))

    def select(self, layer_id: int, q: torch.Tensor | None, req_to_token: torch.Tensor,
               req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """An extend's read of its cached prefix (CPU server): :meth:`visible` as sorted positions."""
        read = self.visible(layer_id, req_to_token, req_pool_indices, seq_lens)
        pos = torch.arange(read.shape[1], device=read.device)
        pages = torch.where(read, pos[None, :], UNUSED).sort(dim=1).values
        return pages.repeat_interleave(self.num_kv_heads, dim=0)

    def attend(self, layer_id: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
               scale: float) -> torch.Tensor:
        args = (q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, self.keep[layer_id],
                self.count[layer_id], self.tail, scale)
        if q.is_cuda:
            if k_cache.dtype != q.dtype:
                raise ValueError(f"pyramidkv reads a {k_cache.dtype} KV cache with {q.dtype} queries: its decode "
                                 "kernel reads the model dtype only")
            return layer_sets.decode_attention(*args)
        return layer_sets.decode_attention_torch(*args)


@register_method
class PyramidKV(ScoredEviction[PyramidKVConfig]):
    """Scores as the base does, each layer over its own candidates (one reduction for all of them), and keeps per
    layer by its own budget (:meth:`select_layers`)."""

    name = "pyramidkv"
    config_cls = PyramidKVConfig

    def __init__(self, config: PyramidKVConfig) -> None:
        super().__init__(config)
        self._selector = LayerKeepSelector(max_layer_set(config))
        self.counters = {"selections": 0, "union_tokens_total": 0, "layer_tokens_total": 0,
                         "max_layer_tokens_total": 0, "resumed_without_layer_sets": 0}
        self.last_budgets: list[int] = []

    @property
    def selector(self) -> LayerKeepSelector:
        return self._selector

    def observation_window(self) -> int:
        return self.config.window_size

    def observes_decode(self) -> bool:
        return self.config.decode_interval > 0

    # -- per-layer sets -----------------------------------------------------------------------------
    def _num_layers(self, state: RequestState) -> int:
        mask = state.extra.get(LAYERS)
        return int(mask.shape[0]) if mask is not None else self._selector.num_layers

    def layer_masks(self, state: RequestState, num_layers: int) -> torch.Tensor:
        """``[L, num_kept]`` bool: which retained positions each layer reads (appended ones: all)."""
        mask = state.extra.get(LAYERS)
        full = torch.ones(num_layers, state.num_kept, dtype=torch.bool)
        if mask is not None:
            full[:, : mask.shape[1]] = mask
        return full

    def new_state(self, rid: str) -> RequestState:
        state = RequestState(rid=rid)
        self._selector.set_request(state, None)
        return state

    def restore_state(self, state: RequestState, payload: TreePayload | None) -> None:
        mask = payload.data.get(LAYERS) if payload is not None else None
        if mask is not None and mask.dim() == 2 and mask.shape[1] == state.num_kept:
            state.extra[LAYERS] = mask.bool().cpu()
            self._selector.set_request(state, (state.kept, state.extra[LAYERS], state.logical_len))
        elif state.num_kept < state.logical_len:
            self.counters["resumed_without_layer_sets"] += 1  # every layer reads the union

    def on_prune(self, state: RequestState, pruned: torch.Tensor) -> None:
        # The restored per-layer masks index the retained set: the pruned positions' columns go. The selector's
        # bound sets may still list them; their slots are sentinels once pruned, which it never reads.
        mask = state.extra.get(LAYERS)
        if mask is not None:
            state.extra[LAYERS] = mask[:, ~torch.isin(state.kept[:mask.shape[1]], pruned)]

    def _over_budget(self, state: RequestState) -> bool:
        """Whether some layer reads more than its budget at this length (its candidates: its set + the tail)."""
        num_layers = self._num_layers(state)
        if num_layers == 0:  # the selector was never allocated (no geometry yet): score, on_step_end decides
            return state.num_kept > self.config.budget
        cfg = self.config
        budgets = layer_budgets(state.logical_len, num_layers, cfg.budget, cfg.fixed, cfg.beta, cfg.window_size)
        counts = self.layer_masks(state, num_layers).sum(1).tolist()
        return any(c > b for c, b in zip(counts, budgets, strict=True))

    # -- hooks -------------------------------------------------------------------------------------
    def wants_observation(self, state: RequestState, step: StepInfo) -> bool:
        if step.final_prefill:
            return self._over_budget(state)
        di = self.config.decode_interval
        return not step.is_prefill and di > 0 and step.decoded_tokens % di == 0 and self._over_budget(state)

    def budget(self) -> Budget:
        """The mean layer's; each layer keeps its own (:func:`layer_budgets`)."""
        return Budget(self.config.budget, self.config.sink_tokens, self.config.window_size)

    def score(self, state: RequestState, window: ObservationWindow) -> torch.Tensor:
        """Every layer's scores of its own candidates, one after the other (the candidate counts are replicated,
        so under TP the split of the reduced scores is too)."""
        cfg = self.config
        masks = self.layer_masks(state, window.num_layers)
        budgets = layer_budgets(state.logical_len, window.num_layers, cfg.budget, cfg.fixed, cfg.beta,
                                cfg.window_size)
        positions, scores = [], []
        for layer in range(window.num_layers):
            buf = window.key_buffer(layer)
            m = masks[layer]
            rows, k_pos = window.key_rows[m.to(window.key_rows.device)], window.k_pos[m]
            scores.append(window_scores(window.queries[layer], buf, rows.to(buf.device), window.q_pos.to(buf.device),
                                        k_pos.to(buf.device), window.scale, cfg.kernel_size, cfg.pooling))
            positions.append(k_pos.cpu())
        state.extra[SCORED] = (positions, budgets)
        return torch.cat(scores)

    def keep(self, state: RequestState, positions: torch.Tensor, scores: torch.Tensor) -> KeepPlan | None:
        candidates, budgets = state.extra.pop(SCORED)
        summed = torch.split(scores.cpu(), [c.numel() for c in candidates])
        return self.select_layers(state, list(zip(candidates, summed, strict=True)), budgets)

    def select_layers(self, state: RequestState, scored: list[tuple[torch.Tensor, torch.Tensor]],
                      budgets: list[int]) -> KeepPlan | None:
        """Each layer's keep set from its (candidates, scores over every head) and budget; the plan is their
        union, and each layer's set goes to the selector."""
        cfg = self.config
        keeps = [topk_keep(pos, s, b, cfg.sink_tokens, cfg.window_size) for (pos, s), b in zip(scored, budgets,
                                                                                                   strict=True)]
        union = torch.unique(torch.cat(keeps))  # sorted
        mask = torch.stack([torch.isin(union, k) for k in keeps])
        state.extra[LAYERS] = mask
        self._selector.set_request(state, (union, mask, state.logical_len))
        sizes = [k.numel() for k in keeps]
        self.counters["selections"] += 1
        self.counters["union_tokens_total"] += int(union.numel())
        self.counters["layer_tokens_total"] += sum(sizes)
        self.counters["max_layer_tokens_total"] += max(sizes)
        self.last_budgets = budgets
        return KeepPlan(union) if union.numel() < state.num_kept else None

    def on_finish(self, state: RequestState) -> TreePayload | None:
        if LAYERS not in state.extra:
            return None
        return TreePayload({LAYERS: self.layer_masks(state, self._num_layers(state))})

    def stats(self) -> dict[str, Any]:
        c: dict[str, Any] = dict(self.counters)
        n = c["selections"]
        if n:
            # What the pool holds (the union) against what the layers read: a layer-sliced pool would hold the
            # mean of the layers' sets; one shared slot per token holds the union.
            layers = max(1, len(self.last_budgets))
            c["mean_union_tokens"] = c["union_tokens_total"] / n
            c["mean_layer_tokens"] = c["layer_tokens_total"] / (n * layers)
            c["union_over_mean_layer"] = c["union_tokens_total"] * layers / max(1, c["layer_tokens_total"])
        c["last_layer_budgets"] = list(self.last_budgets)
        return c
