"""The SGLang plug-in: entry point, idempotent registration, the patches still apply to 0.5.17."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import sglang

from sgl_sparse.integration import BACKEND_NAME, SGLANG_VERSION
from sgl_sparse.integration.cpu_support import support_triton_cpu


def test_pinned_sglang_version() -> None:
    assert sglang.__version__ == SGLANG_VERSION


def test_entry_point_is_installed() -> None:
    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "sgl_sparse"]
    assert len(eps) == 1 and eps[0].value == "sgl_sparse.integration.plugin:register"


def test_cpu_support_triton_answers_only_change_for_our_backend() -> None:
    assert support_triton_cpu(BACKEND_NAME) is False
    assert support_triton_cpu("torch_native") is False and support_triton_cpu("intel_amx") is False
    assert support_triton_cpu("triton") is True and support_triton_cpu("flashinfer") is True


def _run(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_load_plugins_registers_backends_and_patches_apply() -> None:
    """In a fresh process, as SGLang's launcher and scheduler do it (twice: must be idempotent)."""
    out = _run("""
        from sglang.srt.plugins import load_plugins
        from sgl_sparse.integration import plugin
        load_plugins()
        plugin.register()                      # second call: no-op
        plugin.check_registered()
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
        from sglang.srt.mem_cache.registry import registered_radix_cache_backends
        from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES
        import sglang.srt.utils as utils
        import sglang.srt.utils.common as common
        import sglang.srt.layers.rotary_embedding.base as rope_base
        print(ATTENTION_BACKEND_CHOICES.count("sgl_sparse"), "sgl_sparse" in ATTENTION_BACKENDS,
              registered_radix_cache_backends().count("sgl_sparse"))
        print(common.support_triton("sgl_sparse"), utils.support_triton("sgl_sparse"),
              common.support_triton("torch_native"), common.support_triton("triton"))
        print(rope_base._is_cpu)
    """)
    assert out.split("\n")[:3] == ["1 True 1", "False False False True", "True"]


def test_without_the_plugin_cpu_rope_would_need_vllm() -> None:
    """Negative control for the RoPE fix: the stock module picks the vllm fallback on this host."""
    out = _run("""
        import sglang.srt.layers.rotary_embedding.base as rope_base
        print(rope_base._is_cpu, rope_base._is_cuda)
    """)
    assert out.strip() == "False False"
