"""A sparse-KV method: a config plus the hooks the server drives. Read this first.

Subclass :class:`SparseMethod`, set its class attributes, override only the hooks you need (every default is the
dense behaviour). Hooks get plain torch tensors and import nothing from SGLang, so a method is tested with
:mod:`sgl_sparse.reference` alone. Positions are logical (a token's index in its request). A whole method::

    @dataclass(frozen=True)
    class RecentConfig(MethodConfig):
        method_name = "recent"
        keep: int = 512  # retained tokens

    @register_method
    class Recent(SparseMethod[RecentConfig]):
        name = "recent"
        family = Family.EVICTION
        config_cls = RecentConfig
        evicts = True

        def on_step_end(self, state: RequestState, step: StepInfo) -> KeepPlan | None:
            if state.num_kept <= self.config.keep:
                return None
            return KeepPlan(state.kept[-self.config.keep:])  # the runtime frees the rest

A method that scores the prompt and keeps the best derives from
:class:`~sgl_sparse.methods.eviction.base.ScoredEviction` and writes one ``score``. Selection methods return a
:class:`~sgl_sparse.contract.PageSelector` (``selector``), compression methods a
:class:`~sgl_sparse.contract.KVStore` (``store``).

Hook order, per request (the server and the reference driver both follow it; ``tests/test_contract.py`` and
``tests/test_hook_order_e2e.py`` check it). The server drives them for methods that evict or observe
(``evicts``, ``observation_window() > 0``), and ``on_prune`` for any request that prunes its own prompt; a method
with neither keeps the no-op defaults (the launcher refuses one that overrides them)::

    new_state (+ restore_state on a prefix hit) once, at admission (before its first forward)
    for each prefill chunk:
        on_prefill_chunk                       before the chunk's forward
        (the forward: selector hooks, contract/selector.py)
        on_prune                               final chunk of a request that prunes its own prompt
        replays                                final chunk only: extra forwards (KVzip), each one's
            on_replay_layer                    layers in order, as they run
        on_observation                         if wants_observation (default: final chunk)
        on_step_end                            after the forward step (may shrink the keep-set)
    for each decode step:
        (the forward)
        on_observation                         if wants_observation
        on_step_end
    on_finish                                  once: what the prefix tree stores for later turns

A request's own prune (docs/prefix-cache-pruning.md) is, to its method, an eviction just before its end-of-prompt
planning: every hook after ``on_prune`` sees only the positions left (a plan that re-selects a pruned position is
an error), and a budget counts only them. Positions an earlier plan or turn evicted are not handed over again.
"""

from __future__ import annotations

from abc import ABC
from typing import Any, ClassVar, Generic, TypeVar

import torch

from sgl_sparse.config import MethodConfig
from sgl_sparse.contract.replay import Replay, ReplayLayer
from sgl_sparse.contract.selector import PageSelector
from sgl_sparse.contract.state import (
    Family,
    KeepPlan,
    ObservationWindow,
    PrefillChunk,
    RequestState,
    StepInfo,
    TreePayload,
)
from sgl_sparse.contract.store import KVStore

C = TypeVar("C", bound=MethodConfig)


