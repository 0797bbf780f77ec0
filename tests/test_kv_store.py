"""Method-owned KV layouts (contract ``KVStore``): FP8's store, the extend merge, and the SGLang pool around it.

References are plain torch written here: attention over the dequantized K/V (what the store must read
back), causal attention over prefix + new tokens in one softmax (what the split extend must equal).
"""

from __future__ import annotations

import math

import pytest
import torch

from sgl_sparse.contract import KVGeometry
from sgl_sparse.integration.store_attention import (
    StoreRows,
    causal_attention_torch,
    dense_prefix,
    merge,
    prefix_attention_torch,
)
from sgl_sparse.kernels import quant
from sgl_sparse.methods.quantization.fp8_kv import FP8Store
from sgl_sparse.registry import create_method

HKV, G, D, LAYERS, SLOTS = 2, 2, 16, 3, 64
SCALE = 1 / math.sqrt(D)


def _geometry(dtype: torch.dtype = torch.float32) -> KVGeometry:
    return KVGeometry(num_layers=LAYERS, num_q_heads=HKV * G, num_kv_heads=HKV, head_dim=D, page_size=1,
                      num_slots=SLOTS, dtype=dtype, device=torch.device("cpu"))


def _store() -> FP8Store:
    store = create_method("fp8_kv").store
    assert isinstance(store, FP8Store)
    store.allocate(_geometry())
    return store


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_from: int | None = None) -> torch.Tensor:
    """``q`` over ``k``/``v``; with ``causal_from``, query t sees keys up to ``causal_from + t``."""
    kk, vv = k.float().repeat_interleave(G, dim=1), v.float().repeat_interleave(G, dim=1)
    logits = torch.einsum("thd,shd->ths", q.float(), kk) * SCALE
    if causal_from is not None:
        t = torch.arange(q.shape[0])[:, None, None]
        s = torch.arange(k.shape[0])[None, None, :]
        logits = logits.masked_fill(s > causal_from + t, float("-inf"))
    return torch.einsum("ths,shd->thd", torch.softmax(logits, dim=-1), vv)


def test_bytes_per_token_count_codes_and_scales() -> None:
    g = _geometry(torch.bfloat16)
    store = create_method("fp8_kv").store
    assert store.bytes_per_token(g) == LAYERS * 2 * HKV * (D + 4)
    store.allocate(g)
    allocated = sum(t.numel() * t.element_size() for i in range(LAYERS) for t in store.slot_tensors(i))
    assert allocated == store.bytes_per_token(g) * SLOTS  # what is counted is what is taken


def test_write_then_read_is_the_fp8_round_trip_per_slot_and_layer() -> None:
    store = _store()
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(10, HKV, D, generator=gen) * torch.logspace(-2, 2, 10)[:, None, None]  # per-token ranges
    v = torch.randn(10, HKV, D, generator=gen)
    loc = torch.randperm(SLOTS - 1, generator=gen)[:10] + 1
    store.write(1, loc, k, v, torch.zeros_like(loc), decode=False)
    got_k, got_v = store.read(1, loc)
    want_k = quant.fp8_dequantize(*quant.fp8_quantize(k), torch.float32)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, quant.fp8_dequantize(*quant.fp8_quantize(v),
                                                                                  torch.float32))
    # per-(token, head) scales: every row keeps ~3 significant bits whatever its magnitude
    assert ((got_k - k).abs() <= k.abs().amax(-1, keepdim=True) / 8 + 1e-12).all()
    assert store.read(0, loc)[0].abs().sum() == 0  # other layers untouched


def test_reference_decode_and_prefix_read_the_dequantized_rows() -> None:
    store = _store()
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(40, HKV, D, generator=gen), torch.randn(40, HKV, D, generator=gen)
    slots = torch.randperm(SLOTS - 1, generator=gen)[:40] + 1
    store.write(2, slots, k, v, torch.zeros_like(slots), decode=False)
    kd, vd = store.read(2, slots)
    r2t = torch.zeros(3, 50, dtype=torch.int32)
    r2t[1, :25], r2t[2, :15] = slots[:25], slots[25:]
    q = torch.randn(2, HKV * G, D, generator=gen)
    out = store.decode(2, q, r2t, torch.tensor([1, 2]), torch.tensor([25, 15]), SCALE)
    torch.testing.assert_close(out[0], _attend(q[:1], kd[:25], vd[:25])[0])
    torch.testing.assert_close(out[1], _attend(q[1:], kd[25:], vd[25:])[0])
    qe = torch.randn(7, HKV * G, D, generator=gen)  # 3 new tokens of row 0 over 25 cached, 4 of row 1 over none
    o, lse = store.prefix(2, qe, torch.tensor([0, 3, 7]), r2t, torch.tensor([1, 2]), torch.tensor([25, 0]), [3, 4],
                          SCALE)
    torch.testing.assert_close(o[:3], _attend(qe[:3], kd[:25], vd[:25]))
    assert torch.isinf(lse[3:]).all() and torch.isfinite(lse[:3]).all()


