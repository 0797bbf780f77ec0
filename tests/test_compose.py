"""Composition of an eviction method over a quantization method's pool (``snapkv+fp8_kv``): the name and
config syntax, the fingerprint, which combinations are refused and why, the hooks, and the compacted rows a
store reads under eviction (no server; ``tests/test_compose_e2e.py`` serves them)."""

from __future__ import annotations

import pytest
import torch

from sgl_sparse import SparseConfigError, create_method
from sgl_sparse.compose import Composed, family_label
from sgl_sparse.contract import KeepPlan, RequestState, StepInfo, TreePayload
from sgl_sparse.integration.store_attention import compact_rows
from sgl_sparse.methods.quantization.fp8_kv import FP8Store
from sgl_sparse.rules import served_hooks_problem


def test_config_is_keyed_by_member_and_reported_as_given() -> None:
    m = create_method("snapkv+kivi", '{"snapkv": {"budget": 1024}, "kivi": {"bits": 2}}')
    assert isinstance(m, Composed) and m.name == "snapkv+kivi" and m.evicts
    assert m.config.to_dict()["snapkv"]["budget"] == 1024 and m.config.to_dict()["kivi"] == {
        "prefix_attention": "auto", "bits": 2, "group_size": 32}
    assert m.store is m.quantization.store and m.selector is None
    assert m.observation_window() == 32  # SnapKV's
    assert family_label(m) == "eviction+quantization" and family_label(create_method("snapkv")) == "eviction"
    # A member left out keeps its defaults; the handed-off dict builds the same composition again.
    d = create_method("streamingllm+fp8_kv", {"streamingllm": {"recent_tokens": 100}})
    assert d.config.to_dict() == {"streamingllm": {"sink_tokens": 64, "recent_tokens": 100, "evict_interval": 64},
                                  "fp8_kv": {"prefix_attention": "auto"}}
    assert create_method(d.name, d.config.to_dict()).config == d.config
    assert create_method("turboquant+snapkv").name == "snapkv+turboquant"  # either order, eviction first


def test_a_single_methods_config_stays_flat() -> None:
    assert create_method("snapkv", '{"budget": 512}').config.to_dict()["budget"] == 512
    with pytest.raises(SparseConfigError, match=r"unknown config field\(s\) \['snapkv'\]"):
        create_method("snapkv", '{"snapkv": {"budget": 512}}')


def test_fingerprint_covers_both_members() -> None:
    fp = {n: create_method(n, c).config.fingerprint() for n, c in [
        ("snapkv+fp8_kv", None), ("snapkv+turboquant", None), ("snapkv+turboquant", '{"turboquant": {"bits": 2}}'),
        ("snapkv+turboquant", '{"snapkv": {"budget": 4096}}'), ("snapkv", None), ("fp8_kv", None)]}
    assert len(set(fp.values())) == len(fp)
    assert create_method("fp8_kv+snapkv").config.fingerprint() == create_method("snapkv+fp8_kv").config.fingerprint()


@pytest.mark.parametrize(("name", "config", "message"), [
    ("snapkv+streamingllm", None, "snapkv and streamingllm both evict"),
    ("fp8_kv+turboquant", None, "fp8_kv and turboquant both own the KV layout"),
    ("quest+fp8_kv", None, "quest is a dynamic selection method"),
    ("snapkv+omnikv", None, "omnikv is a dynamic selection method"),
    ("dense+fp8_kv", None, "dense neither evicts nor owns the KV layout"),
    ("snapkv+nope", None, r"snapkv\+nope: unknown sparse method 'nope'; registered methods: deltakv, dense"),
    ("snapkv+", None, "a composition is two methods joined by"),
    ("snapkv+fp8_kv+kivi", None, "a composition is two methods joined by"),
    ("snapkv+snapkv", None, "names snapkv twice"),
    ("snapkv+fp8_kv", '{"budget": 512}', r"key\(s\) \['budget'\] are not members of the composition"),
    ("snapkv+fp8_kv", '{"snapkv": {}, "kivi": {}}', r"key\(s\) \['kivi'\] are not members"),
    ("snapkv+fp8_kv", '{"snapkv": 512}', r"--sparse-config\['snapkv'\] must be a JSON object"),
    ("snapkv+fp8_kv", '{"snapkv": {"budget": 0}}', "snapkv: field 'budget' must be >= 1"),
    ("snapkv+kivi", '{"kivi": {"bits": 3}}', "kivi: field 'bits' must be 2 or 4"),
])
def test_bad_compositions_name_the_problem(name: str, config: str | None, message: str) -> None:
    with pytest.raises(SparseConfigError, match=message):
        create_method(name, config)


