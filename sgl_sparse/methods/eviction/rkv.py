"""R-KV, redundancy-aware KV compression for reasoning models (Cai et al., 2025, arXiv:2505.24133): while a
long chain of thought is decoded, keep the tokens that are both important and not redundant.

At each compaction, over the retained tokens except the last ``window_size`` (the observation tokens, always
kept), per layer and KV head (as ``rkv/compression/r1_kv.py`` and ``rkv/utils.py`` of Zefan-Cai/R-KV):

* importance: the logits of the observation tokens' queries (the last ``window_size`` ones, prompt or decode)
  against those keys, maxed over the query heads of a GQA group, softmaxed over the keys, averaged over the
  queries, then max-pooled along positions (``kernel_size``);
* redundancy: the keys' pairwise cosine similarity over all retained keys (the observation tokens' included),
  diagonal zeroed; for each key (row) its most recent neighbour above ``similarity_threshold`` is spared (the
  original's ``retain_direction="last"``: that entry is zeroed too; a row with no such neighbour zeroes its
  entry at the first retained key, as the original's index trick does); each key's column mean, softmaxed
  over the keys;
* score = ``mix_lambda * importance - (1 - mix_lambda) * redundancy``.

One token set for all layers and heads (one pool slot holds every layer's K/V; the original keeps one set per
head): the score is averaged over KV heads and summed over layers, as the R-KV authors' own SGLang port
(``SGLang/rkv/integration.py``: "cross-head mean, cross-layer sum") and SparseEngine's ``RKVRuntime`` do; the
kept set is the top ``budget - window_size`` by that score (ties to the earlier position) plus the observation
tokens.

When: the original decodes into a buffer and compresses the whole cache back to ``budget`` every ``B_buffer``
tokens; here every ``evict_interval`` decoded tokens once over the budget, so at most ``budget +
evict_interval`` are retained. The prompt is handled as the original HuggingFace code does
(``rkv/modeling.py``: the first forward calls ``update_kv`` on the prompt's K/V): a prompt over the budget is
compressed at its end with the same score, its last ``window_size`` queries observing; the prompt's tokens then
compete with the decoded ones at every compaction. (R-KV's SGLang port and SparseEngine leave a prompt whole
until the first decode compaction.) Nothing survives a compaction but the kept set, so the next turn of a
conversation (Chain Cache) needs no payload.

Cost: the redundancy is quadratic in the retained tokens (``n x n`` cosines per KV head and layer, in row blocks
of bounded memory), once per compaction: ``budget + evict_interval`` tokens in decode, the whole prompt at the
end of a prompt over the budget. Scores are fp32 (the original rounds importance to the model dtype).

Defaults (Zefan-Cai/R-KV): ``budget`` 1,024 (README quick start ``--kv_budget 1024``; the SGLang port's
``RKVConfig``), ``window_size`` 8 (README: "α, # observation tokens ... 8"), ``kernel_size`` 7 (``R1KV``),
``mix_lambda`` 0.1 (README: "λ ... 0.1"; the ``R1KV`` class default is 0.07), ``similarity_threshold`` 0.5
(``cal_similarity``), ``evict_interval`` 128 (README: "B_buffer, staging-buffer size, 128"; SparseEngine's AIME
run compresses every 1,024).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sgl_sparse.config import MethodConfig
from sgl_sparse.contract import ObservationWindow, RequestState, StepInfo
from sgl_sparse.methods.eviction.base import Budget, ScoredEviction, compacts_now
from sgl_sparse.registry import register_method

SIMILARITY_BLOCK_ELEMENTS = 1 << 24  # cosine entries per row block of the redundancy (64 MiB of fp32)


@dataclass(frozen=True)
class RKVConfig(MethodConfig):
    method_name = "rkv"
    budget: int = 1024  # retained tokens after a compaction, observation tokens included
    window_size: int = 8  # observation tokens: their queries score importance, their K/V are always kept
    kernel_size: int = 7  # max-pool width along positions for the importance
    mix_lambda: float = 0.1  # weight of importance; 1 - mix_lambda weighs redundancy
    similarity_threshold: float = 0.5  # cosine above which two keys are near-duplicates
    evict_interval: int = 128  # decode: compact every N decoded tokens once over budget (the buffer)

    def validate(self) -> None:
        self.require(self.window_size >= 1, "window_size", "must be >= 1")
        self.require(self.budget > self.window_size, "budget", f"must be > window_size ({self.window_size})")
        self.require(self.kernel_size >= 1 and self.kernel_size % 2 == 1, "kernel_size", "must be odd and >= 1")
        self.require(0.0 <= self.mix_lambda <= 1.0, "mix_lambda", "must be in [0, 1]")
        self.require(-1.0 <= self.similarity_threshold <= 1.0, "similarity_threshold", "must be in [-1, 1]")
        self.require(self.evict_interval >= 1, "evict_interval", "must be >= 1")


def importance(q: torch.Tensor, keys: torch.Tensor, scale: float, kernel_size: int) -> torch.Tensor:
    """``[Hkv, n]``: the observation queries ``q`` ``[w, Hq, D]`` over ``keys`` ``[n, Hkv, D]`` (all earlier
    than every query): logits maxed over each GQA group, softmax over the keys, mean over the queries,
    max-pooled along positions."""
    w, hq, d = q.shape
    hkv = keys.shape[1]
    logits = torch.einsum("wkgd,nkd->kgwn", q.float().view(w, hkv, hq // hkv, d), keys.float()) * scale
    probs = logits.amax(dim=1).softmax(dim=-1).mean(dim=1)  # [Hkv, n]
    if kernel_size > 1:
        probs = F.max_pool1d(probs[:, None, :], kernel_size, stride=1, padding=kernel_size // 2)[:, 0, :]
    return probs


def redundancy(keys: torch.Tensor, threshold: float) -> torch.Tensor:
    """``[Hkv, n]``: R-KV's redundancy of each key among ``keys`` ``[n, Hkv, D]`` (see the module docstring),
    in row blocks of at most :data:`SIMILARITY_BLOCK_ELEMENTS` cosines."""
    n, hkv, _ = keys.shape
    unit = keys.float().transpose(0, 1)  # [Hkv, n, D]
    unit = unit / (unit.norm(dim=-1, keepdim=True) + 1e-8)
    cols = torch.arange(n, device=keys.device)
    column_sum = torch.zeros(hkv, n, dtype=torch.float32, device=keys.device)
    step = max(1, SIMILARITY_BLOCK_ELEMENTS // max(1, hkv * n))
    for start in range(0, n, step):
        sim = torch.einsum("hrd,hnd->hrn", unit[:, start:start + step], unit)  # [Hkv, r, n]
        sim.diagonal(offset=start, dim1=1, dim2=2).zero_()  # each key's similarity to itself (no index_put)
        last = torch.where(sim > threshold, cols, 0).amax(dim=-1)  # most recent near-duplicate (0 if none)
        sim.scatter_(-1, last[..., None], 0.0)
        column_sum += sim.sum(dim=1)
    return (column_sum / n).softmax(dim=-1)


def rkv_scores(window: ObservationWindow, window_size: int, kernel_size: int, mix_lambda: float,
               threshold: float) -> torch.Tensor:
    """Score of each retained position but the last ``window_size``: ``[n - window_size]`` (float32), the
    per-head R-KV score averaged over this rank's KV heads and summed over layers."""
    total: torch.Tensor | None = None
    past = window.k_pos.numel() - window_size
    for layer in range(window.num_layers):
        keys, _ = window.keys(layer)
        q = window.queries[layer].to(keys.device)
        imp = importance(q, keys[:past], window.scale, kernel_size)
        red = redundancy(keys, threshold)[:, :past]
        s = (imp * mix_lambda - red * (1.0 - mix_lambda)).mean(dim=0)
        total = s if total is None else total + s
    assert total is not None
    return total


@register_method
class RKV(ScoredEviction[RKVConfig]):
    name = "rkv"
    config_cls = RKVConfig
    head_mean = True

    def observation_window(self) -> int:
        return self.config.window_size

    def observes_decode(self) -> bool:
        return True

    def wants_observation(self, state: RequestState, step: StepInfo) -> bool:
        return compacts_now(state, step, self.config.budget, self.config.evict_interval)

    def budget(self) -> Budget:
        return Budget(self.config.budget, 0, self.config.window_size)  # the observation tokens: kept regardless

    def score(self, state: RequestState, window: ObservationWindow) -> torch.Tensor:
        cfg = self.config
        return rkv_scores(window, cfg.window_size, cfg.kernel_size, cfg.mix_lambda, cfg.similarity_threshold)
