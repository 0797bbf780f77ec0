"""Method registry: name -> method class. Adding a method = one file + one ``register_method`` line."""

from __future__ import annotations

import importlib
import os
from typing import Any

from sgl_sparse.compose import create_composed, is_composed
from sgl_sparse.config import build_config, load_config_source
from sgl_sparse.contract import SparseMethod
from sgl_sparse.errors import SparseConfigError

_METHODS: dict[str, type[SparseMethod[Any]]] = {}


def register_method(cls: type[SparseMethod[Any]]) -> type[SparseMethod[Any]]:
    """Class decorator. Idempotent for the same class; a different class under a taken name is a bug."""
    existing = _METHODS.get(cls.name)
    if existing is not None and existing is not cls:
        raise ValueError(f"sparse method {cls.name!r} is already registered by {existing.__qualname__}")
    if cls.config_cls.method_name != cls.name:
        raise ValueError(f"{cls.__qualname__}: config_cls.method_name must be {cls.name!r}")
    _METHODS[cls.name] = cls
    return cls


def registered_methods() -> list[str]:
    _load_builtin()
    return sorted(_METHODS)


def get_method_class(name: str) -> type[SparseMethod[Any]]:
    _load_builtin()
    try:
        return _METHODS[name]
    except KeyError:
        raise SparseConfigError(
            f"unknown sparse method {name!r}; registered methods: {', '.join(sorted(_METHODS))}"
        ) from None


def create_method(name: str, config: str | dict[str, Any] | None = None) -> SparseMethod[Any]:
    """Build a ready method from a name and a config (dict, JSON text, JSON file path or None). A name of two
    methods joined by ``+`` is a composition (:mod:`sgl_sparse.compose`), its config keyed by member name."""
    fields = config if isinstance(config, dict) else load_config_source(config)
    if is_composed(name):
        return create_composed(name, fields, get_method_class)
    cls = get_method_class(name)
    return cls(build_config(cls.config_cls, fields))


# Comma-separated modules that register more methods on import (a method of your own: one file with a
# ``@register_method`` class, importable in the server's environment). Read by every server process.
METHOD_MODULES_ENV = "SGLSPARSE_METHOD_MODULES"


def _load_builtin() -> None:
    import sgl_sparse.methods  # noqa: F401  (registers the built-in methods on import)

    for module in filter(None, (m.strip() for m in os.environ.get(METHOD_MODULES_ENV, "").split(","))):
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise SparseConfigError(f"{METHOD_MODULES_ENV}: cannot import {module!r} ({e})") from e