@pytest.mark.parametrize("method", ["fp8_kv", "turboquant"])
def test_the_dequantized_prefix_path_reads_what_the_store_prefix_reads(method: str) -> None:
    """``prefix_attention: dequantize``: the step's prefix slots listed flat (rows in the batch's order, scattered
    slots, rows of the table the batch skips), read through ``store.read`` and attended by plain torch, give the
    store's own ``prefix`` output and log-sum-exp, request by request."""
    store = create_method(method).store  # "auto": dequantize where served
    assert store is not None and store.dequantize_prefix
    assert store.describe()["prefix_attention"] == "dequantize"
    assert not create_method(method, {"prefix_attention": "kernel"}).store.dequantize_prefix
    store.allocate(_geometry())
    gen = torch.Generator().manual_seed(7)
    slots = torch.randperm(SLOTS - 1, generator=gen)[:45] + 1
    store.write(1, slots, torch.randn(45, HKV, D, generator=gen), torch.randn(45, HKV, D, generator=gen),
                torch.zeros_like(slots), decode=False)
    r2t = torch.zeros(5, 50, dtype=torch.int32)
    r2t[3, :30], r2t[1, :15] = slots[:30], slots[30:]
    indices, lens, extend = torch.tensor([3, 1]), [30, 12], [5, 2]  # row 1: its first 12 of 15 cached
    dense = dense_prefix(StoreRows(r2t, indices, torch.tensor(lens)), lens)
    assert dense.slots.tolist() == [*slots[:30].tolist(), *slots[30:42].tolist()]
    assert dense.kv_indptr.tolist() == [0, 30, 42] and dense.kv_indptr.dtype == torch.int32
    assert not dense.kv_indptr.is_cuda
    q = torch.randn(sum(extend), HKV * G, D, generator=gen)
    k, v = store.read_prefix(1, r2t, indices, torch.tensor(lens), lens, dense.slots)
    got, got_lse = prefix_attention_torch(q, k, v, extend, lens, SCALE)
    want, want_lse = store.prefix(1, q, torch.tensor([0, 5, 7]), r2t, indices, torch.tensor(lens), extend, SCALE)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-5, rtol=1e-5)


def test_read_prefix_reads_in_pieces_what_one_read_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    from sgl_sparse import store_reads

    store = _store()
    gen = torch.Generator().manual_seed(8)
    slots = torch.randperm(SLOTS - 1, generator=gen)[:23] + 1
    store.write(0, slots, torch.randn(23, HKV, D, generator=gen), torch.randn(23, HKV, D, generator=gen),
                torch.zeros_like(slots), decode=False)
    monkeypatch.setattr(store_reads, "READ_PIECE", 5)
    r2t = slots[None].to(torch.int32)
    k, v = store.read_prefix(0, r2t, torch.tensor([0]), torch.tensor([23]), [23], slots)
    want_k, want_v = store.read(0, slots)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


def test_prefix_attention_is_validated() -> None:
    from sgl_sparse.errors import SparseConfigError

    with pytest.raises(SparseConfigError, match="prefix_attention"):
        create_method("fp8_kv", {"prefix_attention": "fast"})
    with pytest.raises(SparseConfigError, match="prefix_attention.*qjl"):
        create_method("turboquant", {"prefix_attention": "dequantize", "qjl": True})


