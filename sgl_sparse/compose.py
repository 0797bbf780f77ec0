"""Composition: one eviction method over the KV pool of one method that owns the layout, quantization or
compression (``--sparse-method snapkv+fp8_kv``, ``snapkv+palu``).

The eviction member decides which tokens stay (its hooks run unchanged: SnapKV's scoring, StreamingLLM's
window); the other member (quantization or compression) owns the pool they stay in (its
:class:`~sgl_sparse.contract.KVStore`).
The composition holds both (a wrapper, not a subclass), so any eviction method composes with any store
whose layout can lose single tokens (:meth:`~sgl_sparse.contract.KVStore.eviction_problem`: per-token
layouts such as ``fp8_kv`` and ``turboquant`` can; ``kivi``'s per-page key groups cannot, a launch error).

Config syntax: the name joins the two members with ``+`` (either order; the composition is named eviction
first), and ``--sparse-config`` is keyed by member name, each value that member's own fields; a member left
out keeps its defaults::

    --sparse-method snapkv+kivi --sparse-config '{"snapkv": {"budget": 1024}, "kivi": {"bits": 4}}'

A single method's config stays flat, as it always was. The fingerprint (prefix-tree namespace) covers both
members' names and fields.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from sgl_sparse.config import MethodConfig, build_config
from sgl_sparse.contract import (
    Family,
    KeepPlan,
    KVStore,
    ObservationWindow,
    PrefillChunk,
    RequestState,
    SparseMethod,
    StepInfo,
    TreePayload,
)
from sgl_sparse.errors import SparseConfigError

SEPARATOR = "+"


def is_composed(name: str) -> bool:
    return SEPARATOR in name


@dataclass(frozen=True)
class ComposedConfig(MethodConfig):
    """The members' configs. ``to_dict`` is keyed by member name, the form ``--sparse-config`` takes (and the
    launcher hands to the scheduler), and the fingerprint covers both members."""

    eviction: MethodConfig
    quantization: MethodConfig

    @property
    def method_name(self) -> str:  # type: ignore[override]
        return f"{self.eviction.method_name}{SEPARATOR}{self.quantization.method_name}"

    def to_dict(self) -> dict[str, Any]:
        return {m.method_name: m.to_dict() for m in (self.eviction, self.quantization)}

    def fingerprint(self) -> str:
        payload = json.dumps({"method": self.method_name, **self.to_dict()}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


class Composed(SparseMethod[ComposedConfig]):
    """An eviction method's hooks over a quantization method's store. Every per-request hook is the eviction
    member's; ``store`` is the quantization member's."""

    family = Family.EVICTION
    config_cls = ComposedConfig
    evicts = True

    def __init__(self, eviction: SparseMethod[Any], quantization: SparseMethod[Any]) -> None:
        super().__init__(ComposedConfig(eviction.config, quantization.config))
        self.name = self.config.method_name  # type: ignore[misc]
        self.eviction = eviction
        self.quantization = quantization
        self.members: tuple[SparseMethod[Any], ...] = (eviction, quantization)

    @property
    def store(self) -> KVStore | None:
        return self.quantization.store

    def new_state(self, rid: str) -> RequestState:
        return self.eviction.new_state(rid)

    def restore_state(self, state: RequestState, payload: TreePayload | None) -> None:
        self.eviction.restore_state(state, payload)

    def on_prefill_chunk(self, state: RequestState, chunk: PrefillChunk) -> None:
        self.eviction.on_prefill_chunk(state, chunk)

    def on_prune(self, state: RequestState, pruned: torch.Tensor) -> None:
        self.eviction.on_prune(state, pruned)

    def observation_window(self) -> int:
        return self.eviction.observation_window()

    def observes_decode(self) -> bool:
        return self.eviction.observes_decode()

    def needs_token_ids(self) -> bool:
        return self.eviction.needs_token_ids()

    def wants_observation(self, state: RequestState, step: StepInfo) -> bool:
        return self.eviction.wants_observation(state, step)

    def on_observation(self, state: RequestState, window: ObservationWindow) -> None:
        self.eviction.on_observation(state, window)

    def on_step_end(self, state: RequestState, step: StepInfo) -> KeepPlan | None:
        return self.eviction.on_step_end(state, step)

    def on_finish(self, state: RequestState) -> TreePayload | None:
        return self.eviction.on_finish(state)


def family_label(method: SparseMethod[Any]) -> str:
    """``eviction``, ``quantization``, ...; a composition's members' families joined (``eviction+quantization``)."""
    members = getattr(method, "members", None)
    if members is None:
        return method.family.value
    return SEPARATOR.join(m.family.value for m in members)


def create_composed(name: str, fields: dict[str, Any],
                    method_class: Callable[[str], type[SparseMethod[Any]]]) -> Composed:
    """Build ``EVICTION+QUANTIZATION`` (either order) from a config keyed by member name, each member's class
    found by ``method_class`` (the registry's lookup, which raises for an unknown name). Raises
    :class:`SparseConfigError` naming the problem: not two members, an unknown member, a config key that is
    no member (or a member's fields that are not an object), or members of the wrong families."""
    where = f"--sparse-method {name}"
    names = name.split(SEPARATOR)
    if len(names) != 2 or not all(names):
        raise SparseConfigError(f"{where}: a composition is two methods joined by '{SEPARATOR}', one eviction "
                                f"method and one method that owns the KV layout (e.g. snapkv{SEPARATOR}fp8_kv)")
    if names[0] == names[1]:
        raise SparseConfigError(f"{where}: names {names[0]} twice")
    for member in names:
        try:
            method_class(member)
        except SparseConfigError as e:
            raise SparseConfigError(f"{where}: {e}") from None
    extra = sorted(set(fields) - set(names))
    if extra:
        raise SparseConfigError(f"{where}: --sparse-config key(s) {extra} are not members of the composition: its "
                                f"config is keyed by member name, each value that member's fields, e.g. "
                                f"{{\"{names[0]}\": {{...}}, \"{names[1]}\": {{...}}}}")
    for member in names:
        if not isinstance(fields.get(member, {}), dict):
            raise SparseConfigError(f"{where}: --sparse-config[{member!r}] must be a JSON object of {member}'s "
                                    f"fields, got {type(fields[member]).__name__}")
    methods = []
    for member in names:
        cls = method_class(member)
        methods.append(cls(build_config(cls.config_cls, fields.get(member, {}))))
    for m in methods:
        if m.selector is not None and m.evicts:
            raise SparseConfigError(f"{where}: {m.name} reads each layer's own kept set through a page selector, "
                                    "which a quantized pool does not serve yet")
        if m.selector is not None:
            raise SparseConfigError(f"{where}: {m.name} is a dynamic selection method; a composition is one "
                                    "eviction method over one method that owns the KV layout (selection over a "
                                    "quantized pool is not served yet)")
        if m.runs_replays:
            raise SparseConfigError(f"{where}: {m.name} runs replay forwards (its context reconstruction), which a "
                                    "quantized pool does not serve yet")
        if m.store is not None and m.evicts:
            raise SparseConfigError(f"{where}: {m.name} both evicts and owns the KV layout; compose it with nothing")
        if m.store is None and not m.evicts:
            raise SparseConfigError(f"{where}: {m.name} neither evicts nor owns the KV layout, so it adds nothing to "
                                    "a composition; a composition is one eviction method over one method that "
                                    "owns the KV layout")
    evicting = [m for m in methods if m.evicts]
    if len(evicting) != 1:
        both = " and ".join(m.name for m in methods)
        why = "both evict (one keep-set per request)" if evicting else "both own the KV layout (one pool)"
        raise SparseConfigError(f"{where}: {both} {why}; a composition is one eviction method over one "
                                "method that owns the KV layout")
    quantization = next(m for m in methods if not m.evicts)
    return Composed(evicting[0], quantization)
