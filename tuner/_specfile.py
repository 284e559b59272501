"""Problem specs from YAML/TOML/JSON files or mappings: sections ``model``, ``cluster``, ``training``
(and optionally ``space``); other sections (e.g. a sweep's ``search``) are left to their owners.

Errors are SpecError naming the file and the field: ``x.yaml: training.global_batch must be ...``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

try:  # Python >= 3.11
    import tomllib
except ImportError:  # pragma: no cover - Python 3.10
    tomllib = None  # type: ignore[assignment]

from tuner._errors import SpecError
from tuner._presets import cluster_spec, model_spec, training_spec
from tuner._problem import Problem
from tuner._space import SearchSpace

SPEC_SUFFIXES = (".yaml", ".yml", ".toml", ".json")


class SpecLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's float syntax. PyYAML resolves plain scalars by YAML 1.1
    (https://yaml.org/type/float.html), whose floats need a dot and a signed exponent, so
    ``25.0e9`` and ``1e9`` load as the *strings* "25.0e9" and "1e9" and a spec field such as
    ``link_bandwidth: 25.0e9`` fails with a type error. YAML 1.2's core schema
    (https://yaml.org/spec/1.2.2/#1022-tag-resolution) reads them as floats; this resolver adds
    exactly that form. It is tried after the int and YAML 1.1 float resolvers, so ``25`` stays an int
    and everything PyYAML already read as a number is unchanged."""


SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)$"),
    list("-+.0123456789"),
)


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` with YAML 1.2 floats (``SpecLoader``): for every YAML spec text."""
    return yaml.load(text, Loader=SpecLoader)  # noqa: S506 - SpecLoader is a SafeLoader


def read_spec_file(path: str | Path) -> dict[str, Any]:
    """The top-level mapping of a .yaml/.yml/.toml/.json file (SpecError naming the file otherwise)."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in SPEC_SUFFIXES:
        raise SpecError(f"{p}: spec file must end in one of {', '.join(SPEC_SUFFIXES)}, got {suffix or 'no suffix'!r}")
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{p}: spec file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{p}: cannot read spec file ({exc.__class__.__name__}: {exc})") from None
    try:
        if suffix == ".toml":
            if tomllib is None:  # pragma: no cover
                raise SpecError(f"{p}: reading TOML needs Python 3.11 or newer; use YAML or JSON")
            data = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            data = load_yaml(text)
    except ValueError as exc:  # tomllib.TOMLDecodeError
        if isinstance(exc, SpecError):
            raise
        if isinstance(exc, json.JSONDecodeError):
            raise SpecError(f"{p}: invalid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
        raise SpecError(f"{p}: invalid TOML: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise SpecError(f"{p}: invalid YAML: {getattr(exc, 'problem', None) or exc}{where}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{p}: spec file must hold a mapping with sections model, cluster, training; got {type(data).__name__}")
    if "model" in data:  # model: {hf_config: PATH}: the config itself, read relative to this file
        from tuner._hf import inline_hf_config

        try:
            data["model"] = inline_hf_config(data["model"], base_dir=p.parent)
        except SpecError as exc:
            raise SpecError(f"{p}: {exc}") from None
    return data


def problem_from_mapping(data: Mapping[str, Any]) -> Problem:
    """A Problem from a mapping with sections ``model``, ``cluster``, ``training`` (``space`` optional)."""
    if not isinstance(data, Mapping):
        raise SpecError(f"spec must be a mapping with sections model, cluster, training; got {data!r}")
    for section in ("model", "cluster", "training"):
        if section not in data or data[section] is None:
            raise SpecError(f"{section} is required ({'a mapping' if section == 'training' else 'a preset name or a mapping'})")
    model = model_spec(data["model"])
    cluster = cluster_spec(data["cluster"])
    training = training_spec(data["training"], seq_len=model.seq_len)
    space = SearchSpace.from_mapping(data.get("space"))
    return Problem(model=model, cluster=cluster, training=training, space=space)


def load_problem(source: str | Path | Mapping[str, Any]) -> Problem:
    """A Problem from a spec file path or a mapping; file errors are prefixed with the file name."""
    if isinstance(source, Mapping):
        return problem_from_mapping(source)
    data = read_spec_file(source)
    try:
        return problem_from_mapping(data)
    except SpecError as exc:  # keep the subclass (UnknownPresetError, LayoutError)
        raise type(exc)(f"{source}: {exc}") from None
