"""Compression family: methods that store a smaller form of each token's K/V (:class:`sgl_sparse.contract.KVStore`)."""
