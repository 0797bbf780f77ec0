"""Config parsing/validation and the method registry (no server)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from sgl_sparse import SparseConfigError, create_method, get_method_class, registered_methods
from sgl_sparse.config import MethodConfig, build_config, load_config_source
from sgl_sparse.contract import Family, SparseMethod
from sgl_sparse.registry import register_method


@dataclass(frozen=True)
class _ToyConfig(MethodConfig):
    method_name = "toy_for_tests"
    budget: int = 16
    ratio: float = 0.5
    pooling: str = "avgpool"

    def validate(self) -> None:
        self.require(self.budget > 0, "budget", "must be > 0")
        self.require(0.0 < self.ratio <= 1.0, "ratio", "must be in (0, 1]")
        self.require(self.pooling in ("avgpool", "maxpool"), "pooling", "must be 'avgpool' or 'maxpool'")


class _Toy(SparseMethod[_ToyConfig]):
    name = "toy_for_tests"
    family = Family.EVICTION
    config_cls = _ToyConfig


def test_dense_is_registered_and_builds() -> None:
    assert "dense" in registered_methods()
    m = create_method("dense")
    assert m.name == "dense" and m.family is Family.DENSE
    assert m.config.to_dict() == {}


def test_unknown_method_names_registered_ones() -> None:
    with pytest.raises(SparseConfigError, match=r"unknown sparse method 'nope'; registered methods: .*dense"):
        get_method_class("nope")


def test_unknown_field_lists_known_fields() -> None:
    with pytest.raises(SparseConfigError, match=r"unknown config field\(s\) \['budgte'\]; known fields: "
                                                r"\['budget', 'ratio', 'pooling'\]"):
        build_config(_ToyConfig, {"budgte": 3})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"budget": -1}, r"field 'budget' must be > 0 \(got -1\)"),
        ({"ratio": 1.5}, r"field 'ratio' must be in \(0, 1\]"),
        ({"pooling": "median"}, r"field 'pooling' must be 'avgpool' or 'maxpool'"),
        ({"budget": "8"}, r"field 'budget' must be int, got str"),
        ({"budget": True}, r"field 'budget' must be int, got bool"),
    ],
)
def test_out_of_range_and_wrong_type(fields: dict, message: str) -> None:
    with pytest.raises(SparseConfigError, match=message):
        build_config(_ToyConfig, fields)


def test_int_accepted_for_float_field() -> None:
    cfg = build_config(_ToyConfig, {"ratio": 1})
    assert cfg.ratio == 1.0 and isinstance(cfg.ratio, float)


def test_config_source_json_file_and_errors(tmp_path) -> None:
    assert load_config_source(None) == {} and load_config_source(" ") == {}
    assert load_config_source('{"budget": 4}') == {"budget": 4}
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"budget": 5}))
    assert load_config_source(str(path)) == {"budget": 5}
    with pytest.raises(SparseConfigError, match="invalid JSON"):
        load_config_source("{budget: 4}")
    with pytest.raises(SparseConfigError, match="neither a JSON object nor an existing file"):
        load_config_source(str(tmp_path / "missing.json"))
    path.write_text("[1, 2]")
    with pytest.raises(SparseConfigError, match="expected a JSON object, got list"):
        load_config_source(str(path))


def test_fingerprint_separates_configs_and_methods() -> None:
    a, b = _ToyConfig(budget=16), _ToyConfig(budget=32)
    assert a.fingerprint() == _ToyConfig(budget=16).fingerprint()
    assert a.fingerprint() != b.fingerprint()
    assert a.fingerprint() != create_method("dense").config.fingerprint()


def test_register_is_idempotent_and_rejects_name_clash() -> None:
    register_method(_Toy)
    register_method(_Toy)  # same class again: fine
    assert get_method_class("toy_for_tests") is _Toy

    class _Other(_Toy):
        pass

    with pytest.raises(ValueError, match="already registered"):
        register_method(_Other)


def test_method_rejects_foreign_config() -> None:
    with pytest.raises(TypeError, match="expects _ToyConfig"):
        _Toy(create_method("dense").config)  # type: ignore[arg-type]
