"""Prefix-Cache Pruning (docs/prefix-cache-pruning.md), SGLang-free: ``spec`` (what a prune asks for, parsed and
checked), ``keep`` (the scored keep: which of the ranges' positions keep their KV), ``tree_ops`` (the operation on
the Chain Cache tree, through its public API) and ``body`` (the route's request body and answers). The SGLang
plumbing of the route is ``sgl_sparse/integration/prune_route.py``; a request's own prune runs in its final prefill
(``sgl_sparse/integration/step.py``)."""