def test_eviction_over_kivi_is_refused_with_the_reason() -> None:
    """KIVI's keys are quantized per 32-token page (one scale per page and channel) in a paged allocator that
    frees whole pages, and its open page is a residual read by logical position: single-token eviction can be
    made correct over neither. Per-token layouts compose."""
    why = served_hooks_problem(create_method("snapkv+kivi"))
    assert why is not None and "per channel over each 32-token page" in why and "frees whole pages" in why
    assert "residual" in why and "fp8_kv, turboquant" in why
    for name in ("snapkv+fp8_kv", "streamingllm+fp8_kv", "snapkv+turboquant", "streamingllm+turboquant"):
        assert served_hooks_problem(create_method(name)) is None, name


def test_a_store_with_pages_or_request_buffers_cannot_serve_eviction_by_default() -> None:
    class Paged(FP8Store):
        page_size = 16

    class Buffered(FP8Store):
        def fixed_bytes(self, geometry):  # type: ignore[no-untyped-def]
            return 1

    assert FP8Store().eviction_problem() is None
    assert "16 tokens per page" in (Paged().eviction_problem() or "")
    assert "per-request buffers" in (Buffered().eviction_problem() or "")


def test_hooks_are_the_eviction_members() -> None:
    alone = create_method("streamingllm", {"sink_tokens": 4, "recent_tokens": 8, "evict_interval": 2})
    composed = create_method("streamingllm+fp8_kv", {"streamingllm": alone.config.to_dict()})
    plans = []
    for m in (alone, composed):
        st = m.new_state("r")
        st.advance(40)
        plans.append(m.on_step_end(st, StepInfo(is_prefill=True, new_tokens=40, decoded_tokens=0,
                                                final_prefill=True)))
    assert isinstance(plans[1], KeepPlan) and torch.equal(plans[0].keep, plans[1].keep)
    assert plans[1].keep.tolist() == [0, 1, 2, 3, *range(32, 40)]
    snap = create_method("snapkv+fp8_kv", {"snapkv": {"budget": 16, "window_size": 4, "sink_tokens": 2}})
    st = RequestState("r")
    st.advance(10)
    assert not snap.wants_observation(st, StepInfo(True, 10, 0, final_prefill=True))  # within the budget
    st.advance(10)
    assert snap.wants_observation(st, StepInfo(True, 10, 0, final_prefill=True))
    # A request's own prune reaches the eviction member (H2O's restored scores lose the pruned entries).
    h2o = create_method("h2o+fp8_kv", {"h2o": {"carry_scores": True}})  # by default no scores are restored
    st = h2o.new_state("r")
    st.set_kept(torch.tensor([0, 2, 3, 5]), logical_len=6)
    h2o.restore_state(st, TreePayload({"h2o_scores": torch.tensor([1.0, 2.0, 3.0, 4.0])}))
    h2o.on_prune(st, torch.tensor([2, 5]))
    assert st.extra["h2o_scores"].tolist() == [1.0, 3.0]


def test_compacted_rows_hold_the_live_slots_in_position_order() -> None:
    """What a store reads under eviction: each batch row's live slots among its first ``lens`` positions,
    packed to the front in position order; its row is the batch index and its length the live count."""
    req_to_token = torch.tensor([[0, 0, 0, 0, 0, 0],
                                 [5, 0, 7, 8, 0, 9],
                                 [1, 2, 3, 4, 6, 0]], dtype=torch.int32)
    rows = compact_rows(req_to_token, torch.tensor([2, 1]), torch.tensor([3, 6]), 6)
    assert rows.lens.tolist() == [3, 4] and rows.indices.tolist() == [0, 1]
    assert rows.table[0, :3].tolist() == [1, 2, 3] and rows.table[1, :4].tolist() == [5, 7, 8, 9]
    empty = compact_rows(req_to_token, torch.tensor([1]), torch.tensor([0]), 0)
    assert empty.lens.tolist() == [0]


def test_store_decode_over_compacted_rows_attends_only_the_kept_tokens() -> None:
    """The contract's reference decode over a compacted table equals attention over the kept slots alone."""
    from sgl_sparse.contract import KVGeometry
    from sgl_sparse.store_reads import attend

    g = KVGeometry(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=1, num_slots=32,
                   dtype=torch.float32, device=torch.device("cpu"))
    store = FP8Store()
    store.allocate(g)
    gen = torch.Generator().manual_seed(0)
    slots = torch.arange(1, 11)
    store.write(0, slots, torch.randn(10, 2, 16, generator=gen), torch.randn(10, 2, 16, generator=gen), slots, False)
    req_to_token = torch.zeros(3, 16, dtype=torch.int32)
    req_to_token[1, :10] = slots.int()
    req_to_token[1, [2, 3, 7]] = 0  # evicted positions
    q = torch.randn(1, 4, 16, generator=gen)
    rows = compact_rows(req_to_token, torch.tensor([1]), torch.tensor([10]), 10)
    out = store.decode(0, q, rows.table, rows.indices, rows.lens, 0.25)
    kept = torch.tensor([1, 2, 5, 6, 7, 9, 10])
    k, v = store.read(0, kept)
    assert torch.allclose(out, attend(q, k, v, 0.25)[0], atol=1e-6)
