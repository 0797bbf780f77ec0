"""Triton kernels (shipped inside the wheel). Import only torch/triton here.

Why not a top-level ``kernels`` package: SGLang 0.5.17 depends on the PyPI package ``kernels``,
which a top-level package of ours would shadow.
"""
