"""Spec files: YAML/TOML/JSON problems, and errors that name the file and the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tuner import SearchSpace, SpecError, UnknownPresetError, load_problem, read_spec_file

YAML = """\
name: ignored-by-the-tuner
model: llama3-8b
cluster: {preset: h100-sxm, nodes: 2}
training:
  global_batch_tokens: 1048576
  precision: bf16
space:
  tp: [1, 2, 4, 8]
  zero: [1, 3]
search: {sampler: tpe}
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_yaml_toml_json_and_mapping_agree(tmp_path: Path) -> None:
    from_yaml = load_problem(write(tmp_path, "p.yaml", YAML))
    assert from_yaml.model.name == "llama3-8b" and from_yaml.cluster.devices == 16
    assert from_yaml.training.global_batch == 128  # 1M tokens / 8192
    assert from_yaml.space == SearchSpace(tp=(1, 2, 4, 8), zero=(1, 3))
    toml = """model = "llama3-8b"\nspace = { tp = [1, 2, 4, 8], zero = [1, 3] }\n
[cluster]\npreset = "h100-sxm"\nnodes = 2\n[training]\nglobal_batch_tokens = 1048576\n"""
    assert load_problem(write(tmp_path, "p.toml", toml)) == from_yaml
    data = read_spec_file(tmp_path / "p.yaml")
    assert load_problem(write(tmp_path, "p.json", json.dumps(data))) == from_yaml
    assert load_problem(data) == from_yaml
    assert load_problem(write(tmp_path, "p.yml", YAML)) == from_yaml


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (YAML.replace("global_batch_tokens: 1048576", "global_batch: 0"),
         "x.yaml: training.global_batch must be a positive integer, got 0"),
        (YAML.replace("nodes: 2", "nodes: -1"), "x.yaml: cluster.nodes must be a positive integer, got -1"),
        (YAML.replace("nodes: 2", "nodes: 1.5"), r"x.yaml: cluster.nodes must be a positive integer, got 1.5"),
        (YAML.replace("global_batch_tokens: 1048576", "global_batch_tokens: 1000"),
         "x.yaml: training.global_batch_tokens=1000 is not a multiple of model.seq_len=8192"),
        (YAML.replace("model: llama3-8b", "model: {preset: llama3-8b, heads: 30}"),
         "x.yaml: model.heads=30 does not divide model.hidden=4096"),
        (YAML.replace("model: llama3-8b", "model: {preset: llama3-8b, layerz: 3}"),
         "x.yaml: model.layerz is not a known field"),
        (YAML.replace("tp: [1, 2, 4, 8]", "tp: [0]"), r"x.yaml: space.tp values must be integers >= 1, got 0"),
        (YAML.replace("precision: bf16", "precision: fp8"), "x.yaml: training.precision must be one of"),
        ("model: llama3-8b\ncluster: h100-sxm\n", "x.yaml: training is required"),
        ("- 1\n- 2\n", "x.yaml: spec file must hold a mapping"),
        ("model: [unclosed\n", r"x.yaml: invalid YAML: .*\(line \d+, column \d+\)"),
    ],
)
def test_errors_name_file_field_and_value(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, "x.yaml", text)
    with pytest.raises(SpecError, match=message) as info:
        load_problem(path)
    assert "\n" not in str(info.value)


def test_file_level_errors(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="nope.yaml: spec file not found"):
        load_problem(tmp_path / "nope.yaml")
    with pytest.raises(SpecError, match=r"x.txt: spec file must end in one of .yaml, .yml, .toml, .json"):
        load_problem(write(tmp_path, "x.txt", YAML))
    with pytest.raises(SpecError, match=r"x.json: invalid JSON: .*line 1"):
        load_problem(write(tmp_path, "x.json", "{model: 1"))
    with pytest.raises(SpecError, match="x.toml: invalid TOML"):
        load_problem(write(tmp_path, "x.toml", "model = \n"))
    with pytest.raises(UnknownPresetError, match=r"x.yaml: model.preset='gpt5' is not a known preset \(known: "):
        load_problem(write(tmp_path, "x.yaml", YAML.replace("llama3-8b", "gpt5")))


def test_yaml_numbers_with_an_exponent_are_floats(tmp_path: Path) -> None:
    """YAML 1.1 (PyYAML's resolver) reads ``25.0e9`` and ``1e9`` as strings; specs read them as YAML 1.2
    does, as floats, and leave ints, other floats and strings as they were."""
    path = tmp_path / "spec.yaml"
    path.write_text("model: tiny\ncluster:\n  preset: cpu-local\n  inter_node_bandwidth: 25.0e9\n  peak_flops: 1e11\n"
                    "training: {global_batch: 8, lr: 3e-4}\nsearch: {max_trials: 10, note: v1e9, other: 1.5}\n")
    data = read_spec_file(path)
    assert data["cluster"]["inter_node_bandwidth"] == 25.0e9 and isinstance(data["cluster"]["inter_node_bandwidth"], float)
    assert data["cluster"]["peak_flops"] == 1e11 and data["training"]["lr"] == 3e-4
    assert data["search"] == {"max_trials": 10, "note": "v1e9", "other": 1.5}
    problem = load_problem(path)
    assert (problem.cluster.peak_flops, problem.cluster.inter_node_bandwidth) == (1e11, 25.0e9)
