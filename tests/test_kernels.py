"""Triton kernels under TRITON_INTERPRET=1 on CPU (small shapes), against plain-torch references.

The interpreter must be enabled before triton is imported: :func:`test_kernels_under_the_interpreter` checks
this file's tests in the session's interpreted run (tests/interpreted.py, one subprocess for every kernel file).
"""

from __future__ import annotations

import pytest
import torch
import triton
from interpreted import INTERPRETED, assert_interpreted_passed
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sgl_sparse.kernels import compact
from sgl_sparse.kernels import window_scores as ws
from sgl_sparse.methods.eviction.base import per_head_scores_torch

only_interpreted = pytest.mark.skipif(not INTERPRETED, reason="the kernel runs in the interpreted run")


@only_interpreted
def test_compact_kv_indices_matches_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compact, "BLOCK", 16)  # several blocks per row at small shapes
    g = torch.Generator().manual_seed(0)
    rows, width = 6, 80
    req_to_token = torch.randint(1, 1000, (rows, width), generator=g, dtype=torch.int32)
    req_to_token[0] = 0                                   # padding row
    req_to_token[2, 5:40] = 0                             # evicted range
    req_to_token[3, torch.rand(width, generator=g) < 0.5] = 0
    req_to_token[4, :] = 0                                # all evicted
    cases = [([1, 2, 3], [80, 50, 33]), ([0, 2], [1, 70]), ([5, 4], [0, 10]), ([2], [17])]
    for min_one in (False, True):
        for rpi, lens in cases:
            rpi_t = torch.tensor(rpi, dtype=torch.int64)
            lens_t = torch.tensor(lens, dtype=torch.int32)
            indptr = torch.zeros(len(rpi) + 1, dtype=torch.int32)
            indices = torch.full((int(lens_t.sum()) + 1,), -1, dtype=torch.int64)
            got_ptr = compact.fill_compact_kv_indices(req_to_token, rpi_t, lens_t, indptr, indices, min_one)
            ref_ptr, ref_idx = compact.compact_kv_indices_reference(req_to_token, rpi_t, lens_t, min_one)
            assert got_ptr.tolist() == ref_ptr.tolist(), (rpi, got_ptr, ref_ptr)
            assert indices[: int(ref_ptr[-1])].tolist() == ref_idx.tolist(), rpi
            # The same lists in one pass from known counts (the decode path's device table).
            counts = (ref_ptr[1:] - ref_ptr[:-1]).to(torch.int32)
            indices2 = torch.full_like(indices, -1)
            none_wrong = torch.zeros(1, dtype=torch.int64)
            got2 = compact.fill_compact_kv_indices(req_to_token, rpi_t, lens_t, torch.zeros_like(indptr),
                                                   indices2, min_one, counts=counts, mismatches=none_wrong)
            assert got2.tolist() == ref_ptr.tolist() and indices2.tolist() == indices.tolist(), rpi
            assert none_wrong.item() == 0
    # A wrong count never writes outside its row's range: too small truncates, too large pads
    # with the padding slot.
    rpi_t = torch.tensor([3, 1], dtype=torch.int64)
    lens_t = torch.tensor([80, 30], dtype=torch.int32)
    ref_ptr, ref_idx = compact.compact_kv_indices_reference(req_to_token, rpi_t, lens_t)
    n3, n1 = int(ref_ptr[1]), int(ref_ptr[2] - ref_ptr[1])
    for c3 in (n3 - 5, n3 + 7):
        indices = torch.full((200,), -1, dtype=torch.int64)
        mismatches = torch.zeros(1, dtype=torch.int64)
        ptr = compact.fill_compact_kv_indices(req_to_token, rpi_t, lens_t, torch.zeros(3, dtype=torch.int32),
                                              indices, counts=torch.tensor([c3, n1], dtype=torch.int32),
                                              mismatches=mismatches)
        assert ptr.tolist() == [0, c3, c3 + n1] and mismatches.item() == 1  # row 3's count is wrong
        want3 = ref_idx[:n3].tolist()[:c3] + [0] * max(0, c3 - n3)
        assert indices[:c3].tolist() == want3, c3
        assert indices[c3:c3 + n1].tolist() == req_to_token[1, :30].tolist()
        assert (indices[c3 + n1:] == -1).all()
    # A count beyond the row's logical length is capped there (kv_indices is sized by seq_lens).
    ptr = compact.fill_compact_kv_indices(req_to_token, rpi_t, lens_t, torch.zeros(3, dtype=torch.int32),
                                          torch.full((110,), -1, dtype=torch.int64),
                                          counts=torch.tensor([500, n1], dtype=torch.int32))
    assert ptr.tolist() == [0, 80, 80 + n1]
    # An all-evicted prefix is an empty list (it must not attend the padding slot); a padding
    # row gets one slot only for the Triton decode kernel.
    one = torch.tensor([4], dtype=torch.int64)
    ten = torch.tensor([10], dtype=torch.int32)
    assert compact.compact_kv_indices_reference(req_to_token, one, ten)[0].tolist() == [0, 0]
    assert compact.compact_kv_indices_reference(req_to_token, one, ten, min_one=True)[0].tolist() == [0, 1]


