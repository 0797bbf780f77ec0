"""Replay forwards (:class:`~sgl_sparse.contract.Replay`, KVzip's context reconstruction): extra extend forwards of
one request, run inside the step that completed its prompt, right after that step's forward.

A replay is an extend of the request's own ``req_to_token`` row: its prefix is the request's logical length ``L``
(the retained slots, sentinels where evicted, which attention skips), its ``r`` new tokens sit at logical positions
``L .. L + r - 1``, their K/V in ``r`` slots taken from SGLang's allocator for this forward only::

    row:   [ retained prompt slots (sentinels where evicted) | r temporary slots ] [ unused ]
            0                                               L                   L + r

After the forward the row's ``[L, L + r)`` is restored and the slots are freed, so the request's row, length,
kept set and sampled token are those of the step. The forward is ``ModelRunner.forward`` on a ``ForwardBatch``
that SGLang's own ``ForwardBatch.init_new`` builds from a shallow copy of the step's ``ScheduleBatch`` narrowed to
this request (the fields an extend reads replaced; logprobs, sampling, grammar, multimodal and speculative fields
cleared). The replay's context (:class:`ActiveReplay`) is handed to the attention backend that runs that forward,
for that forward only (:func:`replaying`), and the backend hands each layer's queries and keys to its
:meth:`~ActiveReplay.on_layer`. (Not on the ``ForwardBatch``: SGLang's eager runner copies the batch into its own
buffers field by field before the model runs, so an attribute of ours would not reach the backend.) Served on the
CPU server (torch_native base), one request at a time.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from sgl_sparse.contract import Replay, ReplayLayer, RequestState
from sgl_sparse.slots import to_device

logger = logging.getLogger(__name__)


class ReplayScorer(Protocol):
    """Who gets a replay's layers: the request's method (KVzip's own replays), or a prune's scorer
    (``kvzip_global``, :class:`sgl_sparse.methods.eviction.kvzip.RangeScores`)."""

    @property
    def name(self) -> str: ...

    def on_replay_layer(self, state: RequestState, replay: Replay, layer: ReplayLayer) -> None: ...


@dataclass
class ActiveReplay:
    """What the attention backend needs while a replay's forward runs."""

    scorer: ReplayScorer
    state: RequestState
    replay: Replay
    slots: torch.Tensor  # the retained positions' slots, in position order (device)
    k_pos: torch.Tensor  # their logical positions (CPU)
    model_runner: Any

    def on_layer(self, layer: Any, q: torch.Tensor, k: torch.Tensor) -> None:
        """A layer of the replay ran: its queries and keys (``[r, H * D]``-shaped as the backend gets them)."""
        r = len(self.replay.token_ids)
        q3 = q.reshape(r, layer.tp_q_head_num, layer.qk_head_dim)
        k3 = k.reshape(r, layer.tp_k_head_num, layer.qk_head_dim)
        buf = self.model_runner.token_to_kv_pool.get_key_buffer(layer.layer_id)
        self.scorer.on_replay_layer(self.state, self.replay, ReplayLayer(
            layer.layer_id, q3, k3, buf, self.slots, self.k_pos, float(layer.scaling)))


@dataclass(frozen=True)
class Room:
    """Bounds on a replay's tokens: ``context``, the request's row and the model's context (RoPE positions) after
    its ``L`` tokens; ``memory``, the allocator's free slots plus what the prefix tree can evict (:func:`run`
    evicts it). A plan is made within ``context``; the step re-plans within :attr:`tokens` only when it would not
    fit ``memory``, and counts that (a busy server's chunks are then shorter than an idle one's)."""

    context: int
    memory: int

    @property
    def tokens(self) -> int:
        return max(0, min(self.context, self.memory))


def room(model_runner: Any, logical_len: int, tree: Any) -> Room:
    """The :class:`Room` of a replay of a request of ``logical_len`` tokens. Memory counts the tree's evictable
    slots: free slots alone made the chunks, hence the kept set and the answer, depend on what other requests had
    left cached, so the same request answered differently on a flushed and on a warm server."""
    width = int(model_runner.req_to_token_pool.req_to_token.shape[1])
    context = min(width, int(model_runner.model_config.context_len)) - logical_len
    memory = int(model_runner.token_to_kv_pool_allocator.available_size())
    if tree is not None and not tree.disable:
        memory += int(tree.evictable_size())
    return Room(max(0, context), memory)


@contextlib.contextmanager
def replaying(backend: Any, active: ActiveReplay) -> Iterator[None]:
    """``backend`` (the model runner's attention backend, ours) runs ``active``'s forward inside this block."""
    if not hasattr(backend, "replay"):
        raise RuntimeError(f"sgl_sparse: a replay forward needs sgl_sparse's attention backend, not "
                           f"{type(backend).__name__}")
    backend.replay = active
    try:
        yield
    finally:
        backend.replay = None


def run(tree: Any, batch: Any, req: Any, state: RequestState, scorer: ReplayScorer,
        replays: list[Replay], model_runner: Any) -> None:
    """Run ``replays`` of ``req`` (whose step just ran), in order, each layer handed to ``scorer``; ``tree``: the
    prefix tree whose evictable slots the room counted (None: none)."""
    from sglang.srt.mem_cache.common import evict_from_tree_cache

    req_to_token = model_runner.req_to_token_pool.req_to_token
    allocator = model_runner.token_to_kv_pool_allocator
    row = int(req.req_pool_idx)
    n = state.logical_len
    k_pos = state.kept
    slots = req_to_token[row][to_device(k_pos, req_to_token.device)].long()
    for replay in replays:
        r = len(replay.token_ids)
        if tree is not None:  # the room counted the tree's evictable slots: take them as SGLang's alloc does
            evict_from_tree_cache(tree, r)
        loc = allocator.alloc(r)
        if loc is None:
            raise RuntimeError(f"sgl_sparse: {scorer.name}: no {r} free KV slots for a replay of request {req.rid} "
                               "(the replay's room is bounded by the free and tree-evictable slots when it is "
                               "planned)")
        saved = req_to_token[row, n:n + r].clone()
        req_to_token[row, n:n + r] = loc.to(req_to_token.dtype)
        active = ActiveReplay(scorer, state, replay, slots, k_pos, model_runner)
        try:
            with replaying(model_runner.attn_backend, active):
                model_runner.forward(_forward_batch(batch, req, replay.token_ids, n, loc, model_runner))
        finally:
            req_to_token[row, n:n + r] = saved
            allocator.free(loc)


def _forward_batch(batch: Any, req: Any, token_ids: list[int], prefix: int, loc: torch.Tensor,
                   model_runner: Any) -> Any:
    """A one-request extend ``ForwardBatch``: ``token_ids`` after ``prefix`` logical positions, K/V into ``loc``."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    r = len(token_ids)
    device = loc.device
    b = copy.copy(batch)
    b.reqs = [req]
    b.forward_mode = ForwardMode.EXTEND
    b.global_forward_mode = None
    b.input_ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
    b.prefill_input_ids_cpu = None
    b.req_pool_indices = torch.tensor([req.req_pool_idx], dtype=torch.int64, device=device)
    b.req_pool_indices_cpu = torch.tensor([req.req_pool_idx], dtype=torch.int64)
    b.seq_lens = torch.tensor([prefix + r], dtype=torch.int64, device=device)
    b.seq_lens_cpu = torch.tensor([prefix + r], dtype=torch.int64)
    b.orig_seq_lens = torch.tensor([prefix + r], dtype=torch.int32, device=device)
    b.seq_lens_sum = prefix + r
    b.out_cache_loc = loc
    b.extend_lens, b.prefix_lens, b.extend_num_tokens = [r], [prefix], r
    b.extend_logprob_start_lens = [r]
    b.return_logprob, b.top_logprobs_nums, b.token_ids_logprobs = False, None, None
    b.extend_input_logprob_token_ids = None
    b.return_hidden_states, b.is_prefill_only, b.has_grammar = False, False, False
    b.sampling_info = None
    b.spec_info = None
    # One text-only request (runtime.multimodal_replay_problem refuses replays of requests with multimodal inputs):
    # M-RoPE models index this list per request, and None there means plain text positions.
    b.multimodal_inputs = [None]
    b.encoder_cached, b.encoder_lens, b.encoder_lens_cpu = None, None, None
    b.encoder_out_cache_loc = None
    b.input_embeds, b.replace_embeds, b.replace_positions = None, None, None
    b.mix_running_indices = None
    b.global_num_tokens, b.global_num_tokens_for_logprob = None, None
    b.tbo_split_seq_index = None
    b.is_extend_in_batch = True
    b.dllm_config = None
    return ForwardBatch.init_new(b, model_runner, capture_hidden_mode=None, return_hidden_states_before_norm=False)
