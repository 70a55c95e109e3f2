"""docs/manifest.schema.json describes mirrorsd.json exactly: a fresh export validates, an unknown key fails both
the schema and load_manifest, and the schema's properties are the manifest dataclasses' fields, no more, no less."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from mirrorsd.errors import ManifestError
from mirrorsd.manifest import (GraphSpec, KVSpec, Manifest, ModelInfo, TensorSpec, TokenizerInfo, VocabSubsetInfo,
                               load_manifest)
from mirrorsd.names import MANIFEST_FILE

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed (pip install -e '.[dev]')")

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "docs" / "manifest.schema.json"
DEFS = {Manifest: None, ModelInfo: "model_info", GraphSpec: "graph", KVSpec: "kv", TensorSpec: "tensor",
        VocabSubsetInfo: "vocab_subset"}


@pytest.fixture(scope="module")
def validator():
    schema = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.fixture
def manifest_data(exported) -> dict:
    return json.loads((exported("llama") / MANIFEST_FILE).read_text(encoding="utf-8"))


def test_fresh_export_validates(validator, manifest_data):
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(manifest_data)]
    assert not errors, f"update docs/manifest.schema.json to the manifest: {errors}"


@pytest.mark.parametrize("where", [(), ("graphs", "suffix", "kv"), ("tokenizer",), ("graphs", "prefix", "inputs", 0)])
def test_unknown_key_fails_schema_and_loader(where, validator, manifest_data, tmp_path):
    node = manifest_data
    for key in where:
        node = node[key]
    node["surprise"] = 1
    assert not validator.is_valid(manifest_data)
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(manifest_data), encoding="utf-8")
    with pytest.raises(ManifestError, match="Unknown key"):
        load_manifest(tmp_path)


@pytest.mark.parametrize("path, value", [
    (("schema_version",), 2),
    (("graphs", "draft", "file"), "../outside.onnx"),
    (("graphs", "prefix", "kv", "past_key"), "past_key_values.key"),
    (("target", "num_layers"), "4"),
])
def test_bad_values_fail_schema(path, value, validator, manifest_data):
    node = manifest_data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert not validator.is_valid(manifest_data)


@pytest.mark.parametrize("cls", [Manifest, ModelInfo, GraphSpec, KVSpec, TensorSpec, TokenizerInfo, VocabSubsetInfo])
def test_schema_properties_are_the_dataclass_fields(cls, validator):
    schema = validator.schema
    if cls is TokenizerInfo:
        node = schema["properties"]["tokenizer"]
    else:
        node = schema if DEFS[cls] is None else schema["$defs"][DEFS[cls]]
    fields = {f.name for f in dataclasses.fields(cls)}
    assert set(node["properties"]) == fields
    assert node["additionalProperties"] is False
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    assert set(node["required"]) == required


def test_schema_export_options_are_the_export_options(validator):
    from mirrorsd.export.pipeline import RUN_ONLY, ExportOptions

    node = validator.schema["properties"]["export_options"]
    written = {f.name for f in dataclasses.fields(ExportOptions)} - set(RUN_ONLY)  # as _write_folder does
    extra = {"requantized_from", "rounding", "exit_layer_choice", "unpacked_from"}  # + mirrorsd quantize, + the
    # exit-layer choice, + mirrorsd unpack
    assert set(node["properties"]) - extra == written == set(node["required"])
