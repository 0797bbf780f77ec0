"""Quantization family: methods that own the KV pool's layout (:class:`sgl_sparse.contract.KVStore`)."""
