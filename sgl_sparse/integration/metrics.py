"""Prometheus metrics of sgl_sparse (with ``--enable-metrics``), exported on SGLang's ``/metrics``.

SGLang runs prometheus_client in multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set before its
processes import it), so gauges and counters created in the scheduler process appear on the HTTP
server's ``/metrics``. Names mirror the ``sgl_sparse`` block of ``/server_info``, which reports every
:class:`Counters` field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Counters:
    """The scheduler's cumulative counts (``/server_info``; two of them on ``/metrics``)."""

    evicted_tokens_total: int = 0
    chain_hits_total: int = 0
    chain_hit_tokens_total: int = 0  # logical tokens of the matched prefixes (what cached_tokens counts)
    chain_hit_kept_tokens_total: int = 0  # of them, with resident KV (physical)
    eviction_steps_total: int = 0
    unscored_prunes_total: int = 0  # requests' own scored prunes not applied (kvzip_global with no replay room)
    # Extend steps with a cached prefix under a store that reads it dequantized (prefix_attention "dequantize"):
    # read so, or through the store's kernel (past the token cap).
    prefix_dequantized_steps_total: int = 0
    prefix_kernel_steps_total: int = 0
    # Replay plans (KVzip's, a kvzip_global prune's) whose room was bound by KV memory (free slots plus what the
    # tree could evict) rather than by the context: their chunks may be shorter than on an idle server.
    replay_room_memory_bound_total: int = 0
    # Times SGLang's idle checks (pool leak, request pool, tree) ran and passed: a client that saw the server idle
    # waits for this to move to know a check ran after its requests, instead of sleeping.
    idle_checks_passed_total: int = 0


class SparseMetrics:
    def __init__(self, method: str) -> None:
        from prometheus_client import Counter, Gauge

        labels = ["method"]

        def gauge(name: str, doc: str) -> Any:
            return Gauge(f"sgl_sparse:{name}", doc, labelnames=labels, multiprocess_mode="mostrecent").labels(method)

        def counter(name: str, doc: str) -> Any:
            return Counter(f"sgl_sparse:{name}", doc, labelnames=labels).labels(method)

        self.kv_slots_used = gauge("kv_slots_used", "Physical KV slots in use (requests + prefix tree).")
        self.logical_tokens_running = gauge("logical_tokens_running", "Logical tokens of running requests.")
        self.kept_tokens_running = gauge("kept_tokens_running", "Retained (physical) tokens of running requests.")
        self.evicted_tokens = counter("evicted_tokens", "Logical positions evicted (freed or hidden).")
        self.chain_hits = counter("chain_hits", "Requests that resumed from a compacted prefix (Chain Cache).")
        self._last: dict[str, int] = {}

    def update(self, runtime: Any, allocator: Any) -> None:
        self.kv_slots_used.set(runtime.kv_slots_used(allocator))
        self.logical_tokens_running.set(runtime.logical_tokens_running())
        self.kept_tokens_running.set(runtime.kept_tokens_running())
        for name, metric in (("evicted_tokens_total", self.evicted_tokens), ("chain_hits_total", self.chain_hits)):
            value = getattr(runtime.counters, name)
            delta = value - self._last.get(name, 0)
            if delta > 0:
                metric.inc(delta)
            self._last[name] = value
