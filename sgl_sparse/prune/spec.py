"""What a prune asks for, parsed and checked (docs/prefix-cache-pruning.md): its ranges, the scored keep
(``keep_tokens`` / ``keep_ratio``, ``policy``) and ``evict_branches``, as the route and a request's own prune
(``custom_params['sgl_sparse_prune']``) take them, and :class:`PruneSpec`, a request's own prune. Pure Python.

The policies (scored in :mod:`sgl_sparse.prune.keep`): ``drop`` keeps nothing of the ranges; ``knorm`` scores the
pool's keys, so it runs between batches; ``snapkv_global`` needs the prompt's last queries and ``kvzip_global``
replay forwards, so they run in a request's final prefill (the route sends such a prune as an internal request).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DROP, KNORM, SNAPKV_GLOBAL, KVZIP_GLOBAL = "drop", "knorm", "snapkv_global", "kvzip_global"
POLICIES = (DROP, KNORM)  # POST /v1/prefix_cache/prune: between batches, no queries
SCORED = (KNORM,)
# A request's own prune: its prompt's last queries exist, and replays can run in its step.
REQUEST_POLICIES = (DROP, KNORM, SNAPKV_GLOBAL, KVZIP_GLOBAL)
REQUEST_SCORED = (SNAPKV_GLOBAL, KNORM, KVZIP_GLOBAL)  # the first: the default when something is kept
# snapkv_global's window and pooling: SnapKV's defaults (its method's config, Li et al. 2024).
SNAPKV_WINDOW, SNAPKV_KERNEL, SNAPKV_POOLING = 32, 5, "avgpool"


# The route's policies: a prune between batches (drop, knorm), and snapkv_global / kvzip_global through an internal
# request that prunes its own prompt (integration/prune_route.py): snapkv_global's re-forwards the sequence's last
# SNAPKV_WINDOW tokens (their queries score), kvzip_global's runs replay forwards in its final step.
BY_REQUEST = (SNAPKV_GLOBAL, KVZIP_GLOBAL)
ROUTE_POLICIES = (*POLICIES, *BY_REQUEST)
ROUTE_SCORED = (*SCORED, *BY_REQUEST)  # the first, knorm, stays the default when something is kept


class KeepError(ValueError):
    """A ``keep_tokens`` / ``keep_ratio`` / ``policy`` that cannot serve; ``field`` names the body field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class RangeError(ValueError):
    """A prune's ``ranges`` that cannot serve; ``field`` names the entry (``ranges`` or ``ranges[i]``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def parse_ranges(value: Any, bound: int | None, bound_name: str) -> list[tuple[int, int]]:
    """``[[start, end], ...]`` of logical positions -> sorted, merged ``[start, end)`` pairs, ``0 <= start < end <=
    bound`` (``bound_name`` says what bounds them; no upper check when ``bound`` is ``None``). The one parser of the
    route's body and a request's own prune; raises :class:`RangeError` naming the entry."""
    if not isinstance(value, Sequence) or isinstance(value, str) or not value:
        raise RangeError("ranges", "expected a non-empty list of [start, end] pairs")
    out = []
    for i, r in enumerate(value):
        if (not isinstance(r, Sequence) or isinstance(r, str) or len(r) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in r)):
            raise RangeError(f"ranges[{i}]", f"expected [start, end] integers, got {r!r}")
        lo, hi = r
        if not 0 <= lo < hi <= (hi if bound is None else bound):
            limit = "" if bound is None else f" <= {bound} ({bound_name})"
            raise RangeError(f"ranges[{i}]", f"[{lo}, {hi}) must satisfy 0 <= start < end{limit}")
        out.append((lo, hi))
    out.sort()
    merged = [out[0]]
    for lo, hi in out[1:]:
        if lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return merged


def parse_keep(body: Mapping[str, Any], size: int, page_size: int, policies: tuple[str, ...],
               scored: tuple[str, ...], hints: Mapping[str, str] | None = None) -> tuple[int, str]:
    """``keep_tokens`` / ``keep_ratio`` / ``policy`` of a prune body over ranges whose union holds ``size`` tokens
    -> ``(keep_tokens, policy)``. ``keep_ratio`` is taken over the union, rounded down to whole pages (SparseEngine's
    agent harness keeps a fraction of the tool tokens; with ``roles`` the client does not know the ranges' size).
    No policy: the first scored one when something is kept, else ``drop``. ``hints``: a sentence added to the error
    for a known policy name this caller does not serve. Raises :class:`KeepError`."""
    keep = body.get("keep_tokens", 0)
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 0:
        raise KeepError("keep_tokens", f"expected an integer >= 0, got {keep!r}")
    ratio = body.get("keep_ratio")
    if ratio is not None:
        if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0 <= ratio < 1:
            raise KeepError("keep_ratio", f"expected a number in [0, 1), got {ratio!r}")
        if "keep_tokens" in body:
            raise KeepError("keep_ratio", "give keep_tokens or keep_ratio, not both")
        keep = int(ratio * size) // page_size * page_size
    policy = body.get("policy")
    if policy is None:
        policy = scored[0] if keep or ratio else DROP
    if policy not in policies:
        hint = (hints or {}).get(policy) if isinstance(policy, str) else None
        raise KeepError("policy", f"{policy!r}: expected one of {', '.join(policies)}" + (f" ({hint})" if hint else ""))
    if (keep or ratio) and policy not in scored:
        field = "keep_ratio" if ratio else "keep_tokens"
        raise KeepError(field, f"policy {policy!r} keeps nothing: give {field} 0, or a scored policy "
                               f"({', '.join(scored)})")
    if keep % page_size:
        raise KeepError("keep_tokens", f"{keep} is not a multiple of the page size {page_size} (a page is kept or "
                                       "dropped whole)")
    if keep and size and keep >= size:
        raise KeepError("keep_tokens", f"{keep} must be less than the ranges' size, {size} tokens (their union): "
                                       "keeping them all prunes nothing")
    return keep, policy


def parse_evict_branches(body: Mapping[str, Any]) -> bool:
    """A prune body's ``evict_branches`` (default false), as the route and a request's own prune take it. Raises
    :class:`KeepError` naming the field."""
    evict = body.get("evict_branches", False)
    if not isinstance(evict, bool):
        raise KeepError("evict_branches", f"expected true or false, got {evict!r}")
    return evict


@dataclass(frozen=True)
class PruneSpec:
    """A request's own prune: sorted, merged prompt ranges and, when ``keep_tokens`` > 0, how many of their
    retained positions stay and by which policy's score (the budget is over the union). ``evict_branches``: at the
    request's finish, first evict the idle cached branches hanging off its path after the first range (an agent's
    earlier replies as generated, beside their re-rendered history), as ``POST /v1/prefix_cache/prune`` does, so
    the pruned KV is freed rather than kept for them."""

    ranges: tuple[tuple[int, int], ...]
    keep_tokens: int = 0
    policy: str = DROP
    evict_branches: bool = False

    @property
    def scores(self) -> bool:
        """Whether the prune scores (it reads the pool's keys)."""
        return self.keep_tokens > 0 and self.policy in REQUEST_SCORED

    @property
    def needs_window(self) -> bool:
        """Whether its scores read an observation window (the prompt's last queries captured); kvzip_global's come
        from replay forwards instead."""
        return self.scores and self.policy != KVZIP_GLOBAL
