"""The lifecycle contract between the serving runtime and a sparse-KV method.

One contract serves four families:

* eviction (StreamingLLM, SnapKV, H2O, ...): score the prompt in :meth:`SparseMethod.on_observation`,
  return a smaller keep-set from :meth:`SparseMethod.on_step_end`; the runtime frees the dropped
  physical slots.
* dynamic selection (Quest, OmniKV, RetroInfer): keep every slot; a :class:`PageSelector`
  (:attr:`SparseMethod.selector`) picks, per decode step, layer and KV head, the pages attention
  reads, batched on the device.
* compression / quantization (Palu, DeltaKV, KIVI, FP8, ...): a :class:`KVStore`
  (:attr:`SparseMethod.store`) owns how K/V is laid out in the pool, written and read by attention.
* dense: every hook is a no-op, and the runtime must then behave exactly like vanilla SGLang.

Positions are always *logical* (index of the token in the request's sequence, the RoPE position).
Which physical pool slot holds a logical position is the runtime's business, never the method's:
see docs/architecture.md for the map. Hooks receive plain torch tensors and import nothing from
SGLang, so a method is testable with :mod:`sgl_sparse.reference` alone.

Hook order (the server, ``sgl_sparse/integration/``, and the reference driver, :mod:`sgl_sparse.reference`,
both follow it; ``tests/test_contract.py`` checks the reference driver, ``tests/test_hook_order_e2e.py``
a real server, with a method that logs every call). Per request; the server drives these for methods
that evict or observe (``evicts``, ``observation_window() > 0``), and ``on_prune`` for any request that
prunes its own prompt: a method with neither keeps their no-op defaults (:func:`served_hooks_problem`
refuses one that overrides them), and the server then runs no per-request Python between admission and
finish::

    new_state (+ restore_state on a prefix hit) once, at admission (before its first forward)
    for each prefill chunk:
        on_prefill_chunk                       before the chunk's forward
        (the forward: selector hooks, below)
        on_prune                               final chunk of a request that prunes its own prompt
                                               (custom_params sgl_sparse_prune): those positions leave
                                               the retained set now, before anything below plans
        replays                                final chunk only: extra forwards (KVzip), each one's
            on_replay_layer                    layers in order, as they run
        on_observation                         if wants_observation (default: final chunk)
        on_step_end                            after the forward step (may shrink the keep-set)
    for each decode step:
        (the forward)
        on_observation                         if wants_observation
        on_step_end
    on_finish                                  once: what the prefix tree stores for later turns

A request's own prune (docs/prefix-cache-pruning.md, "Per request") is, to its method, an eviction that
happened just before the method's end-of-prompt planning: the prompt's forward attended every position (so
its first output token did), then :meth:`SparseMethod.on_prune` hands the method the positions leaving
(``state.kept`` still holds them) and the runtime frees them and sets ``state.kept`` to the rest. Every
hook after it sees only the rest: replays and the observation window read the remaining keys, a
:class:`KeepPlan` is checked against them (re-selecting a pruned position is a contract error, so a pruned
range never comes back), and a budget counts retained tokens *after* the prune (the pruned ones are not
candidates and take no share of it), exactly as after an eviction an earlier turn made (a Chain Cache
continuation). Positions an earlier plan or turn already evicted are not handed over again: what leaves is
the union.

A method with a :class:`PageSelector` is also driven per layer inside each forward, batched over the
whole step (not per request), in layer order: ``on_kv_write`` wherever a selecting layer's K is written
(prefill and decode); in decode, ``select`` before a selecting layer's attention (or, for a selector
that ``attends``, ``attend`` instead of it) and ``observe`` after an observing (dense) layer's
attention; then, for a selector that ``maintains``, ``after_step`` once after each forward step (prefill
and decode, outside CUDA graphs, every layer's K/V in the pool). There are no per-request per-layer
hooks: per-request Python per layer cannot run inside a CUDA-graph replay.

A method with a :class:`KVStore` (:attr:`SparseMethod.store`) owns the pool's layout: its ``write``
runs wherever SGLang stores a layer's K/V (prefill and decode), its ``decode`` is every layer's decode
attention and its ``prefix`` the cached-prefix part of every extend. An eviction method over a store
(a composition, :mod:`sgl_sparse.compose`) is served when the store's layout can lose single tokens
(:meth:`KVStore.eviction_problem`); a store beside selection is refused at launch for now
(:func:`served_hooks_problem`).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import torch

from sgl_sparse.config import MethodConfig
from sgl_sparse.errors import SparseConfigError


class Family(enum.StrEnum):
    DENSE = "dense"
    EVICTION = "eviction"
    SELECTION = "selection"
    COMPRESSION = "compression"
    QUANTIZATION = "quantization"


class PrefixReuse(enum.StrEnum):
    """How a method's KV may be reused by later requests through the prefix tree."""

    RADIX = "radix"  # full KV per logical token: any request with the same fingerprint may share it
    CHAIN = "chain"  # compacted KV: a continuation resumes from the retained set (Chain Cache)
    NONE = "none"  # KV is not reusable (e.g. request-specific reconstruction state)


