"""Exceptions raised by sgl_sparse. Kept free of SGLang imports so methods can use them."""


class SparseConfigError(ValueError):
    """A method name or method config field is invalid.

    The message names the offending method or field and what is allowed, so that the launcher
    can show it as an argparse error and the HTTP layer as a 4xx.
    """
