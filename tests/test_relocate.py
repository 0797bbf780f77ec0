"""Prompt-end relocation of kept KV (``integration/relocate.py``) through the runtime's real apply step,
on SGLang 0.5.17's own ``ReqToTokenPool``, ``MHATokenToKVPool`` and ``TokenToKVPoolAllocator`` (CPU).

Each slot's K and V rows are filled with a value naming the slot, so after a plan the test can tell,
for every kept position, which slot its KV came from: it must be the slot the position held before,
while the position now sits in the smallest owned slots, in position order.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

from sgl_sparse.integration import relocate, step
from sgl_sparse.integration.runtime import SparseRuntime, Tracked
from sgl_sparse.registry import create_method
from sgl_sparse.slots import SENTINEL_SLOT

POOL = 256
LAYERS = 2


def _setup(monkeypatch: pytest.MonkeyPatch, on: bool = True) -> tuple[SparseRuntime, SimpleNamespace]:
    monkeypatch.setenv(relocate.ENV, "1" if on else "0")
    kv = MHATokenToKVPool(POOL, 1, torch.float32, head_num=2, head_dim=4, layer_num=LAYERS, device="cpu",
                          enable_memory_saver=False)
    alloc = TokenToKVPoolAllocator(POOL, torch.float32, "cpu", kv, need_sort=False)
    req_pool = ReqToTokenPool(size=4, max_context_len=128, device="cpu", enable_memory_saver=False)
    for layer in range(LAYERS):  # slot s holds s (K) and -s (V) in every element, + the layer
        ids = torch.arange(POOL + 1, dtype=torch.float32)[:, None, None]
        kv.k_buffer[layer][:] = ids + 1000 * layer
        kv.v_buffer[layer][:] = -ids - 1000 * layer
    runner = SimpleNamespace(req_to_token_pool=req_pool, token_to_kv_pool=kv, token_to_kv_pool_allocator=alloc)
    m = create_method("snapkv", {"budget": 16, "window_size": 4, "sink_tokens": 2})
    rt = SparseRuntime(method=m, fingerprint=m.config.fingerprint())
    rt.bind_pool(runner)
    return rt, runner


def _request(rt: SparseRuntime, runner: SimpleNamespace, rid: str, row: int, n: int, protected: int,
             shuffle: bool = False) -> tuple[SimpleNamespace, Tracked, torch.Tensor]:
    """A request on ``row`` holding ``n`` positions, the first ``protected`` of them tree-owned."""
    slots = runner.token_to_kv_pool_allocator.alloc(n)
    if shuffle:  # a prompt allocated in non-ascending pieces (fragmented pool)
        slots = slots[torch.randperm(n, generator=torch.Generator().manual_seed(row))]
    runner.req_to_token_pool.req_to_token[row, :n] = slots.to(torch.int32)
    st = rt.method.new_state(rid)
    st.set_kept(torch.arange(n), logical_len=n)
    return SimpleNamespace(rid=rid, cache_protected_len=protected), Tracked(st, row), slots.clone()


def _kv_source(runner: SimpleNamespace, slot: int) -> int:
    """Which slot's KV a slot holds now (checked in every layer, K and V)."""
    kv = runner.token_to_kv_pool
    src = int(kv.k_buffer[0][slot, 0, 0])
    for layer in range(LAYERS):
        assert torch.all(kv.k_buffer[layer][slot] == src + 1000 * layer)
        assert torch.all(kv.v_buffer[layer][slot] == -src - 1000 * layer)
    return src


@pytest.mark.parametrize("shuffle", [False, True])
def test_prompt_end_plan_moves_kept_kv_into_the_smallest_owned_slots(monkeypatch: pytest.MonkeyPatch,
                                                                     shuffle: bool) -> None:
    rt, runner = _setup(monkeypatch)
    assert rt.relocate_pool is runner.token_to_kv_pool
    r2t = runner.req_to_token_pool.req_to_token
    alloc = runner.token_to_kv_pool_allocator
    a = _request(rt, runner, "a", 1, 60, protected=10, shuffle=shuffle)
    b = _request(rt, runner, "b", 2, 40, protected=0, shuffle=shuffle)
    keep_a = torch.tensor([0, 3, 9, 10, 11, 17, 30, 31, 32, 58, 59])  # 3 tree-owned + 8 owned
    keep_b = torch.tensor([1, 2, 20, 39])
    free_before = alloc.available_size()
    step._apply(rt, [(a[0], a[1], keep_a, True), (b[0], b[1], keep_b, True)], runner)

    for (req, t, old), keep in ((a, keep_a), (b, keep_b)):
        row = r2t[t.pool_idx]
        protected = req.cache_protected_len
        owned_keep = keep[keep >= protected]
        # Tree-owned positions never move.
        assert torch.equal(row[keep[keep < protected]].long(), old[keep[keep < protected]])
        # Owned kept positions sit in the smallest owned slots, ascending with position ...
        expect = old[protected:].sort().values[: owned_keep.numel()]
        assert torch.equal(row[owned_keep].long(), expect)
        # ... holding the KV their position had before.
        for p in owned_keep.tolist():
            assert _kv_source(runner, int(row[p])) == int(old[p])
        # Dropped positions are holes; the host kept set is the plan.
        dropped = torch.tensor([p for p in range(old.numel()) if p not in set(keep.tolist())])
        assert torch.all(row[dropped] == SENTINEL_SLOT)
        assert torch.equal(t.state.kept, keep)
    # Exactly the owned dropped count came back, and none of the slots still in use.
    owned_dropped = (60 - 10 - 8) + (40 - 4)
    assert alloc.available_size() == free_before + owned_dropped
    in_use = set(r2t[1, :60].tolist()) | set(r2t[2, :40].tolist())
    free = set(alloc.free_pages.tolist())
    assert not (free & in_use - {SENTINEL_SLOT})
    assert rt.counters.relocated_requests_total == 2


def test_decode_plans_and_the_switch_leave_the_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    for on, final in ((True, False), (False, True)):
        rt, runner = _setup(monkeypatch, on=on)
        assert (rt.relocate_pool is None) == (not on)
        a = _request(rt, runner, "a", 1, 30, protected=0)
        keep = torch.tensor([0, 1, 12, 28, 29])
        step._apply(rt, [(a[0], a[1], keep, final)], runner)
        row = runner.req_to_token_pool.req_to_token[1]
        assert torch.equal(row[keep].long(), a[2][keep])  # same slots, same KV
        for p in keep.tolist():
            assert _kv_source(runner, int(row[p])) == int(a[2][p])
        assert rt.counters.relocated_requests_total == 0