def test_auto_falls_back_to_the_kernel_where_the_dequantized_read_is_not_served() -> None:
    """``auto`` reads through the kernel where ``dequantize`` is not served (TurboQuant's ``qjl``; on a GPU base
    without a dense prefill, which the backend declines) and ``describe`` says why; an explicit ``dequantize``
    there is refused. Under eviction (a composition) it is served: the compacted prefix is read dequantized."""
    from sgl_sparse.errors import SparseConfigError

    qjl = create_method("turboquant", {"qjl": True}).store
    assert not qjl.dequantize_prefix
    assert qjl.describe()["prefix_attention"] == "kernel" and "qjl" in qjl.describe()["prefix_attention_fallback"]
    composed = create_method("snapkv+turboquant").store
    assert composed.dequantize_prefix and "prefix_attention_fallback" not in composed.describe()
    assert not create_method("snapkv+turboquant", {"turboquant": {"qjl": True}}).store.dequantize_prefix
    for mode, served in (("auto", False), ("kernel", False)):
        store = create_method("fp8_kv", {"prefix_attention": mode}).store
        store.decline_dequantized_prefix("not here")
        assert store.dequantize_prefix is served
        assert store.describe()["prefix_attention_config"] == mode
    explicit = create_method("fp8_kv", {"prefix_attention": "dequantize"}).store
    with pytest.raises(SparseConfigError, match="'dequantize': not here"):
        explicit.decline_dequantized_prefix("not here")
    assert explicit.dequantize_prefix  # refused, unchanged


@pytest.mark.parametrize(("prefix", "new"), [(0, 6), (9, 1), (20, 7)])
def test_new_tokens_causal_merged_with_the_prefix_is_one_causal_softmax(prefix: int, new: int) -> None:
    """The split extend (new tokens among themselves + prefix, merged by log-sum-exp) equals causal attention
    over prefix + new keys in one softmax."""
    gen = torch.Generator().manual_seed(prefix + new)
    k, v = torch.randn(prefix + new, HKV, D, generator=gen), torch.randn(prefix + new, HKV, D, generator=gen)
    q = torch.randn(new, HKV * G, D, generator=gen)
    o_new, lse_new = causal_attention_torch(q, k[prefix:], v[prefix:], [new], SCALE)
    store = _store()
    slots = torch.arange(1, prefix + 1)
    o = o_new
    if prefix:
        store.write(0, slots, k[:prefix], v[:prefix], torch.zeros_like(slots), decode=False)
        kd, vd = store.read(0, slots)
        k, v = torch.cat([kd, k[prefix:]]), torch.cat([vd, v[prefix:]])
        o_pre, lse_pre = store.prefix(0, q, torch.tensor([0, new]), slots[None].to(torch.int32), torch.tensor([0]),
                                      torch.tensor([prefix]), [new], SCALE)
        o = merge(o_new, lse_new, o_pre, lse_pre)
    torch.testing.assert_close(o, _attend(q, k, v, causal_from=prefix), atol=1e-5, rtol=1e-5)


def test_sglang_pool_lists_the_store_buffers_and_refuses_raw_writes() -> None:
    """SGLang's real MHA pool class, subclassed: the K/V buffer lists are the store's codes, a slot move
    covers the scales too, the size is the store's, and SGLang's own write path raises (K/V goes through
    the store, with each token's row)."""
    from sgl_sparse.integration.kv_pool import store_pool_class

    store = create_method("fp8_kv").store
    pool = store_pool_class()(store, HKV * G, 4, SLOTS - 1, page_size=1, dtype=torch.float32, head_num=HKV,
                              head_dim=D, layer_num=LAYERS, device="cpu", enable_memory_saver=False,
                              enable_alt_stream=False)
    assert pool.k_buffer[1] is store.k_codes[1] and pool.v_buffer[2] is store.v_codes[2]
    assert len(pool._slot_move_pointer_buffers()) == 4 * LAYERS
    k_bytes, rest = pool.get_kv_size_bytes()
    assert k_bytes + rest == store.bytes_per_token(pool.geometry()) * SLOTS

    with pytest.raises(RuntimeError, match="written by sgl_sparse's attention backend"):
        pool.set_kv_buffer(None, torch.tensor([3]), torch.zeros(1, HKV * D), torch.zeros(1, HKV * D))


def test_a_kivi_pool_refuses_a_slot_move() -> None:
    """KIVI's keys need their page's scales and an open page its request's residual, which no slot move carries:
    SGLang's move (speculative decoding only, refused at launch) raises instead of moving codes alone."""
    from sgl_sparse.integration.kv_pool import store_pool_class

    store = create_method("kivi", {"group_size": 8}).store
    pool = store_pool_class()(store, HKV * G, 4, SLOTS - 8, page_size=8, dtype=torch.float32, head_num=HKV,
                              head_dim=D, layer_num=LAYERS, device="cpu", enable_memory_saver=False,
                              enable_alt_stream=False)
    with pytest.raises(RuntimeError, match="cannot be moved"):
        pool.move_kv_cache(torch.tensor([16]), torch.tensor([8]))


