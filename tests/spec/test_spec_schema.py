"""specs/schema.json: derived from the dataclasses, checked in, and agreeing with the loader."""

from __future__ import annotations

import dataclasses
import json
import typing

import jsonschema
import pytest

from graphgen.modelspec import model as m
from graphgen.modelspec.errors import SpecError
from graphgen.modelspec.loader import load_yaml_data, parse_spec_text
from graphgen.modelspec.schema import schema_text, spec_json_schema
from support.paths import REPO

SHIPPED = sorted((REPO / "specs").glob("*.yaml"))


@pytest.fixture(scope="module")
def validator():
    schema = spec_json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_schema_on_disk_is_current():
    assert (REPO / "specs" / "schema.json").read_text() == schema_text(), \
        "regenerate: python -c 'from graphgen.modelspec.schema import schema_text; print(schema_text(), end=\"\")' > specs/schema.json"


def test_schema_is_deterministic():
    assert schema_text() == schema_text()
    assert json.loads(schema_text()) == spec_json_schema()


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_specs_validate(validator, path):
    data = load_yaml_data(path.read_text(), str(path))
    errors = [e.message for e in validator.iter_errors(data)]
    assert errors == []


def test_every_field_is_described():
    schema = spec_json_schema()
    for cls in (m.ModelSpec, m.Qwen3Dims, m.DeepseekV3Dims, m.RopeScaling, m.KVCacheLayout, m.PoolWrite,
                m.Variant, m.Targets, m.NpuTarget):
        node = schema if cls is m.ModelSpec else schema["$defs"][cls.__name__]
        assert node["additionalProperties"] is False
        assert set(node["properties"]) == {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        assert set(node.get("required", [])) == required
        for f in dataclasses.fields(cls):
            prop = node["properties"][f.name]
            assert prop["description"] == f.metadata["doc"]
            if f.default is not dataclasses.MISSING and not dataclasses.is_dataclass(f.default):
                want = list(f.default) if isinstance(f.default, tuple) else f.default
                assert prop["default"] == want
            tp = typing.get_type_hints(cls, globalns=vars(m))[f.name]
            if typing.get_origin(tp) is typing.Literal:
                assert prop["enum"] == list(typing.get_args(tp))


def _base():
    return load_yaml_data((REPO / "specs" / "tiny_deepseek_v3_npu.yaml").read_text())  # declares every target


def _mutations():
    def set_(path, value):
        def apply(d):
            *parents, leaf = path
            for p in parents:
                d = d[p]
            d[leaf] = value
        return apply

    def drop(path):
        def apply(d):
            *parents, leaf = path
            for p in parents:
                d = d[p]
            del d[leaf]
        return apply

    return {
        "unknown_key": set_(("dims", "hiden_size"), 64),
        "missing_required": drop(("dims", "kv_lora_rank")),
        "wrong_type": set_(("dims", "hidden_size"), "64"),
        "enum": set_(("kv_cache", "dtype"), "fp32"),
        "name_injection": set_(("name",), "x; import os"),
        "variant_name": set_(("variants", "bad-name"), {"phase": "decode"}),
        "keyword_name": set_(("name",), "class"),
        "below_minimum": set_(("dims", "num_hidden_layers"), 0),
        "dims_of_other_family": set_(("family",), "qwen3_dense"),
        "null_target": set_(("targets", "cpu"), None),
        "no_target": set_(("targets",), {}),
        "unknown_feature": set_(("features",), ["prefix_cache", "context_parallel"]),
        "duplicate_feature": set_(("features",), ["prefix_cache", "prefix_cache"]),
        "empty_compile_modes": set_(("targets", "npu", "compile_modes"), []),
        "yarn_type": set_(("dims", "rope_scaling"), {"type": "linear", "factor": 2.0,
                                                     "original_max_position_embeddings": 4096}),
    }


@pytest.mark.parametrize("case", list(_mutations()))
def test_malformed_rejected_by_schema_and_loader(validator, case):
    data = _base()
    _mutations()[case](data)
    assert list(validator.iter_errors(data)), f"schema accepted {case}"
    with pytest.raises(SpecError):
        parse_spec_text(json.dumps(data), f"{case}.yaml")  # JSON is YAML
