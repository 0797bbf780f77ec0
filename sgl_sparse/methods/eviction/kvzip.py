"""KVzip, query-agnostic KV cache compression with context reconstruction (Kim et al., 2025,
arXiv:2505.23416, https://github.com/snu-mllab/KVzip): score each context KV entry by the most attention it
receives while the model reconstructs the context, then keep the best.

Once a prompt is complete (its final prefill chunk) and more than the target is retained, the method asks the
runtime for *replay* forwards (:class:`~sgl_sparse.contract.Replay`): the prompt's text after the first
``sink_tokens`` retained tokens is cut into ``chunk_size``-token chunks, and chunk ``i`` is fed, teacher-forced,
as KVzip's ``self_task`` builds it::

    chunk 0:  prompt_ids                                       + postfix_ids + chunk tokens
    chunk i:  next_prompt_ids + the previous chunk's last ``prev_postfix_size`` tokens + postfix_ids + chunk

(``prompt_ids``: "\\n\\nRepeat the previous context exactly."; ``next_prompt_ids``: "\\n\\nRepeat the part of the
previous context exactly, starting with "; ``postfix_ids``: the chat template's assistant opener; all three
tokenized by the launcher from the served tokenizer when left empty). A replay attends every retained key of the
request and, causally, itself, at the logical positions after the prompt; its K/V is discarded after its forward.

Score of one replay, per layer (KVzip's ``KVScore._get_score``): the replay's queries' softmax over the sink keys,
the keys of the chunk being reconstructed and the replay's own keys (causal), restricted to the chunk's keys, and
maximised over the queries and over the query heads of each GQA group. Computed per block of
``QUERY_BLOCK`` queries and one layer at a time, so memory stays ``O(block x (chunk + replay))`` per head.

**Token-shared variant** (SparseEngine's ``kvzip_global``, not the original's per-head eviction): the original
keeps a non-uniform set of (layer, KV head, token) pairs (a global threshold over all of them, ``level=pair``;
``pair-uniform`` is a ratio per head). One pool slot here holds a token's K/V for every layer and head, so a token
is kept or evicted whole: its score is the maximum over KV heads and layers (it stays if any head of any layer
attends to it strongly while reconstructing). The kept set is the first ``sink_tokens``, the last
``recent_tokens`` and the best-scored rest, ``budget`` tokens (or, with ``ratio`` > 0, ``ceil(ratio x retained)``,
the original's ``kv.prune(ratio)``), ties to the earlier position. SparseEngine's variant differs in its softmax,
which spans the whole context plus the replay; this one follows the original's chunk-local softmax.

When: once per request, after its prompt's final prefill chunk (decode tokens append without further eviction,
as in SparseEngine's KVzip). A Chain Cache continuation reconstructs its whole logical prompt (the previous turns
included) over the KV it kept, and scores the retained keys only. A replay is bounded by the model's context
length after the prompt: the chunk shrinks to fit; a prompt that leaves no room (fewer than ``MIN_CHUNK`` tokens)
is not scored and keeps everything (``unscored_requests`` in ``/server_info``). Cost: the replays process about
the prompt's length again (plus ``overhead`` per chunk), each chunk attending the whole retained prompt.

Defaults: ``chunk_size`` 2,048 (kvpress's and SparseEngine's; the original's ``self_task`` uses 2,000),
``prev_postfix_size`` 8 (the original's and kvpress's; SparseEngine 64), ``sink_tokens`` 4 (kvpress's
``n_sink``; the original keeps its system prompt), ``budget`` 4,096 (SparseEngine's ``kvzip_token_budget``),
``ratio`` 0 (off; the original's demo prunes to 0.3), ``recent_tokens`` 0 (the original keeps only the system
prompt: its queries come after compression).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from sgl_sparse.config import MethodConfig
from sgl_sparse.contract import (
    Family,
    KeepPlan,
    Replay,
    ReplayLayer,
    RequestState,
    SparseMethod,
    StepInfo,
)
from sgl_sparse.methods.eviction.base import topk_keep
from sgl_sparse.registry import register_method

logger = logging.getLogger(__name__)

SCORES = "kvzip_scores"  # state.extra: [num_kept] float32, aligned with the kept set at the final prefill
PLAN = "kvzip_plan"  # state.extra: (forwards, tokens) of the replays planned, counted once they ran
QUERY_BLOCK = 256  # replay queries scored at once (softmax rows are independent: blocking is exact)
MIN_CHUNK = 16  # a replay with room for fewer context tokens is not run

# KVzip's self_task prompts (model/wrapper.py), tokenized by the launcher when a config leaves them empty.
FIRST_PROMPT = "\n\nRepeat the previous context exactly."
NEXT_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with "
# The original's postfix for a model without a known chat template (model/template.py).
FALLBACK_POSTFIX = "\n\nAnswer: "


def _token_ids(ids: Any) -> bool:
    return isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)


@dataclass(frozen=True)
class KVzipConfig(MethodConfig):
    method_name = "kvzip"
    budget: int = 4096  # retained tokens after the compaction, sink and recent included (ratio 0)
    ratio: float = 0.0  # > 0: keep ceil(ratio * retained) instead of budget (the original's prune ratio)
    chunk_size: int = 2048  # context tokens reconstructed per replay forward
    prev_postfix_size: int = 8  # the previous chunk's last tokens repeated in the next replay's prompt
    sink_tokens: int = 4  # the first retained tokens: always kept, and in every replay's softmax
    recent_tokens: int = 0  # the last retained tokens, always kept
    prompt_ids: list[int] = field(default_factory=list)  # empty: the launcher tokenizes FIRST_PROMPT
    next_prompt_ids: list[int] = field(default_factory=list)  # empty: the launcher tokenizes NEXT_PROMPT
    postfix_ids: list[int] = field(default_factory=list)  # empty: the launcher derives the chat template's

    def target(self, retained: int) -> int:
        """How many of ``retained`` tokens the compaction keeps."""
        if self.ratio > 0:
            return max(self.sink_tokens + self.recent_tokens, math.ceil(self.ratio * retained))
        return self.budget

    def validate(self) -> None:
        self.require(self.budget >= 1, "budget", "must be >= 1")
        self.require(0.0 <= self.ratio <= 1.0, "ratio", "must be in [0, 1] (0: use budget)")
        self.require(self.chunk_size >= MIN_CHUNK, "chunk_size", f"must be >= {MIN_CHUNK}")
        self.require(self.prev_postfix_size >= 0, "prev_postfix_size", "must be >= 0")
        self.require(self.sink_tokens >= 0, "sink_tokens", "must be >= 0")
        self.require(self.recent_tokens >= 0, "recent_tokens", "must be >= 0")
        self.require(self.sink_tokens + self.recent_tokens <= self.budget, "sink_tokens",
                     f"+ recent_tokens must be <= budget ({self.budget})")
        for name in ("prompt_ids", "next_prompt_ids", "postfix_ids"):
            self.require(_token_ids(getattr(self, name)), name, "must be a list of token ids (ints >= 0)")

    @property
    def overhead(self) -> int:
        """Replay tokens besides the chunk's, at most (a later chunk's prompt and the previous tokens)."""
        return max(len(self.prompt_ids), len(self.next_prompt_ids) + self.prev_postfix_size) + len(self.postfix_ids)


def chunk_scores(q: torch.Tensor, k_sink: torch.Tensor, k_chunk: torch.Tensor, k_replay: torch.Tensor,
                 scale: float, block: int = QUERY_BLOCK) -> torch.Tensor:
    """KVzip's score of one layer's chunk keys, token-shared over KV heads: ``[c]`` float32.

    ``q`` ``[r, H, D]`` and ``k_replay`` ``[r, Hkv, D]``: the replay's queries and keys (replay query ``i`` sees
    replay keys ``<= i``); ``k_sink`` ``[s, Hkv, D]`` and ``k_chunk`` ``[c, Hkv, D]``: context keys every replay
    query sees. Per KV head: the softmax of each query (of its GQA group) over sink, chunk and replay keys, the
    chunk's part maximised over the queries and the group; then maximised over KV heads."""
    r, n_heads, d = q.shape
    n_kv = k_chunk.shape[1]
    s, c = k_sink.shape[0], k_chunk.shape[0]
    qf = q.float().view(r, n_kv, n_heads // n_kv, d)
    k_ctx = torch.cat([k_sink, k_chunk]).float()
    k_rep = k_replay.float()
    best = torch.zeros(n_kv, c, dtype=torch.float32, device=q.device)
    for i0 in range(0, r, block):
        i1 = min(i0 + block, r)
        qb = qf[i0:i1]
        ctx = torch.einsum("qhgd,khd->hgqk", qb, k_ctx) * scale  # [Hkv, G, b, s + c]
        rep = torch.einsum("qhgd,khd->hgqk", qb, k_rep[:i1]) * scale  # [Hkv, G, b, i1]
        future = torch.arange(i1, device=q.device)[None, :] > torch.arange(i0, i1, device=q.device)[:, None]
        rep = rep.masked_fill(future, float("-inf"))
        probs = torch.cat([ctx, rep], dim=-1).softmax(-1)[..., s:s + c]
        best = torch.maximum(best, probs.amax(dim=(1, 2)))
    return best.amax(0)


def build_replays(ids: list[int], kept: torch.Tensor, logical_len: int, cfg: KVzipConfig,
                  max_tokens: int) -> list[Replay]:
    """The reconstruction forwards of a prompt whose token ids are ``ids`` (``logical_len`` of them) and whose
    retained positions are ``kept``: chunks of the text after the sink, each replay at most ``max_tokens``
    tokens; a chunk with no retained position scores nothing and is skipped. Empty when there is no room."""
    n = kept.numel()
    start = int(kept[cfg.sink_tokens]) if n > cfg.sink_tokens else logical_len
    chunk = min(cfg.chunk_size, max_tokens - cfg.overhead)
    if chunk < MIN_CHUNK or start >= logical_len:
        return []
    out = []
    for a in range(start, logical_len, chunk):
        b = min(a + chunk, logical_len)
        if not bool(((kept >= a) & (kept < b)).any()):
            continue
        head = cfg.prompt_ids if a == start else [*cfg.next_prompt_ids, *ids[max(start, a - cfg.prev_postfix_size):a]]
        out.append(Replay([*head, *cfg.postfix_ids, *ids[a:b]], (a, b)))
    return out


def score_replay_layer(scores: torch.Tensor, replay: Replay, layer: ReplayLayer, sink_tokens: int) -> None:
    """One layer of ``replay`` into ``scores`` (``[num_kept]`` float32, aligned with ``layer.k_pos``): its
    :func:`chunk_scores` of the retained keys in ``replay.scored``, maximised into what earlier layers and replays
    gave them (token-shared: the maximum over layers too). The sink: the first ``sink_tokens`` retained positions
    before the chunk (a chunk of the method starts after them; a prune's range may start anywhere)."""
    lo, hi = replay.scored
    sink = (layer.k_pos < lo).nonzero().flatten()[:sink_tokens]
    in_chunk = ((layer.k_pos >= lo) & (layer.k_pos < hi)).nonzero().flatten()
    k_sink, _ = layer.keys(sink)
    k_chunk, _ = layer.keys(in_chunk)
    s = chunk_scores(layer.queries, k_sink, k_chunk, layer.replay_keys, layer.scale).cpu()
    scores[in_chunk] = torch.maximum(scores[in_chunk], s)


def range_replays(ids: list[int], kept: torch.Tensor, ranges: list[tuple[int, int]], cfg: KVzipConfig,
                  max_tokens: int) -> list[Replay]:
    """The reconstruction forwards that score the retained positions of ``ranges`` (Prefix-Cache Pruning's
    ``kvzip_global``): each range cut into chunks, each replay at most ``max_tokens`` tokens. A chunk at position 0
    gets KVzip's first instruction, any other the next-part one with the ``prev_postfix_size`` tokens before it (a
    range starts mid-context). Chunks with no retained position are skipped. Empty when there is no room."""
    chunk = min(cfg.chunk_size, max_tokens - cfg.overhead)
    if chunk < MIN_CHUNK:
        return []
    out = []
    for lo, hi in ranges:
        for a in range(lo, hi, chunk):
            b = min(a + chunk, hi)
            if not bool(((kept >= a) & (kept < b)).any()):
                continue
            head = cfg.prompt_ids if a == 0 else [*cfg.next_prompt_ids, *ids[max(0, a - cfg.prev_postfix_size):a]]
            out.append(Replay([*head, *cfg.postfix_ids, *ids[a:b]], (a, b)))
    return out


class RangeScores:
    """KVzip's token-shared scores of a request's retained positions, filled by the layers of its replays: the
    scorer a prune's ``kvzip_global`` hands the replay runner (what a method's ``on_replay_layer`` is to its own
    replays). ``scores`` ``[num_kept]`` float32, 0 where no replay scored."""

    name = "kvzip_global"

    def __init__(self, num_kept: int, sink_tokens: int) -> None:
        self.scores = torch.zeros(num_kept, dtype=torch.float32)
        self.sink_tokens = sink_tokens

    def on_replay_layer(self, state: RequestState, replay: Replay, layer: ReplayLayer) -> None:
        score_replay_layer(self.scores, replay, layer, self.sink_tokens)


@register_method
class KVzip(SparseMethod[KVzipConfig]):
    name = "kvzip"
    family = Family.EVICTION
    config_cls = KVzipConfig
    evicts = True

    def __init__(self, config: KVzipConfig) -> None:
        super().__init__(config)
        self._stats = {"scored_requests": 0, "unscored_requests": 0, "replay_forwards": 0, "replay_tokens": 0}

    def needs_token_ids(self) -> bool:
        return True

    def replays(self, state: RequestState, step: StepInfo, max_tokens: int) -> list[Replay]:
        cfg = self.config
        if not step.final_prefill or state.num_kept <= cfg.target(state.num_kept):
            return []
        ids = list(step.token_ids(0, state.logical_len)) if step.token_ids is not None else []
        out = build_replays(ids, state.kept, state.logical_len, cfg, max_tokens) if len(ids) == state.logical_len \
            else []
        # Idempotent (the runtime may re-plan with less room): what ran is counted in on_step_end.
        if not out:
            state.extra.pop(SCORES, None)
            state.extra.pop(PLAN, None)
            self._stats["unscored_requests"] += 1
            n = self._stats["unscored_requests"]
            if n == 1 or n % 100 == 0:
                # Not silent: such a request is served uncompressed, e.g. every prompt that fills the model's context
                # (a 16K prompt on a 16K model leaves no positions for the replay), and would pass for KVzip's result.
                logger.warning("kvzip: a %d-token prompt left no room for a replay (%d tokens of context or KV memory "
                               "after it), so it keeps every token uncompressed; %d such requests so far "
                               "(unscored_requests in /server_info)", state.logical_len, max_tokens, n)
            return []
        state.extra[SCORES] = torch.zeros(state.num_kept, dtype=torch.float32)
        state.extra[PLAN] = (len(out), sum(len(r.token_ids) for r in out))
        return out

    def on_replay_layer(self, state: RequestState, replay: Replay, layer: ReplayLayer) -> None:
        score_replay_layer(state.extra[SCORES], replay, layer, self.config.sink_tokens)

    def on_step_end(self, state: RequestState, step: StepInfo) -> KeepPlan | None:
        scores = state.extra.pop(SCORES, None)
        if scores is None:
            return None
        forwards, tokens = state.extra.pop(PLAN)
        self._stats["scored_requests"] += 1
        self._stats["replay_forwards"] += forwards
        self._stats["replay_tokens"] += tokens
        if step.max_over_ranks is not None:  # TP: each rank scored its own heads; the maximum is every head's
            scores = step.max_over_ranks(scores)
        cfg = self.config
        kept = state.kept
        keep = topk_keep(kept, scores, cfg.target(kept.numel()), cfg.sink_tokens, cfg.recent_tokens)
        return KeepPlan(keep) if keep.numel() < kept.numel() else None

    def stats(self) -> dict[str, Any]:
        return dict(self._stats)
