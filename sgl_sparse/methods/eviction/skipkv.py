"""SkipKV, sentence-level KV eviction for reasoning models (Tian et al., 2025, arXiv:2512.07993), without its
steering vectors: while a long chain of thought is decoded, evict the tokens of sentences the model has already
restated, besides the tokens that are unimportant or redundant one by one.

The decoded text is split into sentences at boundary tokens (``boundary_token_ids``: ids whose text ends in
``.``, ``!``, ``?`` or a newline, derived from the served tokenizer at launch), a sentence also closing after
``sentence_max_tokens``; sentences shorter than ``sentence_min_tokens`` are not tracked, at most
``max_tracked_sentences`` (the newest) are. Without boundary ids (a per-request config, or
``--skip-tokenizer-init``) the decoded text is cut into ``segment_tokens`` segments instead (SparseEngine's
fallback). At each compaction, over the retained tokens, per layer (then summed over layers, one kept set for
all layers and heads as R-KV here):

* importance: R-KV's (the last ``window_size`` queries' logits, maxed over each GQA group, softmaxed over the
  keys before the window, averaged over the queries, max-pooled over ``kernel_size`` positions), averaged over
  the KV heads;
* token redundancy: R-KV's key redundancy (cosines above R-KV's near-duplicate threshold 0.5, the newest
  near-duplicate spared) among the last ``redundancy_window`` candidates only (the tokens about to leave the
  recent window), zero for older ones, averaged over the KV heads, weighed by ``alpha``;
* sentence similarity: each tracked sentence is embedded by the mean of its retained keys (KV heads
  concatenated), L2-normalized; a sentence whose cosine to some *later* sentence is at least
  ``sentence_threshold`` is redundant by that cosine (the paper: of two near-identical sentences the later
  restatement stays), and every retained token of it is penalized by ``sentence_weight`` x that cosine, so a
  restated sentence leaves whole.

``score = importance - alpha * token_redundancy - sentence_weight * sentence_penalty``; the kept set is the first
``sink_tokens``, the last ``recent_tokens`` (the observation queries' tokens among them) and the top of the rest
by score (ties to the earlier position), ``budget`` in all.

Sentence embeddings: the paper embeds a sentence by the mean of its last-layer hidden states, which our attention
backend never sees. Keys are what an observation window already gives every layer, so each layer compares its
own mean keys (as SparseEngine's fallback does for its segments). Caveat: keys are post-RoPE, so two copies of a
sentence far apart differ by a rotation in their high-frequency channels; the mean over a sentence averages
those channels out and the slow ones dominate, but distant restatements score lower than the paper's hidden
states would (docs/methods/skipkv.md).

When (SparseEngine's ``SkipKVRuntime``): decode only, every ``evict_interval`` decoded tokens once more than
``budget`` are retained, so at most ``budget + evict_interval`` are; a prompt over the budget stays whole until
the first compaction. Sentences are tracked over the decoded tokens of the current request only; a Chain Cache
continuation starts with none (its previous answer is now prompt), so ``on_finish`` returns no payload.

Defaults: SparseEngine's ``skipkv_*`` config (compression interval 128, alpha 0.1, redundancy window 64,
sentence score weight 1.0, similarity threshold 0.95 as the paper's PSS threshold, sentence max 256 / min 4
tokens, 256 tracked sentences, 32-token fallback segments); ``budget`` 1,024, ``window_size`` 8 and
``kernel_size`` 7 of R-KV, which SparseEngine's SkipKV extends; ``sink_tokens`` 64 and ``recent_tokens`` 512 of
SparseEngine's common eviction fields (its paper's Table 12).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from sgl_sparse.config import MethodConfig
from sgl_sparse.contract import KeepPlan, ObservationWindow, RequestState, StepInfo
from sgl_sparse.methods.eviction.base import Budget, ScoredEviction, compacts_now
from sgl_sparse.methods.eviction.rkv import importance, redundancy
from sgl_sparse.registry import register_method

SENTENCES = "skipkv_sentences"  # state.extra: the request's _Sentences
PENALIZED = "skipkv_penalized"  # state.extra: which positions this step's sentence penalty hit
BOUNDARY_SUFFIXES = (".", "!", "?", "\n")  # a token whose text ends in one of these closes a sentence
RKV_SIMILARITY_THRESHOLD = 0.5  # R-KV's own near-duplicate cosine for the token redundancy


def boundary_ids(pieces: Sequence[str]) -> list[int]:
    """The ids of the vocabulary ``pieces`` (decoded text of each id, in id order) that close a sentence: text
    ending in a delimiter, trailing spaces ignored (a piece of spaces only closes nothing)."""
    return [i for i, text in enumerate(pieces) if text.rstrip(" \t").endswith(BOUNDARY_SUFFIXES)]


@dataclass(frozen=True)
class SkipKVConfig(MethodConfig):
    method_name = "skipkv"
    budget: int = 1024  # retained tokens after a compaction, sink and recent included
    sink_tokens: int = 64  # the first retained tokens, always kept
    recent_tokens: int = 512  # the last retained tokens, always kept (the observation window among them)
    window_size: int = 8  # observation queries: the last decoded tokens' queries score importance
    kernel_size: int = 7  # max-pool width along positions for the importance
    evict_interval: int = 128  # compact every N decoded tokens once over budget
    alpha: float = 0.1  # weight of the token redundancy
    redundancy_window: int = 64  # token redundancy among the last N candidates only
    sentence_weight: float = 1.0  # weight of the sentence penalty
    sentence_threshold: float = 0.95  # cosine of two sentences' mean keys above which the earlier is redundant
    sentence_min_tokens: int = 4  # shorter sentences are not tracked
    sentence_max_tokens: int = 256  # a sentence closes after this many tokens without a boundary
    max_tracked_sentences: int = 256  # the newest N closed sentences are tracked
    segment_tokens: int = 32  # fallback sentence length when no boundary ids are known
    boundary_token_ids: list[int] = field(default_factory=list)  # empty: the launcher derives them

    def validate(self) -> None:
        self.require(self.window_size >= 1, "window_size", "must be >= 1")
        self.require(self.sink_tokens >= 0, "sink_tokens", "must be >= 0")
        self.require(self.recent_tokens >= self.window_size, "recent_tokens",
                     f"must be >= window_size ({self.window_size})")
        self.require(self.budget > self.sink_tokens + self.recent_tokens, "budget",
                     f"must be > sink_tokens + recent_tokens ({self.sink_tokens + self.recent_tokens})")
        self.require(self.kernel_size >= 1 and self.kernel_size % 2 == 1, "kernel_size", "must be odd and >= 1")
        self.require(self.evict_interval >= 1, "evict_interval", "must be >= 1")
        self.require(self.alpha >= 0.0, "alpha", "must be >= 0")
        self.require(self.redundancy_window >= 0, "redundancy_window", "must be >= 0")
        self.require(self.sentence_weight >= 0.0, "sentence_weight", "must be >= 0")
        self.require(-1.0 <= self.sentence_threshold <= 1.0, "sentence_threshold", "must be in [-1, 1]")
        self.require(self.sentence_min_tokens >= 1, "sentence_min_tokens", "must be >= 1")
        self.require(self.sentence_max_tokens >= self.sentence_min_tokens, "sentence_max_tokens",
                     f"must be >= sentence_min_tokens ({self.sentence_min_tokens})")
        self.require(self.max_tracked_sentences >= 0, "max_tracked_sentences", "must be >= 0")
        self.require(self.segment_tokens >= 1, "segment_tokens", "must be >= 1")
        self.require(isinstance(self.boundary_token_ids, list)
                     and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                             for i in self.boundary_token_ids),
                     "boundary_token_ids", "must be a list of token ids (ints >= 0)")


@dataclass
class _Sentences:
    """The request's closed sentences (logical ``[start, end)`` spans, oldest first), its open one, and the next
    decoded position to segment (its id may come a step late: ``StepInfo.token_ids``)."""

    spans: list[tuple[int, int]] = field(default_factory=list)
    open_start: int | None = None
    cursor: int | None = None


def track(sentences: _Sentences, first: int, ids: Sequence[int], boundaries: frozenset[int], max_tokens: int,
          min_tokens: int, max_tracked: int) -> int:
    """Extend the segmentation by the tokens ``ids`` at positions ``first, first + 1, ...``: a sentence closes at
    a boundary id (included) or at ``max_tokens``; closed ones under ``min_tokens`` are dropped, the newest
    ``max_tracked`` kept. Returns how many sentences it closed and tracked."""
    closed = 0
    for offset, token in enumerate(ids):
        pos = first + offset
        if sentences.open_start is None:
            sentences.open_start = pos
        if token in boundaries or pos + 1 - sentences.open_start >= max_tokens:
            if pos + 1 - sentences.open_start >= min_tokens:
                sentences.spans.append((sentences.open_start, pos + 1))
                closed += 1
            sentences.open_start = None
    del sentences.spans[:max(0, len(sentences.spans) - max_tracked)]
    return closed


def sentence_penalty(keys: torch.Tensor, positions: torch.Tensor, spans: Sequence[tuple[int, int]],
                     threshold: float) -> torch.Tensor:
    """``[n]``: each retained token's penalty, the cosine of its sentence's mean key (``keys`` ``[n, Hkv, D]`` at
    sorted ``positions``, KV heads concatenated) to the most similar later sentence when that cosine is at least
    ``threshold``, else 0 (tokens outside tracked sentences: 0)."""
    penalty = torch.zeros(positions.numel(), dtype=torch.float32)
    flat = keys.float().reshape(keys.shape[0], -1).cpu()
    members, means = [], []
    for start, end in spans:
        lo, hi = torch.searchsorted(positions, torch.tensor([start, end])).tolist()
        if hi > lo:  # a sentence fully evicted has nothing left to embed or penalize
            members.append((lo, hi))
            means.append(flat[lo:hi].mean(dim=0))
    if len(means) < 2:
        return penalty
    unit = F.normalize(torch.stack(means), dim=-1)
    sim = unit @ unit.T
    after = torch.ones_like(sim, dtype=torch.bool).triu(diagonal=1)  # [s, t]: t is later than s
    best = sim.masked_fill(~after, float("-inf")).amax(dim=1)  # the newest sentence: -inf, never redundant
    for (lo, hi), sim in zip(members, best.tolist()):
        if sim >= threshold:
            penalty[lo:hi] = sim
    return penalty


def skipkv_scores(window: ObservationWindow, spans: Sequence[tuple[int, int]],
                  cfg: SkipKVConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Score of each retained position ``[n]`` (float32, CPU; the observation window's tokens score 0, they are
    kept as recent tokens): per layer ``importance - alpha * redundancy`` averaged over this rank's KV heads, minus
    ``sentence_weight`` x the sentence penalty, summed over layers; and which positions some layer's sentence
    penalty hit (``[n]`` bool, for the method's counters). Under TP the base averages the totals over the ranks
    weighted by their KV heads (exact for the head-mean terms); the sentence cosine is each rank's own heads', so
    its term is then the ranks' average rather than the single-rank cosine, identical on every rank."""
    n = window.k_pos.numel()
    penalized = torch.zeros(n, dtype=torch.bool)
    past = n - cfg.window_size
    hi = n - cfg.recent_tokens  # candidates: [sink_tokens, hi)
    lo = max(cfg.sink_tokens, hi - cfg.redundancy_window)
    total = torch.zeros(n, dtype=torch.float32)
    for layer in range(window.num_layers):
        keys, _ = window.keys(layer)
        q = window.queries[layer].to(keys.device)
        s = torch.zeros(n, dtype=torch.float32)
        s[:past] = importance(q, keys[:past], window.scale, cfg.kernel_size).mean(dim=0).cpu()
        if hi > lo and cfg.alpha > 0:
            s[lo:hi] -= cfg.alpha * redundancy(keys[lo:hi], RKV_SIMILARITY_THRESHOLD).mean(dim=0).cpu()
        if spans and cfg.sentence_weight > 0:
            penalty = sentence_penalty(keys, window.k_pos, spans, cfg.sentence_threshold)
            s -= cfg.sentence_weight * penalty
            penalized |= penalty > 0
        total += s
    return total, penalized


