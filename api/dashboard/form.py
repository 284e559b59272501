"""The dashboard's submit form: form fields -> the same ``SweepSpec`` the API validates, and the same
error messages (``api.errors.field_errors`` rendered by the API's own ``detail`` formatter)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import yaml
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

# The API's own formatter of a 422 "detail" line, so the form can never drift from the API's wording.
from api.errors import detail_line, field_errors
from api.spec import SweepSpec
from tuner import load_yaml

FIELDS = (
    "name", "model", "cluster", "nodes", "global_batch", "precision", "sampler", "max_trials",
    "max_device_seconds", "patience", "backend", "extra",
)
DEFAULTS = {
    "name": "sweep", "model": "tiny", "cluster": "cpu-local", "nodes": "", "global_batch": "16",
    "precision": "fp32", "sampler": "surrogate", "max_trials": "20", "max_device_seconds": "", "patience": "",
    "backend": "ray", "extra": "",
}


@dataclass
class FormState:
    values: dict[str, str] = field(default_factory=lambda: dict(DEFAULTS))
    errors: list[str] = field(default_factory=list)
    fields: set[str] = field(default_factory=set)  # dotted spec fields named by an error

    def bad(self, name: str) -> str:
        """CSS class for an input whose field (or a sub-field of it) has an error."""
        return "invalid" if any(f == name or f.startswith(name + ".") for f in self.fields) else ""


def _number(text: str) -> Any:
    """Form text as the JSON number a script would send; anything else stays text, so the error
    message shows the value the user typed."""
    text = text.strip()
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# Limits on the free-text "more spec" field, checked on the parser's event stream before anything is
# built: PyYAML composes nested nodes recursively (a few thousand "[" exhaust the stack), and aliases
# can expand a few lines into exponentially many nodes. A real spec section is a few hundred bytes.
MAX_EXTRA_CHARS = 65_536
MAX_EXTRA_DEPTH = 32
MAX_EXTRA_NODES = 20_000


def load_extra(text: str) -> Any:
    """The YAML (or JSON) value of the "more spec" field, or ValueError naming ``extra`` in one line."""
    if len(text) > MAX_EXTRA_CHARS:
        raise ValueError(f"extra: {len(text):,} characters exceeds the limit of {MAX_EXTRA_CHARS:,}")
    depth = nodes = 0
    try:
        # yaml.parse yields events from a state machine (no recursion); the composer is what recurses.
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent):
                raise ValueError("extra: YAML aliases (*name) are not accepted; write the value out")
            if isinstance(event, yaml.NodeEvent):
                nodes += 1
                if nodes > MAX_EXTRA_NODES:
                    raise ValueError(f"extra: more than {MAX_EXTRA_NODES:,} values, the limit")
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_EXTRA_DEPTH:
                    raise ValueError(f"extra: nested deeper than the limit of {MAX_EXTRA_DEPTH} levels")
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
        return load_yaml(text)  # JSON is YAML; YAML 1.2 floats (25.0e9) as spec files read them
    except yaml.YAMLError as exc:
        raise ValueError(f"extra: not valid YAML/JSON: {str(exc).splitlines()[0]}") from None


def spec_data(values: dict[str, str]) -> dict[str, Any]:
    """The JSON body the form stands for (what ``POST /api/sweeps`` would receive). Raises
    ValueError naming ``extra`` when the free-text part is not a YAML/JSON mapping."""
    cluster: Any = values["cluster"]
    if values.get("nodes", "").strip():
        cluster = {"preset": values["cluster"], "nodes": _number(values["nodes"])}
    search: dict[str, Any] = {"sampler": values["sampler"], "max_trials": _number(values["max_trials"])}
    for opt in ("max_device_seconds", "patience"):
        if values.get(opt, "").strip():
            search[opt] = _number(values[opt])
    data: dict[str, Any] = {
        "name": values["name"],
        "model": values["model"],
        "cluster": cluster,
        "training": {"global_batch": _number(values["global_batch"]), "precision": values["precision"]},
        "search": search,
        "backend": values["backend"].strip(),
    }
    extra = values.get("extra", "").strip()
    if extra:
        parsed = load_extra(extra)
        if not isinstance(parsed, dict):
            raise ValueError(f"extra: must be a mapping of spec fields, got {json.dumps(parsed)[:80]}")
        data = _merge(data, parsed)
    return data


def validate(values: dict[str, str]) -> tuple[SweepSpec | None, FormState]:
    """(spec, state): spec is None when the form is invalid; state carries the messages."""
    state = FormState(values={k: values.get(k, DEFAULTS[k]) for k in FIELDS})
    try:
        data = spec_data(state.values)
    except ValueError as exc:
        state.errors.append(str(exc))
        state.fields.add("extra")
        return None, state
    try:
        return SweepSpec.model_validate(data), state
    except ValidationError as exc:
        # Re-located under "body" exactly as FastAPI reports a request body, then the API's formatter.
        errs = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
        items = field_errors(RequestValidationError(errs, body=data), data)
        state.errors.extend(detail_line(i) for i in items)
        state.fields.update(i["field"] for i in items)
        return None, state
