"""Triton kernels under TRITON_INTERPRET=1 on CPU (small shapes), against plain-torch references.

The interpreter must be enabled before triton is imported, so each test runs in a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def _run_interpreted(code: str) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    return r.stdout


def test_compact_kv_indices_matches_reference() -> None:
    out = _run_interpreted("""
        import torch
        from sgl_sparse.kernels import compact
        compact.BLOCK = 16   # several blocks per row at small shapes
        g = torch.Generator().manual_seed(0)
        rows, width = 6, 80
        req_to_token = torch.randint(1, 1000, (rows, width), generator=g, dtype=torch.int32)
        req_to_token[0] = 0                                   # padding row
        req_to_token[2, 5:40] = 0                             # evicted range
        req_to_token[3, torch.rand(width, generator=g) < 0.5] = 0
        req_to_token[4, :] = 0                                # all evicted
        cases = [([1, 2, 3], [80, 50, 33]), ([0, 2], [1, 70]), ([5, 4], [0, 10]), ([2], [17])]
        for rpi, lens in cases:
            rpi_t = torch.tensor(rpi, dtype=torch.int64); lens_t = torch.tensor(lens, dtype=torch.int32)
            indptr = torch.zeros(len(rpi) + 1, dtype=torch.int32)
            indices = torch.full((int(lens_t.sum()) + 1,), -1, dtype=torch.int64)
            got_ptr = compact.fill_compact_kv_indices(req_to_token, rpi_t, lens_t, indptr, indices)
            ref_ptr, ref_idx = compact.compact_kv_indices_reference(req_to_token, rpi_t, lens_t)
            assert got_ptr.tolist() == ref_ptr.tolist(), (rpi, got_ptr, ref_ptr)
            assert indices[: int(ref_ptr[-1])].tolist() == ref_idx.tolist(), rpi
        print("ok")
    """)
    assert out.strip() == "ok"
