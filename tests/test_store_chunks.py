"""Where a prompt's prefill chunks end must not change what its queries read (other traffic moves the ends: SGLang's
chunked prefill shares one token budget among a step's requests).

``store_extend`` (the server's extend over a method-owned layout) runs here on each real store, over the same
prompt cut into chunks in different places, and every query's output must be the same. The reference is plain
torch written here: a per-token layout's query reads every key as stored (written, then read back), the query's
own included; KIVI's reads the whole pages before its own as stored and its own page at full precision, or as
stored when it is the page's last token (what a decode step at its position reads). Before
``KVStore.round_trip`` a chunk read its own keys at full precision and earlier chunks' as stored, which fails here.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from sgl_sparse.contract import KVGeometry, KVStore
from sgl_sparse.integration.store_attention import (
    causal_attention_torch,
    extend_lists,
    merge,
    open_pages,
    open_pages_attention_torch,
    prefix_attention_torch,
    store_extend,
)
from sgl_sparse.registry import create_method

HKV, GROUP_Q, D, PAGE = 2, 2, 32, 8
SCALE = 1 / math.sqrt(D)
T = 70  # the prompt's tokens
STORES = [("fp8_kv", {}), ("turboquant", {}), ("turboquant", {"bits": 2, "qjl": True}),
          ("kivi", {"group_size": PAGE}), ("kivi", {"group_size": PAGE, "bits": 2})]


def _store(name: str, cfg: dict) -> KVStore:
    store = create_method(name, cfg).store
    assert store is not None
    store.allocate(KVGeometry(num_layers=1, num_q_heads=HKV * GROUP_Q, num_kv_heads=HKV, head_dim=D,
                              page_size=store.page_size, num_slots=512, dtype=torch.float32,
                              device=torch.device("cpu"), max_requests=4))
    return store


def _layer() -> SimpleNamespace:
    return SimpleNamespace(layer_id=0, tp_q_head_num=HKV * GROUP_Q, tp_k_head_num=HKV, tp_v_head_num=HKV,
                           qk_head_dim=D, v_head_dim=D, scaling=SCALE, is_cross_attention=False,
                           sliding_window_size=-1, attn_type="DECODER", logit_cap=0, k_scale_float=None,
                           v_scale_float=None)


def _prompt(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(T, HKV, D, generator=gen)
    k[:, :, 3] *= 8  # an outlier channel, as real keys have (KIVI's per-channel groups exist for it)
    return torch.randn(T, HKV * GROUP_Q, D, generator=gen), k, torch.randn(T, HKV, D, generator=gen)


def _serve(store: KVStore, prompts: list[tuple[torch.Tensor, ...]], cuts: list[list[int]]) -> list[torch.Tensor]:
    """Prefill each prompt (request row i, slots from page 1 + 16 i) through ``store_extend`` in steps: step s runs
    chunk s of every request that has one, ``cuts[i]`` being request i's chunk ends. -> each prompt's outputs."""
    backend = SimpleNamespace(token_to_kv_pool=SimpleNamespace(store=store))
    r2t = torch.zeros(len(prompts), 128, dtype=torch.int64)
    for i in range(len(prompts)):
        r2t[i, :T] = torch.arange(T) + PAGE * (1 + 16 * i)
    outs = [torch.empty(T, HKV * GROUP_Q * D) for _ in prompts]
    done = [0] * len(prompts)
    for step in range(max(len(c) for c in cuts)):
        batch = [i for i, c in enumerate(cuts) if step < len(c)]
        pre = [done[i] for i in batch]
        new = [cuts[i][step] - done[i] for i in batch]
        fb = SimpleNamespace(extend_seq_lens_cpu=new, extend_seq_lens=torch.tensor(new),
                             req_pool_indices=torch.tensor(batch), extend_prefix_lens=torch.tensor(pre),
                             extend_prefix_lens_cpu=pre,
                             out_cache_loc=torch.cat([r2t[i, p:p + n] for i, p, n in zip(batch, pre, new)]),
                             positions=torch.cat([torch.arange(p, p + n) for p, n in zip(pre, new)]))
        lists = extend_lists(fb, r2t, dequantize=store.dequantize_prefix, group=store.page_size)

        def dense(q3, kp, vp, layer, lists):  # type: ignore[no-untyped-def]
            return prefix_attention_torch(q3, kp, vp, lists.extend_lens, lists.dense.lens, SCALE)

        def own(q3, kb, vb, layer, lists):  # type: ignore[no-untyped-def]
            return open_pages_attention_torch(q3, kb, vb, lists.open, lists.extend_lens, SCALE)

        parts = [[t[p:p + n] for t in prompts[i]] for i, p, n in zip(batch, pre, new)]
        q, k, v = (torch.cat([part[j] for part in parts]) for j in range(3))
        o = store_extend(backend, q.flatten(1), k.flatten(1), v.flatten(1), _layer(), fb, lists, True,
                         lambda q3, k3, v3, layer, lists: causal_attention_torch(q3, k3, v3, lists.extend_lens, SCALE),
                         merge, dense, own)
        at = 0
        for i, p, n in zip(batch, pre, new):
            outs[i][p:p + n] = o[at:at + n]
            at += n
            done[i] = p + n
    return outs


def _reference(name: str, cfg: dict, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain torch: each query over the keys as it must read them (what the layout stores, read back)."""
    store = _store(name, cfg)
    whole = T // PAGE * PAGE if store.page_size > 1 else T
    slots = torch.arange(whole) + PAGE
    store.write(0, slots, k[:whole], v[:whole], torch.zeros(whole, dtype=torch.int64), decode=False)
    ks, vs = store.read(0, slots)
    out = torch.empty(T, HKV * GROUP_Q, D)
    for t in range(T):
        if store.page_size == 1:
            kt, vt = ks[:t + 1], vs[:t + 1]
        elif t % PAGE == PAGE - 1:  # the page's last token: the page as stored (decode quantizes it on writing)
            kt, vt = ks[:t + 1], vs[:t + 1]
        else:
            own = t // PAGE * PAGE
            kt, vt = torch.cat([ks[:own], k[own:t + 1]]), torch.cat([vs[:own], v[own:t + 1]])
        logits = torch.einsum("hd,shd->hs", q[t], kt.repeat_interleave(GROUP_Q, dim=1)) * SCALE
        if cfg.get("qjl"):  # the store's own scores add QJL's estimate of q . (k - k_mse)
            logits = store._scores(0, q[t:t + 1], slots[:t + 1], SCALE)[:, 0]
        out[t] = torch.einsum("hs,shd->hd", torch.softmax(logits, dim=-1), vt.repeat_interleave(GROUP_Q, dim=1))
    return out.flatten(1)


