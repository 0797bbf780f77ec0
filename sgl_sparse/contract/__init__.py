"""The contract between the serving runtime and a sparse-KV method, by audience.

* :mod:`.method`: what every method author reads first: :class:`SparseMethod`, the hooks the server drives, in
  the order it drives them, with a worked example.
* :mod:`.state`: what those hooks are handed and return (:class:`RequestState`, :class:`StepInfo`,
  :class:`ObservationWindow`, :class:`KeepPlan`, :class:`TreePayload`).
* :mod:`.selector`: dynamic selection (Quest, OmniKV, RetroInfer): a :class:`PageSelector` picks, per decode
  step, layer and KV head, the pages attention reads, batched on the device.
* :mod:`.store`: compression and quantization (KIVI, FP8, Palu, ...): a :class:`KVStore` owns the pool's layout
  (:mod:`.model`: what a layout derived from the model's weights is handed).
* :mod:`.replay`: extra forwards after a prompt (KVzip's context reconstruction).

An eviction method scores the prompt and returns a smaller keep-set (the runtime frees the dropped slots); a
dense method overrides nothing, and the runtime then behaves exactly like vanilla SGLang. What the runtime checks
of a method (:mod:`sgl_sparse.rules`) and how it reads a store's prefix (:mod:`sgl_sparse.store_reads`) are the
runtime's, not the contract's. Nothing here imports SGLang.
"""

from sgl_sparse.contract.geometry import KVGeometry
from sgl_sparse.contract.method import SparseMethod
from sgl_sparse.contract.model import AttentionProjections, KVMoments, ModelKV, RotaryTable
from sgl_sparse.contract.replay import Replay, ReplayLayer
from sgl_sparse.contract.selector import PageSelector, SelectorStep
from sgl_sparse.contract.state import (
    AllReduce,
    Family,
    KeepPlan,
    MaxOverRanks,
    ObservationWindow,
    PrefillChunk,
    RequestState,
    StepInfo,
    TreePayload,
)
from sgl_sparse.contract.store import KVStore

__all__ = [
    "AllReduce",
    "AttentionProjections",
    "Family",
    "KVGeometry",
    "KVMoments",
    "KVStore",
    "KeepPlan",
    "MaxOverRanks",
    "ModelKV",
    "ObservationWindow",
    "PageSelector",
    "PrefillChunk",
    "Replay",
    "ReplayLayer",
    "RequestState",
    "RotaryTable",
    "SelectorStep",
    "SparseMethod",
    "StepInfo",
    "TreePayload",
]