@dataclass
class RequestState:
    """Per-request state a method owns. Created by :meth:`SparseMethod.new_state`.

    ``logical_len``: tokens whose K/V exist (prompt processed so far + decoded). ``num_kept``: how
    many of them are physically retained. ``kept``: the sorted int64 CPU tensor of retained logical
    positions. The runtime keeps both on the host from what it applied (no device sync): the kept
    set is a sorted base plus the contiguous tail appended since the last :class:`KeepPlan`, built
    on demand. Methods put their own statistics (scores, page summaries) in ``extra``.
    """

    rid: str
    logical_len: int = 0
    num_kept: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    _base: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64), repr=False)
    _tail_start: int = field(default=0, repr=False)
    # The logical length from which this request's K/V were computed under a sparse view: its first applied plan
    # that dropped positions, or a restored prefix with hidden positions. None: every position it computed saw
    # its whole prefix. The tree keeps it with the finished sequence, so a dense match never reads such K/V.
    sparse_from: int | None = None

    @property
    def kept(self) -> torch.Tensor:
        if self._tail_start >= self.logical_len:
            return self._base
        return torch.cat([self._base, torch.arange(self._tail_start, self.logical_len)])

    @property
    def tail_start(self) -> int:
        """The logical length when the kept set was last set (a plan applied, or the matched prefix
        restored): every position from there on is retained, so for any ``d >= tail_start`` the kept
        set restricted to ``[0, d)`` is exactly the state this request had at length ``d``."""
        return self._tail_start

    def advance(self, new_tokens: int) -> None:
        """Runtime: ``new_tokens`` were appended and are retained."""
        self.logical_len += new_tokens
        self.num_kept += new_tokens

    def set_kept(self, kept: torch.Tensor, logical_len: int | None = None) -> None:
        """Runtime: a :class:`KeepPlan` was applied (or a matched prefix restored, with its length)."""
        if logical_len is not None:
            self.logical_len = logical_len
        if self.sparse_from is None and int(kept.numel()) < self.logical_len:
            self.sparse_from = self.logical_len
        self._base = kept.to(dtype=torch.int64, device="cpu")
        self._tail_start = self.logical_len
        self.num_kept = int(self._base.numel())


@dataclass(frozen=True)
class PrefillChunk:
    """One chunk of a (possibly chunked) prefill: logical positions ``[start, end)`` of ``total``."""

    start: int
    end: int
    total: int

    @property
    def is_final(self) -> bool:
        return self.end == self.total


AllReduce = Callable[[torch.Tensor], torch.Tensor]  # sums a tensor over the TP group; returns the sum
MaxOverRanks = Callable[[torch.Tensor], torch.Tensor]  # the element-wise maximum over the TP group's ranks


