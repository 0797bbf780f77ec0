"""Method configuration: the base dataclass every method config derives from, and parsing.

A method's hyper-parameters are the fields of one ``@dataclass`` (defaults = the paper's). They
arrive as ``--sparse-config`` (a JSON object, or a path to a JSON file) and are validated here, once,
in the launcher, so that a bad value fails before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

from sgl_sparse.errors import SparseConfigError


@dataclass(frozen=True)
class MethodConfig:
    """Base of every method config. Subclasses add fields and override :meth:`validate`.

    ``validate`` raises :class:`SparseConfigError` naming the field; it runs in ``__post_init__``
    so an invalid config object can never exist.
    """

    method_name: ClassVar[str] = ""

    def __post_init__(self) -> None:
        self._check_types()
        self.validate()

    def validate(self) -> None:
        """Check ranges and cross-field constraints. Raise :class:`SparseConfigError`."""

    def _check_types(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            expected = hints[f.name]
            value = getattr(self, f.name)
            if expected is float and isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, f.name, float(value))
                continue
            if isinstance(expected, type) and (
                not isinstance(value, expected) or (expected is int and isinstance(value, bool))
            ):
                raise SparseConfigError(
                    f"{self.method_name}: field {f.name!r} must be {expected.__name__}, "
                    f"got {type(value).__name__} {value!r}"
                )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        """Stable digest of (method, fields). Requests under different fingerprints never share
        KV in the prefix tree: compacted KV of one config is not valid input for another."""
        payload = json.dumps({"method": self.method_name, **self.to_dict()}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def require(self, cond: bool, field: str, why: str) -> None:
        """Helper for :meth:`validate`: raise a field-naming error unless ``cond``."""
        if not cond:
            raise SparseConfigError(f"{self.method_name}: field {field!r} {why} (got {getattr(self, field)!r})")


def load_config_source(source: str | None) -> dict[str, Any]:
    """Parse ``--sparse-config``: empty, a JSON object literal, or a path to a JSON file."""
    if source is None or source.strip() == "":
        return {}
    text = source
    if not source.lstrip().startswith("{"):
        if not os.path.isfile(source):
            raise SparseConfigError(f"--sparse-config: {source!r} is neither a JSON object nor an existing file")
        with open(source, encoding="utf-8") as f:
            text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise SparseConfigError(f"--sparse-config: invalid JSON ({e})") from e
    if not isinstance(data, dict):
        raise SparseConfigError(f"--sparse-config: expected a JSON object, got {type(data).__name__}")
    return data


def build_config(cls: type[MethodConfig], fields: dict[str, Any]) -> MethodConfig:
    """Instantiate ``cls`` from a dict, rejecting unknown fields with the list of known ones."""
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise SparseConfigError(
            f"{cls.method_name}: unknown config field(s) {unknown}; known fields: {known or 'none'}"
        )
    return cls(**fields)