@only_interpreted
def test_window_scores_kernel_matches_plain_softmax(monkeypatch: pytest.MonkeyPatch) -> None:
    """SnapKV's streamed scores equal a per-row softmax loop: GQA groups, padded rows (w * G not a
    power of two), keys at non-contiguous positions (evicted ones skipped), causal masking inside the
    window, several key splits merged, a row that sees no key."""
    monkeypatch.setattr(ws, "SPLIT_N", 64)
    monkeypatch.setattr(ws, "BLOCK_N", 16)

    g = torch.Generator().manual_seed(0)

    def plain(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
              scale: float) -> torch.Tensor:
        w, H, D = q.shape
        n, Hkv, _ = k.shape
        G = H // Hkv
        out = torch.zeros(Hkv, n, dtype=torch.float64)
        for t in range(w):
            for h in range(H):
                vis = k_pos <= q_pos[t]
                if not vis.any():
                    continue
                logits = (k[:, h // G].double() @ q[t, h].double()) * scale
                logits[~vis] = float("-inf")
                out[h // G] += logits.softmax(0)
        return out

    for (w, H, Hkv, D, n) in [(5, 4, 2, 32, 300), (3, 6, 2, 16, 40), (32, 8, 2, 64, 257), (4, 2, 1, 24, 1)]:
        q = torch.randn(w, H, D, generator=g) * 2
        k = torch.randn(n, Hkv, D, generator=g) * 2
        k_pos = torch.sort(torch.randperm(n * 2, generator=g)[:n]).values   # retained positions
        top = int(k_pos[-1])
        q_pos = torch.tensor([top - 2 * (w - 1 - t) for t in range(w)])     # the window ends at the last key
        q_pos[0] = int(k_pos[0]) - 1                                         # sees no key at all
        got = ws.window_scores_per_head(q, k, q_pos, k_pos, D ** -0.5)
        ref = plain(q, k, q_pos, k_pos, D ** -0.5)
        assert got.shape == (Hkv, n)
        assert torch.allclose(got.double(), ref, atol=1e-5, rtol=1e-4), (w, H, (got.double() - ref).abs().max())
        # Read in place through row indices, as from a KV pool's buffer (the keys at scattered slots).
        rows = torch.randperm(3 * n + 7, generator=g)[:n]
        buf = torch.randn(3 * n + 7, Hkv, D, generator=g).index_copy_(0, rows, k)
        got_rows = ws.window_scores_per_head(q, buf, q_pos, k_pos, D ** -0.5, k_rows=rows)
        assert torch.allclose(got_rows, got), w
        # SnapKV's CPU path (the dense einsum) agrees too
        assert torch.allclose(per_head_scores_torch(q, k, q_pos, k_pos, D ** -0.5).double(), ref, atol=1e-5)


@pytest.mark.skipif(INTERPRETED, reason="compiles for the GPU: the interpreted run's kernels are not compilable")
def test_kernels_compile_for_the_h200() -> None:
    """Triton compiles each kernel to sm_90 machine code (ptxas ships with triton), no GPU needed: catches
    what the interpreter accepts but the compiler does not (dot shapes, dtypes, loop bounds)."""
    def sig(names: dict[str, str], consts: str) -> dict[str, str]:
        types = {n: t for t, ns in names.items() for n in ns.split()}
        return {**types, **{c: "constexpr" for c in consts.split()}}

    scalars = "n w stride_qw stride_qh stride_kn stride_kh"
    cases = [
        (ws._row_stats_kernel, sig({"*bf16": "q k", "*i64": "k_rows q_pos k_pos", "*fp32": "m_out l_out",
                                    "i32": scalars + " num_splits", "fp32": "scale"},
                                   "G R D D_P SPLIT BLOCK"),
         dict(G=4, R=128, D=128, D_P=128, SPLIT=ws.SPLIT_N, BLOCK=ws.BLOCK_N)),
        (ws._prob_sum_kernel, sig({"*bf16": "q k", "*i64": "k_rows q_pos k_pos", "*fp32": "m_in l_in out",
                                   "i32": scalars, "fp32": "scale"}, "G R D D_P BLOCK"),
         dict(G=4, R=128, D=128, D_P=128, BLOCK=ws.BLOCK_N)),
    ]
    # The compaction kernels with each dtype pair they are called with: (seq_lens, kv_indices) as the
    # tests pass them, and as FlashInfer does (int64 seq_lens, int32 kv_indices).
    consts = dict(stride=131072, SENTINEL=0, BLOCK_N=compact.BLOCK)
    for lens_t, idx_t in (("*i32", "*i64"), ("*i64", "*i32")):
        common = {"*i32": "req_to_token", "*i64": "req_pool_indices", "i32": "nblk"}
        cases += [
            (compact._block_count_kernel, {**sig(common, "stride SENTINEL BLOCK_N"), "seq_lens": lens_t,
                                           "block_counts": "*i32"}, consts),
            (compact._block_compact_kernel, {**sig(common, "stride SENTINEL BLOCK_N"), "seq_lens": lens_t,
                                             **sig({"*i32": "kv_indptr block_offsets row_live"}, ""),
                                             "kv_indices": idx_t}, consts),
        ]
    for fn, signature, consts in cases:
        order = fn.arg_names
        assert sorted(order) == sorted(signature), (fn.__name__, order)
        src = ASTSource(fn=fn, signature={a: signature[a] for a in order}, constexprs=consts)
        triton.compile(src, target=GPUTarget("cuda", 90, 32))


@pytest.mark.skipif(INTERPRETED, reason="this is the interpreted run")
def test_kernels_under_the_interpreter() -> None:
    assert_interpreted_passed(__file__)