class SparseMethod(ABC, Generic[C]):
    """A config plus the hooks it needs. ``evicts``: may return a :class:`KeepPlan`; ``selector`` and ``store``:
    what the runtime wires into attention and the pool."""

    name: ClassVar[str]
    family: ClassVar[Family]
    config_cls: ClassVar[type[MethodConfig]]
    evicts: ClassVar[bool] = False

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

    # -- what the method declares (asked at launch and admission) ----------------------------------
    def for_model(self, model_path: str) -> dict[str, Any]:
        """Config fields resolved from the model folder at launch (e.g. where DeltaKV's compressor lives); the
        launcher re-creates the method with them, so the scheduler gets the resolved config. Raise
        ``SparseConfigError`` naming the field for a folder the method cannot serve. Default: nothing."""
        return {}

    def observation_window(self) -> int:
        """How many trailing queries per layer :meth:`on_observation` needs (0: never called). The runtime keeps
        the last ``w`` queries of each request (prompt, and decode if :meth:`observes_decode`)."""
        return 0

    def observes_decode(self) -> bool:
        """Whether :meth:`wants_observation` can be true in decode, i.e. the runtime must also keep decode
        queries (per decode step, outside CUDA graphs)."""
        return False

    def needs_token_ids(self) -> bool:
        """Whether every :class:`StepInfo` carries ``token_ids`` (read from the request's ids, on the host)."""
        return False

    # -- admission --------------------------------------------------------------------------------
    def new_state(self, rid: str) -> RequestState:
        """A request starts with no matched prefix. Runs once, on the scheduler, before any forward."""
        return RequestState(rid=rid)

    def restore_state(self, state: RequestState, payload: TreePayload | None) -> None:
        """The request matched a prefix in the tree (``state.logical_len`` tokens, ``state.num_kept`` of them
        retained: a Chain Cache hit when fewer). ``payload``: what :meth:`on_finish` of the turn that stored it
        returned. Default: nothing (the retained set itself comes from the tree)."""

    # -- prefill ----------------------------------------------------------------------------------
    def on_prefill_chunk(self, state: RequestState, chunk: PrefillChunk) -> None:
        """Before the forward of a prefill chunk. Must not change ``state.kept``."""

    def on_prune(self, state: RequestState, pruned: torch.Tensor) -> None:
        """Positions ``pruned`` (sorted CPU int64, all in ``state.kept``) leave the retained set outside any plan
        of the method: the request prunes them from its own prompt (``custom_params['sgl_sparse_prune']``). Once,
        in the step that completes the prompt, before :meth:`replays`, :meth:`on_observation` and
        :meth:`on_step_end`; ``state.kept`` still holds them, and right after the hook the runtime frees them and
        sets ``state.kept`` to the rest.

        State indexed by the retained set that outlives a step (a score per retained token, a per-layer mask,
        typically restored from a :class:`TreePayload`) must drop their entries here. Default: nothing, right for
        state kept by logical position or built by this step's own observation."""

    @property
    def runs_replays(self) -> bool:
        """Whether the method overrides :meth:`replays` (checked before replay forwards may run)."""
        return type(self).replays is not SparseMethod.replays

    def replays(self, state: RequestState, step: StepInfo, max_tokens: int) -> list[Replay]:
        """After the forward of a prompt's final chunk, before :meth:`on_step_end`: extra forwards to run now, in
        order, each at most ``max_tokens`` tokens, starting at ``state.logical_len``; each one's layers go to
        :meth:`on_replay_layer`. Needs ``needs_token_ids()`` to read the prompt. Where the longest would not fit
        the KV memory left, the runtime calls this again in the same step with a smaller ``max_tokens`` and runs
        the last plan: keep it idempotent (count in :meth:`on_step_end`)."""
        return []

    def on_replay_layer(self, state: RequestState, replay: Replay, layer: ReplayLayer) -> None:
        """One layer of a :class:`Replay`'s forward (layer order): score the retained keys here (into
        ``state.extra``), so nothing of the replay outlives its layer."""

    # -- end of every forward step ----------------------------------------------------------------
    def wants_observation(self, state: RequestState, step: StepInfo) -> bool:
        """Whether :meth:`on_observation` runs at the end of this step. Default: final prefill chunk. Decide from
        replicated data only (lengths, step counts, earlier keep sets): under TP every rank must agree."""
        return step.final_prefill

    def on_observation(self, state: RequestState, window: ObservationWindow) -> None:
        """All layers done, before :meth:`on_step_end`, when :meth:`wants_observation` said so: score the retained
        K/V here (into ``state.extra``). ``window`` is valid until this step's :meth:`on_step_end` returns."""

    def on_step_end(self, state: RequestState, step: StepInfo) -> KeepPlan | None:
        """After the whole forward step, on the scheduler. ``state.logical_len`` includes this step's tokens.
        Return a :class:`KeepPlan` to evict (``evicts`` methods only), else ``None``; the runtime applies it and
        updates ``state.kept`` (never assign it yourself)."""
        return None

    # -- finish -----------------------------------------------------------------------------------
    def on_finish(self, state: RequestState) -> TreePayload | None:
        """The request finished (or was aborted): what the prefix tree stores beside the retained KV for a later
        turn's :meth:`restore_state` (``None``: nothing extra)."""
        return None

    def stats(self) -> dict[str, Any]:
        """Method-specific counters for ``/server_info`` (``method_stats``; JSON values). Default: none."""
        return {}