# Each store with each prefix read (a dequantized prefix read lacks QJL's term: the config refuses it with qjl).
PREFIX_READS = [(n, c, mode) for n, c in STORES for mode in ("kernel", "dequantize") if not (c.get("qjl") and
                                                                                           mode == "dequantize")]


@pytest.mark.parametrize(("name", "cfg", "prefix_attention"), PREFIX_READS, ids=lambda x: str(x))
def test_a_prompt_reads_the_same_keys_wherever_its_chunks_end(name: str, cfg: dict, prefix_attention: str) -> None:
    prompts = [_prompt(1), _prompt(2)]
    reference = [_reference(name, cfg, *p) for p in prompts]
    # Alone in one chunk; cut off a page (KIVI: mid-page, and at a page end); beside another request's chunks.
    for cuts in ([[T], [T]], [[13, 29, T], [PAGE * 3, T]], [[1, 2, 45, T], [PAGE * 2 + 1, PAGE * 5 - 1, T]]):
        store = _store(name, {**cfg, "prefix_attention": prefix_attention})
        got = _serve(store, prompts, cuts)
        for out, want in zip(got, reference):
            torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


def test_the_paged_prefill_tables_read_what_the_torch_path_reads() -> None:
    """``OpenPages``' page tables (what FlashInfer's paged prefill gets on the GPU), followed in plain torch as a paged
    prefill reads them (each request: its pages in table order, the last one ``last_page_len`` long, causal from
    the bottom right), give the torch path's output."""
    gen = torch.Generator().manual_seed(5)
    pre, new = [13, 0, 24], [30, 9, 3]
    pages = open_pages(torch.tensor([2, 0, 1]), pre, new, PAGE)
    n = pages.pages * PAGE
    kf, vf, kr, vr = (torch.randn(n, HKV, D, generator=gen) for _ in range(4))
    q = torch.randn(sum(new), HKV * GROUP_Q, D, generator=gen)
    want, want_lse = open_pages_attention_torch(q, torch.cat([kr, kf]), torch.cat([vr, vf]), pages, new, SCALE)
    k_cache = torch.cat([kr, kf]).view(2 * pages.pages, PAGE, HKV, D)
    v_cache = torch.cat([vr, vf]).view(2 * pages.pages, PAGE, HKV, D)
    qo, kvp, idx, last = (t.tolist() for t in (pages.qo_indptr, pages.kv_indptr, pages.kv_indices,
                                               pages.last_page_len))
    got = torch.empty_like(q)
    for r in range(len(qo) - 1):
        ids = idx[kvp[r]:kvp[r + 1]]
        ks = torch.cat([k_cache[p] for p in ids])[:(len(ids) - 1) * PAGE + last[r]]
        vs = torch.cat([v_cache[p] for p in ids])[:(len(ids) - 1) * PAGE + last[r]]
        m = qo[r + 1] - qo[r]
        got[qo[r]:qo[r + 1]] = causal_attention_torch(
            torch.cat([q.new_zeros(ks.shape[0] - m, *q.shape[1:]), q[qo[r]:qo[r + 1]]]), ks, vs, [ks.shape[0]],
            SCALE)[0][-m:]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(want_lse).all()


@pytest.mark.parametrize(("name", "cfg"), STORES, ids=lambda x: str(x))
def test_a_decoded_token_reads_what_the_same_token_prefilled_reads(name: str, cfg: dict) -> None:
    """The prompt's first 21 tokens prefilled, the rest decoded one at a time through ``store_decode`` (the store's
    decode path, which writes the token first): each decoded token's output is the reference's, the one a prefill
    gives it (so a token reads the same whether SGLang decodes it or runs it as a one-token extend)."""
    from sgl_sparse.integration.store_attention import decode_rows, store_decode

    q, k, v = _prompt(3)
    store = _store(name, cfg)
    head = 21
    _serve(store, [(q[:head], k[:head], v[:head])], [[head]])
    backend = SimpleNamespace(token_to_kv_pool=SimpleNamespace(store=store))
    r2t = torch.zeros(1, 128, dtype=torch.int64)
    r2t[0, :T] = torch.arange(T) + PAGE
    want = _reference(name, cfg, q, k, v)
    for t in range(head, T):
        fb = SimpleNamespace(out_cache_loc=r2t[0, t:t + 1], req_pool_indices=torch.tensor([0]),
                             seq_lens=torch.tensor([t + 1]), positions=torch.tensor([t]))
        o = store_decode(backend, q[t:t + 1].flatten(1), k[t:t + 1].flatten(1), v[t:t + 1].flatten(1), _layer(), fb,
                         decode_rows(fb, r2t), True)
        torch.testing.assert_close(o[0], want[t], atol=2e-5, rtol=2e-5)