@dataclass(frozen=True)
class ObservationWindow:
    """The end of a prompt, for methods that score the prompt with its last queries (SnapKV).

    ``queries[layer]``: post-RoPE queries of the last ``w`` prompt tokens, ``[w, n_heads, head_dim]``,
    at logical positions ``q_pos``. The retained keys (the window included) are rows ``key_rows``
    (``[n]`` int64, on the buffer's device) of ``key_buffer(layer)`` (``[N, n_kv_heads, head_dim]``;
    on a server the KV pool's whole key buffer, so a kernel reads them in place), at sorted logical
    positions ``k_pos`` (``[n]``, CPU). ``keys(layer)`` gathers them, for plain-torch methods.
    """

    queries: dict[int, torch.Tensor]
    q_pos: torch.Tensor
    key_buffer: Callable[[int], torch.Tensor]
    key_rows: torch.Tensor
    k_pos: torch.Tensor
    num_layers: int
    scale: float  # the attention softmax scale (1/sqrt(head_dim) for Llama)
    # Tensor parallelism: this rank holds a shard of the heads (``queries`` and the keys are its heads only),
    # and ``all_reduce`` sums a tensor over the ranks of the TP group (the same call on every rank, in the
    # same order). ``None``: one rank holds every head.
    all_reduce: AllReduce | None = None

    def keys(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """That layer's retained keys ``[n, n_kv_heads, head_dim]`` (a copy) and their positions."""
        return self.key_buffer(layer)[self.key_rows], self.k_pos

    def reduce_heads(self, scores: torch.Tensor) -> torch.Tensor:
        """``scores`` summed over this rank's heads -> summed over every head of the model.

        An evicting method must call it on the per-position scores it selects from, before selecting: under
        TP every rank frees the same slots of its own pool and its scheduler admits from the same free count,
        so every rank must pick the identical keep set, and a set picked from one rank's heads would differ
        from the others' (diverging allocators, then a hang in the next collective). After the sum every rank
        holds bitwise the same scores (NCCL and gloo return one result to all ranks), and :func:`topk_keep
        <sgl_sparse.methods.eviction.base.topk_keep>` breaks ties by position, so the sets are identical.
        Call it the same number of times on every rank: decide *whether* to score only from replicated data
        (lengths, step counts, earlier keep sets), never from local scores. Identity without TP."""
        if self.all_reduce is None:
            return scores
        return self.all_reduce(scores.float().contiguous())


@dataclass(frozen=True)
class StepInfo:
    """End of a forward step for one request. ``new_tokens`` logical positions were appended."""

    is_prefill: bool
    new_tokens: int
    decoded_tokens: int  # output tokens so far (for decode-interval triggers)
    final_prefill: bool = False  # this step completed the prompt
    # For a method whose ``needs_token_ids()`` is true (SkipKV finds sentence boundaries in them), None
    # otherwise: ``token_ids(start, end)`` gives the ids the runtime knows at logical positions
    # ``[start, end)``, a prefix of them (possibly empty). The server's step knows every id whose K/V it wrote
    # (a decode token's step runs after SGLang appended the sampled token, integration/step.py); a method must
    # still take a prefix (a driver may know the newest id a step late). Valid during the hook call only.
    token_ids: Callable[[int, int], Sequence[int]] | None = None
    # Tensor parallelism: a score that is a maximum over heads (KVzip's replays) holds only this rank's heads;
    # ``max_over_ranks`` takes its element-wise maximum over the TP group (every rank then holds the same scores
    # and keeps the same set). The same call on every rank, decided from replicated data only (as
    # ``ObservationWindow.reduce_heads``). ``None``: one rank holds every head.
    max_over_ranks: MaxOverRanks | None = None


@dataclass(frozen=True)
class Replay:
    """An extra forward a method asks for after a prompt is complete (KVzip's context reconstruction): the
    tokens ``token_ids`` at logical positions ``logical_len, logical_len + 1, ...`` of the request, attending
    every retained key of the request and, causally, each other. Their K/V lives in temporary slots for that
    forward only: the request's kept set, its length and its output are as before. ``scored``: the logical
    range ``[lo, hi)`` of the request's keys this replay scores (the method's own bookkeeping)."""

    token_ids: list[int]
    scored: tuple[int, int]


@dataclass(frozen=True)
class ReplayLayer:
    """One layer of a :class:`Replay`'s forward, after its attention: the replay's post-RoPE queries
    ``queries`` (``[r, n_heads, head_dim]``, at logical positions ``logical_len + i``) and keys ``replay_keys``
    (``[r, n_kv_heads, head_dim]``); the request's retained keys are rows ``key_rows`` of ``key_buffer``
    (``[N, n_kv_heads, head_dim]``, the layer's key pool on a server) at sorted logical positions ``k_pos``
    (CPU), as in :class:`ObservationWindow`."""

    layer: int
    queries: torch.Tensor
    replay_keys: torch.Tensor
    key_buffer: torch.Tensor
    key_rows: torch.Tensor
    k_pos: torch.Tensor
    scale: float

    def keys(self, select: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The retained keys (``select``: a bool mask or indices over them) ``[n, n_kv_heads, head_dim]`` and
        their logical positions."""
        if select is None:
            return self.key_buffer[self.key_rows], self.k_pos
        rows = self.key_rows[select.to(self.key_rows.device)]
        return self.key_buffer[rows], self.k_pos[select]


@dataclass(frozen=True)
class KeepPlan:
    """Physical eviction: the sorted logical positions to keep (layer- and head-uniform).

    The runtime frees every other retained slot the request owns and hides tree-owned ones from the
    request's view. Must be a subset of the current ``RequestState.kept``.
    """

    keep: torch.Tensor


@dataclass(frozen=True)
class KVGeometry:
    """The KV pool a :class:`PageSelector`'s metadata lives beside (this rank's share of it)."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_slots: int  # pool slots, SGLang's padding page included
    dtype: torch.dtype
    device: torch.device
    max_requests: int = 0  # rows of SGLang's req_to_token (request slots), for per-request buffers

    @property
    def num_pages(self) -> int:
        return -(-self.num_slots // self.page_size)


@dataclass(frozen=True)
class SelectorStep:
    """What :meth:`PageSelector.after_step` sees of a finished forward step: the batch's rows
    (``req_pool_indices``, device), each row's logical length before and after the step (CPU int64,
    known to the scheduler without a sync), the ``req_to_token`` table and each layer's K/V pool
    (``kv(layer) -> (k, v)``, ``[slots, Hkv, D]``)."""

    req_pool_indices: torch.Tensor
    old_lens: torch.Tensor
    new_lens: torch.Tensor
    req_to_token: torch.Tensor
    kv: Callable[[int], tuple[torch.Tensor, torch.Tensor]]


class PageSelector(ABC):
    """Dynamic selection for a whole decode batch, on the device (the server drives it).

    Each selecting layer of a decode step: the runtime writes the step's K/V, calls
    :meth:`on_kv_write` with it, then :meth:`select` with the batch's post-RoPE queries; attention
    then reads, for each (request, KV head), only the tokens of the pages selected. Every call sees
    fixed-shape device tensors and must not sync with the host (it runs inside CUDA-graph replays,
    where the batch has no request ids): per-request choices are data, e.g. a row with fewer pages
    than the selection width selects all of them (dense). Prefill writes also go through
    :meth:`on_kv_write` (prefill attention stays dense).

    A *page* is ``page_size`` consecutive logical positions of a request: with SGLang's paged
    allocator (``--page-size page_size``, which the launcher sets) one physical page, so metadata
    indexed by physical page (``slot // page_size``) is written by one owner in order and is shared,
    exact, with every request that matches it through the prefix tree.

    The metadata's memory is the method's: :meth:`metadata_bytes_per_token` is added to SGLang's KV
    cell size before the pool is sized, so the pool shrinks by what :meth:`allocate` then takes.

    A selector either returns pages (:meth:`select`, :attr:`pages_per_row`; the server's attention
    kernels read them) or, when ``attends``, computes the selecting layers' decode attention itself
    (:meth:`attend`: for reads that are not a list of tokens, e.g. RetroInfer's estimated clusters).
    One that ``maintains`` also gets :meth:`after_step` (e.g. to build an index over K/V that a
    step completed).

    A ``static`` selector's selection does not depend on the query (:meth:`select` does not read ``q``,
    which may be ``None``): it is per request and layer, set between steps by its method (PyramidKV's
    per-layer keep sets) and handed to the request's row in :meth:`bind`. Its selection is also what an
    extend step's queries read of their cached prefix (the CPU server), not only decode.
    """

    page_size: int
    attends: ClassVar[bool] = False
    maintains: ClassVar[bool] = False
    static: ClassVar[bool] = False

    @abstractmethod
    def selects(self, layer_id: int) -> bool:
        """Whether decode attention of this layer reads a selection (else all of the KV)."""

    @property
    def pages_per_row(self) -> int:
        """How many pages each (request, KV head) selects at most: the static width of :meth:`select`."""
        return 0

    def metadata_bytes_per_token(self, geometry: KVGeometry) -> int:
        """Device bytes of method metadata per KV token (rounded up), counted in SGLang's pool sizing."""
        return 0

    def allocate(self, geometry: KVGeometry) -> None:
        """Allocate the metadata buffers (once, after the KV pool, before CUDA-graph capture)."""
        return None

    def on_kv_write(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, decode: bool = False) -> None:
        """K (post-RoPE, ``[n, Hkv, D]``) was written at slots ``loc`` (``[n]``) of a selecting layer.
        ``decode``: a decode step's write, one new token per request, so no two slots of ``loc`` share a page
        but SGLang's padding page 0 (CUDA-graph padding rows): per-page metadata may be updated in place
        without a reduction over the slots."""
        return None

    def observes(self, layer_id: int) -> bool:
        """Whether this dense (non-selecting) layer's decode queries and keys feed later selections."""
        return False

    def observe(self, layer_id: int, q: torch.Tensor, k_cache: torch.Tensor, req_to_token: torch.Tensor,
                req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """After an observing layer's dense decode attention (this step's K written): ``q`` ``[bs, Hq, D]``,
        ``k_cache`` the layer's whole K pool ``[slots, Hkv, D]``; e.g. OmniKV picks here the tokens
        the following layers read. Same rules as :meth:`select` (device only, no host sync)."""
        return None

    def select(self, layer_id: int, q: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
               seq_lens: torch.Tensor) -> torch.Tensor:
        """Pages to read: ``[bs * Hkv, pages_per_row]`` int64, row ``i * Hkv + h``; each row ascending,
        ending with the request's last page (the one being written), unused entries last and at least
        the request's page count. ``q``: ``[bs, Hq, D]``; ``seq_lens``: ``[bs]``, this token included."""
        raise NotImplementedError(f"{type(self).__name__} attends itself (attend), it returns no pages")

    def attend(self, layer_id: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
               scale: float) -> torch.Tensor:
        """A selecting layer's decode attention (``attends`` selectors), this step's K/V written:
        ``q`` ``[bs, Hq, D]`` -> ``[bs, Hq, Dv]``; ``k_cache``/``v_cache`` the layer's whole pool. Same rules
        as :meth:`select` (device only, no host sync, fixed shapes)."""
        raise NotImplementedError(f"{type(self).__name__} returns pages (select), it does not attend")

    def after_step(self, step: SelectorStep) -> None:
        """After a forward step (``maintains`` selectors; batched over the step's rows, outside CUDA
        graphs, no host sync needed: the lengths are on the host)."""
        return None

    def bind(self, rids: list[str], req_pool_indices: torch.Tensor) -> None:
        """Before each forward step's attention metadata is built (eager only, never inside a graph replay):
        the step's request ids and their ``req_to_token`` rows, in batch order, for a selector whose
        per-request state its method sets by request id (``static`` selectors)."""
        return None


def pool_page_size(method: SparseMethod[Any]) -> int:
    """The KV pool page size ``method`` is served with: its selector's or its store's (page metadata and
    token groups need SGLang's paged allocator), else 1 (eviction frees single slots)."""
    if method.selector is not None:
        return method.selector.page_size
    return method.store.page_size if method.store is not None else 1


def served_hooks_problem(method: SparseMethod[Any]) -> str | None:
    """Why the server runtime cannot serve ``method`` (``None``: it can)."""
    if method.store is not None and method.selector is not None:
        return (f"{method.name} has a KV store beside selection: a quantized pool under a selection method is not "
                "served yet")
    if method.store is not None and method.evicts and (why := method.store.eviction_problem()) is not None:
        return f"{method.name} evicts over {type(method.store).__name__}'s layout, which cannot be served: {why}"
    if not method.evicts and method.observation_window() == 0:
        hooks = ("new_state", "restore_state", "on_prefill_chunk", "on_prune", "wants_observation",
                 "on_observation", "on_step_end", "on_finish")
        overridden = [h for h in hooks if getattr(type(method), h) is not getattr(SparseMethod, h)]
        if overridden:
            return (f"{method.name} overrides per-request hooks ({', '.join(overridden)}) but neither evicts nor "
                    "observes, and the server drives them only for methods that do (so they would never run)")
    return None


def check_keep_plan(method: SparseMethod[Any], plan: KeepPlan, kept: torch.Tensor) -> torch.Tensor:
    """The contract's rules for a :class:`KeepPlan`, enforced by both the server runtime and the
    reference driver (one function, so they cannot drift): only ``evicts`` methods return one; its
    positions are sorted, unique and currently retained. Returns the keep set as CPU int64."""
    if not method.evicts:
        raise RuntimeError(f"{method.name} returned a KeepPlan but does not declare evicts=True")
    keep = plan.keep.to(dtype=torch.int64, device="cpu")
    if keep.numel() > 1 and not bool((keep[1:] > keep[:-1]).all()):
        raise RuntimeError(f"{method.name}: KeepPlan positions must be sorted and unique")
    if keep.numel() and not bool(torch.isin(keep, kept).all()):
        raise RuntimeError(f"{method.name}: KeepPlan keeps positions that are not retained")
    return keep


def in_ranges(kept: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """Which of the retained positions ``kept`` lie in ``ranges`` (logical ``[l, r)``): what a request's own
    prune hands :meth:`SparseMethod.on_prune`, for the server runtime and the reference driver alike."""
    drop = torch.zeros(kept.numel(), dtype=torch.bool)
    for lo, hi in ranges:
        drop |= (kept >= lo) & (kept < hi)
    return drop


@dataclass
class TreePayload:
    """What a finished request leaves in the prefix tree beside its (possibly compacted) KV, e.g.
    accumulated scores aligned with ``RequestState.kept``, for the next turn's :meth:`restore_state`."""

    data: dict[str, torch.Tensor] = field(default_factory=dict)


READ_PIECE = 16_384  # slots a default KVStore.read_prefix reads at a time


class KVStore(ABC):
    """Method-owned K/V storage (the quantization and compression families): the layout of every
    layer's K/V in the pool, how the write path stores it, and how attention reads it back without
    materializing a dequantized layer.

    The server builds SGLang's KV pool around it (``integration/kv_pool.py``): SGLang's memory planner
    sizes the pool from :meth:`bytes_per_token` (fewer bytes, more tokens), :meth:`allocate` creates
    the buffers for that many slots, wherever SGLang stores a layer's post-RoPE K/V :meth:`write`
    encodes it, and attention reads only through :meth:`decode` (a decode step, inside CUDA graphs:
    device only, fixed shapes, no host sync) and :meth:`prefix` (an extend step: the new tokens'
    queries over their cached prefix; the new tokens attend to each other as the layout stores them,
    :meth:`round_trip`). Everything is indexed by physical slot and written once by the slot's
    owner, so a prefix shared through the radix tree is read back exactly as it was written.

    The defaults of :meth:`decode` and :meth:`prefix` are the plain-torch reference (dequantize the
    row through :meth:`read`, then attend): the CPU path, and what a store's kernels are tested
    against.

    Under an evicting method (a composition) the rows :meth:`decode` and :meth:`prefix` read are compacted:
    each holds only its request's live slots, in position order, packed to the front, and its row index is
    the request's place in the batch, not its ``req_pool_idx``. Evicted slots are freed one at a time and
    reused by other requests. So a layout can serve under eviction only if nothing it reads is tied to a
    logical position, a request row or a group of slots (:meth:`eviction_problem`).
    """

    page_size: int = 1  # pool page size the layout needs (a group of tokens never straddles two owners)
    # Whether an extend reads the cached prefix as :meth:`read`'s dequantized K/V through the base's own dense
    # prefill (FlashInfer's on the GPU) instead of :meth:`prefix`: a prefill is compute-bound, each prefix token
    # is read once per layer for thousands of queries, so materializing the batch's prefix for one layer costs
    # little beside it. :meth:`read_prefix` gives the K/V (by default through :meth:`read`); a layout whose scores add
    # a term the dequantized K/V lack (TurboQuant's QJL) must not set it. Set through :meth:`choose_prefix_attention`.
    dequantize_prefix: bool = False
    # The configured choice: "auto" (dequantize where that read is served, else the kernel), "dequantize" (refused
    # where it is not served) or "kernel"; and why an "auto" store reads through the kernel, if it does.
    prefix_attention: str = "kernel"
    prefix_attention_fallback: str | None = None
    # Whether decode and prefix run as device kernels (CUDA-graph safe): the torch defaults below loop over
    # requests with host reads, so a store without kernels serves on CPU only.
    gpu_kernels: ClassVar[bool] = False
    # Why a slot's data cannot be copied to another slot alone (None: :meth:`slot_tensors` is all of it). SGLang
    # moves slots only for speculative decoding, which the launcher refuses; the pool raises this if it ever does.
    slot_move_problem: ClassVar[str | None] = None

    @abstractmethod
    def bytes_per_token(self, geometry: KVGeometry) -> int:
        """Device bytes per KV token over all ``geometry.num_layers`` layers (K, V, their scales)."""

    def fixed_bytes(self, geometry: KVGeometry) -> int:
        """Device bytes that do not grow with tokens (e.g. a per-request residual for
        ``geometry.max_requests`` rows), taken from SGLang's KV budget before the pool is sized."""
        return 0

    @abstractmethod
    def allocate(self, geometry: KVGeometry) -> None:
        """Allocate the buffers for ``geometry.num_slots`` slots (once, as SGLang builds its pool)."""

    @abstractmethod
    def slot_tensors(self, layer_id: int) -> list[torch.Tensor]:
        """Every per-slot tensor of a layer (leading dim: slots), the K codes first and the V codes
        second: the pool lists the first two as its K/V buffers and all of them as what a slot move copies."""

    @abstractmethod
    def write(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
              decode: bool) -> None:
        """Encode ``k``/``v`` (``[n, Hkv, D]``, post-RoPE, model dtype) into slots ``loc`` (``[n]``); ``rows``
        (``[n]``) is each token's ``req_pool_idx``, for layouts that keep a request's unfinished group of
        tokens aside (KIVI's residual). ``decode``: one token per row, maybe inside a CUDA graph (device only,
        no host sync); else an extend step's tokens, each row's in position order."""

    @abstractmethod
    def read(self, layer_id: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K/V of ``slots`` (``[n]``): ``[n, Hkv, D]`` each, in the model dtype."""

    @abstractmethod
    def round_trip(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``k``/``v`` ``[n, Hkv, D]`` (model dtype) as the layout's attention reads them once stored: as :meth:`read`
        gives them back, bit for bit (a layout whose scores add a term linear in the query, TurboQuant's QJL, adds it
        to the keys); each
        token alone for a per-token layout; for a grouped one (``page_size`` G > 1) ``n`` is a multiple of G and
        each run of G tokens is one whole group. An extend's new tokens read each other through it
        (``integration/store_attention.py``): a query reads every key as the layout serves it, whichever prefill
        chunk holds the key, so where other traffic cuts a prompt into chunks cannot change its answer. Per-token
        layouts: every key as stored, the query's own included (as a decode step, which writes first, reads it);
        grouped ones: the whole groups before the query's own as stored, its own group at full precision (the
        open group a grouped layout keeps aside, :meth:`read_open`), or as stored when the query is the group's last
        token: in each case what a decode step at the query's position reads."""

    def read_open(self, layer_id: int, rows: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A grouped layout's open group, at full precision: the tokens at ``offsets`` (``[n]``, within the group) of
        the open groups of request rows ``rows`` (``[n]``) -> K, V ``[n, Hkv, D]`` in the model dtype. An extend
        whose cached prefix ends inside a group reads the group's earlier tokens here."""
        raise NotImplementedError(f"{type(self).__name__} keeps no open group (page size {self.page_size})")

    def read_prefix(self, layer_id: int, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                    prefix_lens: torch.Tensor, lens: list[int],
                    slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An extend step's cached prefixes dequantized, flat (:attr:`dequantize_prefix`): the first ``lens[i]``
        positions (also on the device: ``prefix_lens``) of row ``req_to_token[req_pool_indices[i]]``, request after
        request -> K, V ``[sum(lens), Hkv, D]`` in the model dtype. ``slots``: those positions' slots, flat. The
        default reads ``slots`` through :meth:`read`, :data:`READ_PIECE` at a time (a read's fp32 temporaries must not
        scale with a 100K-token prefix); a layout with per-request state (KIVI's residual) reads its own way."""
        n = slots.numel()
        if n <= READ_PIECE:
            return self.read(layer_id, slots)
        k0, v0 = self.read(layer_id, slots[:READ_PIECE])
        k, v = k0.new_empty((n, *k0.shape[1:])), v0.new_empty((n, *v0.shape[1:]))
        k[:READ_PIECE], v[:READ_PIECE] = k0, v0
        for at in range(READ_PIECE, n, READ_PIECE):
            k[at:at + READ_PIECE], v[at:at + READ_PIECE] = self.read(layer_id, slots[at:at + READ_PIECE])
        return k, v

    def describe(self) -> dict[str, Any]:
        """What ``/server_info`` reports of the layout (e.g. bits); JSON values."""
        return {}

    def choose_prefix_attention(self, mode: str) -> None:
        """Set the configured prefix read (``"auto"``, ``"dequantize"`` or ``"kernel"``)."""
        self.prefix_attention = mode
        self.dequantize_prefix = mode != "kernel"
        self.prefix_attention_fallback = None

    def decline_dequantized_prefix(self, why: str) -> None:
        """Where the dequantized prefix read is not served (``why``): an ``"auto"`` store reads through
        :meth:`prefix` instead and says so in :meth:`describe_prefix_attention`; an explicit ``"dequantize"``
        raises :class:`SparseConfigError` with ``why``."""
        if not self.dequantize_prefix:
            return
        if self.prefix_attention == "dequantize":
            raise SparseConfigError(f"prefix_attention 'dequantize': {why}: use 'kernel' or 'auto'")
        self.dequantize_prefix = False
        self.prefix_attention_fallback = why

    def describe_prefix_attention(self) -> dict[str, Any]:
        """The prefix read as served, for :meth:`describe`: ``prefix_attention`` (``dequantize`` or ``kernel``), the
        configured mode and, when ``auto`` fell back to the kernel, why."""
        out: dict[str, Any] = {"prefix_attention": "dequantize" if self.dequantize_prefix else "kernel",
                               "prefix_attention_config": self.prefix_attention}
        if self.prefix_attention_fallback is not None:
            out["prefix_attention_fallback"] = self.prefix_attention_fallback
        return out

    def read_keys(self, layer_id: int, slots: torch.Tensor) -> torch.Tensor:
        """Dequantized K of ``slots``, ``[n, Hkv, D]``: what an evicting method's scores read (SnapKV's window)."""
        return self.read(layer_id, slots)[0]

    def eviction_problem(self) -> str | None:
        """Why an evicting method cannot run over this layout (``None``: it can). Eviction frees single slots
        and leaves each request's kept slots wherever they were written, read through compacted rows (class
        docstring). The default accepts a per-token layout (page size 1, no per-request buffers)."""
        if self.page_size != 1:
            return (f"its layout groups {self.page_size} tokens per page (--page-size {self.page_size}), and "
                    "eviction frees single tokens")
        if type(self).fixed_bytes is not KVStore.fixed_bytes:
            return "it keeps per-request buffers beside the pool, indexed by request row and logical position"
        return None

    def row_attention(self, layer_id: int, q: torch.Tensor, req_to_token: torch.Tensor, row: int, n: int,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch reference both defaults below are made of: ``q`` ``[m, Hq, D]`` over the first ``n``
        positions of row ``row`` (``n > 0``), no mask -> (output, natural log-sum-exp ``[m, Hq]``). Override it
        for layouts that read a row otherwise (a residual) or score otherwise (QJL)."""
        k, v = self.read(layer_id, req_to_token[row, :n].long())
        return attend(q, k, v, scale)

    def decode(self, layer_id: int, q: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
               seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
        """Decode attention, this step's K/V written: ``q`` ``[bs, Hq, D]`` over the first ``seq_lens[i]``
        slots of each row ``req_to_token[req_pool_indices[i]]`` -> ``[bs, Hq, D]`` (an empty row gives 0)."""
        out = torch.zeros_like(q)
        for i, (r, n) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist(), strict=True)):
            if n > 0:
                out[i] = self.row_attention(layer_id, q[i:i + 1], req_to_token, r, n, scale)[0][0]
        return out

    def prefix(self, layer_id: int, q: torch.Tensor, qo_indptr: torch.Tensor, req_to_token: torch.Tensor,
               req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: list[int],
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """An extend step's queries over their cached prefix: request ``i``'s new tokens
        (``q[qo_indptr[i]:qo_indptr[i + 1]]``, ``[n, Hq, D]``; their counts ``extend_lens`` also on the host, as
        an extend step knows them without a sync) over the first ``prefix_lens[i]`` slots of its row
        ``req_to_token[req_pool_indices[i]]``, no mask (every prefix token precedes every new one) ->
        (output ``[n, Hq, D]``, fp32 natural log-sum-exp of the logits ``[n, Hq]``, ``-inf`` for an empty
        prefix), to be merged with the new tokens' own attention."""
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        at = 0
        for r, n, m in zip(req_pool_indices.tolist(), prefix_lens.tolist(), extend_lens, strict=True):
            if n > 0 and m > 0:
                out[at:at + m], lse[at:at + m] = self.row_attention(layer_id, q[at:at + m], req_to_token, r, n, scale)
            at += m
        return out, lse


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` ``[n, Hq, D]`` over every row of ``k``/``v`` ``[m, Hkv, D]`` (grouped heads, no mask), in fp32:
    (output in ``q``'s dtype, log-sum-exp ``[n, Hq]``)."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)  # [m, Hq, D]
    vf = v.float().repeat_interleave(group, dim=1)
    logits = torch.einsum("nhd,mhd->hnm", q.float(), kf) * scale
    lse = torch.logsumexp(logits, dim=-1)  # [Hq, n]
    out = torch.einsum("hnm,mhd->nhd", torch.softmax(logits, dim=-1), vf)
    return out.to(q.dtype), lse.transpose(0, 1)


C = TypeVar("C", bound=MethodConfig)


class SparseMethod(ABC, Generic[C]):
    """A sparse-KV method: a config plus the hooks it needs. Subclass, set the class attributes,
    override only the hooks the method uses (every default is the dense behaviour).

    Class attributes tell the runtime what to wire: ``evicts`` (may return a :class:`KeepPlan`),
    ``prefix_reuse``; properties ``selector`` and ``store``.
    """

    name: ClassVar[str]
    family: ClassVar[Family]
    config_cls: ClassVar[type[MethodConfig]]
    evicts: ClassVar[bool] = False
    prefix_reuse: ClassVar[PrefixReuse] = PrefixReuse.RADIX

    def __init__(self, config: C) -> None:
        if not isinstance(config, self.config_cls):
            raise TypeError(f"{self.name} expects {self.config_cls.__name__}, got {type(config).__name__}")
        self.config: C = config

    @property
    def store(self) -> KVStore | None:
        """The K/V storage of compression/quantization methods; ``None``: SGLang's pool in the model dtype."""
        return None

    @property
    def selector(self) -> PageSelector | None:
        """The batched decode-time selection of dynamic-selection methods (``None``: attend to all)."""
        return None

    # -- admission ---------------------------------------------------------------------------------
    def new_state(self, rid: str) -> RequestState:
        """A request starts with no matched prefix. Runs once, on the scheduler, before any forward."""
        return RequestState(rid=rid)

    def restore_state(self, state: RequestState, payload: TreePayload | None) -> None:
        """The request matched a prefix in the tree (``state.logical_len`` tokens, ``state.num_kept``
        of them retained: a Chain Cache hit when fewer). ``payload`` is what :meth:`on_finish` of
        the turn that stored it returned. Default: nothing to restore (the retained set itself
        comes from the tree)."""

    # -- prefill -----------------------------------------------------------------------------------
    def on_prefill_chunk(self, state: RequestState, chunk: PrefillChunk) -> None:
        """Before the forward of a prefill chunk. May set up per-chunk workspaces in ``state.extra``.
        Must not change ``state.kept``."""

    def observation_window(self) -> int:
        """How many trailing queries per layer :meth:`on_observation` needs (0: never called).
        The runtime keeps the last ``w`` queries of each request (prompt, and decode if
        :meth:`wants_observation` can be true in decode)."""
        return 0

    def observes_decode(self) -> bool:
        """Whether :meth:`wants_observation` can be true in decode, i.e. the runtime must also keep
        decode queries (per decode step, outside CUDA graphs)."""
        return False

    def needs_token_ids(self) -> bool:
        """Whether every :class:`StepInfo` this method gets carries ``token_ids`` (the server reads them
        from the request's input and output ids, on the host)."""
        return False

    def wants_observation(self, state: RequestState, step: StepInfo) -> bool:
        """Whether :meth:`on_observation` runs at the end of this step. Default: final prefill chunk."""
        return step.final_prefill

    def on_observation(self, state: RequestState, window: ObservationWindow) -> None:
        """At the end of a step (all layers done), before :meth:`on_step_end`, when
        :meth:`wants_observation` said so. Score the retained K/V here (into ``state.extra``)."""

    # -- the request's own prune --------------------------------------------------------------------
    def on_prune(self, state: RequestState, pruned: torch.Tensor) -> None:
        """Positions ``pruned`` (sorted CPU int64, at least one, all in ``state.kept``) leave the request's
        retained set outside any :class:`KeepPlan` of the method: the request prunes them from its own prompt
        (``custom_params['sgl_sparse_prune']``). Called once, in the step that completes the prompt, after its
        forward and before :meth:`replays`, :meth:`on_observation` and :meth:`on_step_end` of that step (hook
        order above). ``state.kept`` still holds them; right after the hook the runtime frees their slots and
        sets ``state.kept`` to the rest.

        A method whose per-request state is indexed by the retained set and outlives a step (a score per
        retained token in retained order, a per-layer mask over it, typically restored from a
        :class:`TreePayload`) must drop their entries here, else that state silently misaligns. Default:
        nothing, right for a method whose state is logical positions (StreamingLLM, SkipKV's sentences), or
        is built by an observation or replay of the step itself (SnapKV, R-KV, KVzip), which then sees only
        the rest."""

    # -- replays (KVzip) ---------------------------------------------------------------------------
    @property
    def runs_replays(self) -> bool:
        """Whether the method overrides :meth:`replays` (KVzip): what the launcher, admission, the step and a
        composition check before replay forwards may run."""
        return type(self).replays is not SparseMethod.replays

    def replays(self, state: RequestState, step: StepInfo, max_tokens: int) -> list[Replay]:
        """After the forward of a prompt's final chunk (``step.final_prefill``), before :meth:`on_step_end`:
        extra forwards to run now, in order, each at most ``max_tokens`` tokens long (a replay starts at
        ``state.logical_len``; the model's context length bounds it). Each one's layers are handed to
        :meth:`on_replay_layer` as they run. Default: none. Needs ``needs_token_ids()`` to read the prompt.
        Where the plan's longest replay would not fit the KV memory left (free and tree-evictable slots), the
        runtime calls this again in the same step with that smaller ``max_tokens`` and runs the last plan: keep
        what it records idempotent (count in :meth:`on_step_end`)."""
        return []

    def on_replay_layer(self, state: RequestState, replay: Replay, layer: ReplayLayer) -> None:
        """One layer of a :class:`Replay`'s forward (layer order): score the retained keys here (into
        ``state.extra``), one layer at a time, so nothing of the replay outlives its layer."""

    # -- end of forward step ---------------------------------------------------------------------
    def on_step_end(self, state: RequestState, step: StepInfo) -> KeepPlan | None:
        """After the whole forward step (all layers), on the scheduler side. ``state.logical_len``
        already includes this step's tokens. Return a :class:`KeepPlan` to evict physically
        (``evicts`` methods only), else ``None``. The runtime applies the plan and updates
        ``state.kept``; the method must not assign ``state.kept`` itself."""
        return None

    # -- finish ------------------------------------------------------------------------------------
    def on_finish(self, state: RequestState) -> TreePayload | None:
        """The request finished (or was aborted). Return what the prefix tree stores beside the
        retained KV for :meth:`restore_state` of a later turn; ``None`` stores nothing extra."""
        return None

    # -- reporting ---------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Method-specific counters for ``/server_info`` (``method_stats``; JSON values). Default: none."""
        return {}