@register_method
class SkipKV(ScoredEviction[SkipKVConfig]):
    name = "skipkv"
    config_cls = SkipKVConfig
    head_mean = True

    def __init__(self, config: SkipKVConfig) -> None:
        super().__init__(config)
        self.boundaries = frozenset(config.boundary_token_ids)
        # Server-wide counters (/server_info method_stats): that real token ids close sentences, and how often
        # the sentence term, not the token scores, decided what a compaction dropped.
        self.sentences_closed_total = 0
        self.sentence_penalized_tokens_total = 0  # candidates a compaction found in a restated sentence
        self.sentence_evicted_tokens_total = 0  # of those, the ones it dropped

    def observation_window(self) -> int:
        return self.config.window_size

    def observes_decode(self) -> bool:
        return True

    def needs_token_ids(self) -> bool:
        return True

    def wants_observation(self, state: RequestState, step: StepInfo) -> bool:
        return compacts_now(state, step, self.config.budget, self.config.evict_interval, prompt=False)

    def budget(self) -> Budget:
        return Budget(self.config.budget, self.config.sink_tokens, self.config.recent_tokens)

    def on_step_end(self, state: RequestState, step: StepInfo) -> KeepPlan | None:
        # The step's tokens join the segmentation first; the base then scores this step's window (if any).
        cfg = self.config
        sentences: _Sentences = state.extra.setdefault(SENTENCES, _Sentences())
        if not step.is_prefill:
            if sentences.cursor is None:  # the first decoded position: sentences are of the output only
                sentences.cursor = state.logical_len - step.new_tokens
            if step.token_ids is None:
                raise RuntimeError("skipkv: the step carries no token ids although needs_token_ids() is true")
            # Every id known from the cursor on (an id that comes a step late, as the contract allows, is still in
            # the recent window, which no compaction touches). Without boundary ids, fixed segments.
            ids = step.token_ids(sentences.cursor, state.logical_len)
            bounded = bool(self.boundaries)
            self.sentences_closed_total += track(
                sentences, sentences.cursor, ids, self.boundaries,
                cfg.sentence_max_tokens if bounded else cfg.segment_tokens,
                cfg.sentence_min_tokens if bounded else 1, cfg.max_tracked_sentences)
            sentences.cursor += len(ids)
        return super().on_step_end(state, step)

    def score(self, state: RequestState, window: ObservationWindow) -> torch.Tensor:
        scores, state.extra[PENALIZED] = skipkv_scores(window, state.extra[SENTENCES].spans, self.config)
        return scores

    def keep(self, state: RequestState, positions: torch.Tensor, scores: torch.Tensor) -> KeepPlan | None:
        plan = super().keep(state, positions, scores)
        penalized: torch.Tensor = state.extra.pop(PENALIZED)
        cfg = self.config
        candidates = penalized[cfg.sink_tokens:penalized.numel() - cfg.recent_tokens]
        self.sentence_penalized_tokens_total += int(candidates.sum())
        if plan is not None:
            self.sentence_evicted_tokens_total += int((penalized & ~torch.isin(positions, plan.keep)).sum())
        return plan

    def stats(self) -> dict[str, int]:
        return {"sentences_closed_total": self.sentences_closed_total,
                "sentence_penalized_tokens_total": self.sentence_penalized_tokens_total,
                "sentence_evicted_tokens_total": self.sentence_evicted_tokens_total}