def test_a_compacted_prefix_is_listed_by_its_live_slots() -> None:
    """Under eviction (``compact``) the dequantized read lists each row's live slots (sentinels skipped, position
    order) and counts them per request on the host; a row whose live prefix is empty sends the step to the kernel."""
    from types import SimpleNamespace

    from sgl_sparse.integration.store_attention import extend_lists
    from sgl_sparse.slots import SENTINEL_SLOT

    r2t = torch.zeros(4, 16, dtype=torch.int64)
    r2t[1, :6] = torch.tensor([11, SENTINEL_SLOT, 12, SENTINEL_SLOT, 13, 14])
    r2t[3, :3] = torch.tensor([21, 22, 23])

    def batch(rows: list[int], prefix: list[int], new: list[int]) -> SimpleNamespace:
        return SimpleNamespace(extend_seq_lens_cpu=new, extend_seq_lens=torch.tensor(new),
                               req_pool_indices=torch.tensor(rows), extend_prefix_lens=torch.tensor(prefix),
                               extend_prefix_lens_cpu=prefix)

    lists = extend_lists(batch([3, 1], [3, 6], [2, 1]), r2t, compact=True, dequantize=True)
    assert lists.dense is not None and lists.dense.lens == [3, 4]
    assert lists.dense.slots.tolist() == [21, 22, 23, 11, 12, 13, 14]
    assert lists.dense.kv_indptr.tolist() == [0, 3, 7]
    assert lists.dense.q_rows is None and lists.dense.qo_indptr.tolist() == [0, 2, 3]
    # Every prefix token of row 3 evicted: row 1 alone goes to the prefill (its one new token is row 2 of q).
    r2t[3, :3] = SENTINEL_SLOT
    lists = extend_lists(batch([3, 1], [3, 6], [2, 1]), r2t, compact=True, dequantize=True)
    assert lists.dense is not None and lists.dense.lens == [0, 4] and lists.dense.slots.tolist() == [11, 12, 13, 14]
    assert lists.dense.q_rows.tolist() == [2] and lists.dense.qo_indptr.tolist() == [0, 1]
    assert lists.dense.kv_indptr.tolist() == [0, 4]


def test_requests_without_a_prefix_take_no_part_in_the_dequantized_read() -> None:
    """A step mixing requests with and without a cached prefix reads dequantized: the new tokens of a request
    without one get an empty prefix part (output 0, log-sum-exp -inf), which the merge weighs 0; the others read
    their prefix as the store's own kernel path does."""
    store = create_method("fp8_kv").store
    store.allocate(_geometry())
    gen = torch.Generator().manual_seed(3)
    slots = torch.randperm(SLOTS - 1, generator=gen)[:40] + 1
    store.write(1, slots, torch.randn(40, HKV, D, generator=gen), torch.randn(40, HKV, D, generator=gen),
                torch.zeros(40, dtype=torch.int64), decode=False)
    r2t = torch.zeros(3, 64, dtype=torch.int64)
    r2t[0, :25], r2t[2, :15] = slots[:25], slots[25:]
    lens, extend = [25, 0, 15], [3, 4, 2]
    dense = dense_prefix(StoreRows(r2t, torch.arange(3), torch.tensor(lens)), lens, extend)
    assert dense.q_rows.tolist() == [0, 1, 2, 7, 8] and dense.kv_indptr.tolist() == [0, 25, 40]
    assert dense.qo_indptr.tolist() == [0, 3, 5]
    q = torch.randn(sum(extend), HKV * G, D, generator=gen)
    k, v = store.read(1, dense.slots)
    got, got_lse = prefix_attention_torch(q, k, v, extend, lens, SCALE)
    want, want_lse = store.prefix(1, q, torch.tensor([0, 3, 7, 9]), r2t, torch.arange(3), torch.tensor(lens),
                                  extend, SCALE)
    torch.testing.assert_close(got, want.float(), atol=1e-4, rtol=1e-4)
    assert torch.isinf(got_lse[3:7]).all() and (got[3:7] == 0).all()
    torch.testing.assert_close(got_lse, want_lse, atol=1e-4, rtol=1e-4)
