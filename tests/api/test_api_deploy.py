"""The docker-compose deployment: its wiring checked by parsing, and the whole file validated the way
Docker Compose validates it (variables interpolated, then the Compose Specification's JSON schema) with
`jsonschema` and the schema vendored in tests/compose_spec/, so the check runs without a compose CLI."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import yaml

from api.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_SCHEMA = ROOT / "tests" / "compose_spec" / "compose-spec.json"  # source and licence: README.md there
ENV = {"POSTGRES_PASSWORD": "pw-for-config", "MESHTUNE_API_TOKENS": "alice:tok"}

# The Compose Specification's interpolation (compose-spec 12-interpolation.md): $$ is a literal $;
# $NAME and ${NAME} substitute; ${NAME:-d} / ${NAME-d} default when unset-or-empty / unset; ${NAME:?e} /
# ${NAME?e} are errors then. Values only, never keys. (Nesting inside a default is not used here.)
_VARIABLE = re.compile(r"\$(?:(?P<escaped>\$)|(?P<bare>[_a-zA-Z][_a-zA-Z0-9]*)|"
                       r"\{(?P<name>[_a-zA-Z][_a-zA-Z0-9]*)(?:(?P<op>:?[-?])(?P<arg>[^}$]*))?\})")


class MissingVariableError(ValueError):
    pass


def interpolate(node: object, env: dict[str, str]) -> object:
    if isinstance(node, dict):
        return {k: interpolate(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate(v, env) for v in node]
    if not isinstance(node, str):
        return node

    def one(m: re.Match) -> str:
        if m["escaped"]:
            return "$"
        name = m["bare"] or m["name"]
        value, op = env.get(name), m["op"] or ""
        missing = value is None or (op.startswith(":") and value == "")
        if missing and op.endswith("?"):
            raise MissingVariableError(f"required variable {name} is missing a value: {m['arg']}")
        if missing and op.endswith("-"):
            return m["arg"]
        return value or ""

    rest = _VARIABLE.sub("", node.replace("$$", ""))
    assert "$" not in rest, f"not a Compose variable: {node!r}"  # a typo would be passed through literally
    return _VARIABLE.sub(one, node)


@pytest.fixture(scope="module")
def compose_validator():
    import jsonschema  # a dependency of ray, which meshtune requires

    schema = json.loads(COMPOSE_SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _errors(validator, document: dict) -> list[str]:
    return sorted(f"{e.json_path}: {e.message}" for e in validator.iter_errors(document))


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def test_compose_has_every_service_wired_in_order(services: dict) -> None:
    assert set(services) == {"postgres", "migrate", "coordinator", "ray-head", "ray-worker"}
    pg = services["postgres"]
    assert "pg_isready" in " ".join(pg["healthcheck"]["test"])
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["migrate"]["command"] == ["meshtune", "serve", "--migrate-only"]
    assert services["migrate"]["restart"] == "no"
    coord = services["coordinator"]
    assert coord["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert coord["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert coord["depends_on"]["ray-head"]["condition"] == "service_healthy"
    assert "/healthz" in " ".join(coord["healthcheck"]["test"])
    assert "meshtune serve" in " ".join(coord["command"]) and "--no-migrate" in " ".join(coord["command"])
    env = coord["environment"]
    assert env["MESHTUNE_DATABASE_URL"].startswith("postgresql+psycopg://") and "@postgres:5432/" in env["MESHTUNE_DATABASE_URL"]
    assert "${MESHTUNE_API_TOKENS" in env["MESHTUNE_API_TOKENS"] and env["RAY_ADDRESS"] == "auto"
    assert "ray health-check" in " ".join(services["ray-head"]["healthcheck"]["test"])
    assert "--head" in services["ray-head"]["command"]
    worker = services["ray-worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"] and devices[0]["driver"] == "nvidia"
    assert worker["depends_on"]["ray-head"]["condition"] == "service_healthy"
    # No secret is written into the file: passwords and tokens come from the environment.
    text = COMPOSE.read_text()
    assert re.search(r"POSTGRES_PASSWORD:\?", text) and "MESHTUNE_API_TOKENS:?" in text


def test_every_command_the_compose_file_runs_exists() -> None:
    parser = build_parser()
    parser.parse_args(["serve", "--migrate-only"])
    parser.parse_args(["serve", "--host", "0.0.0.0", "--port", "8000", "--no-migrate"])
    dockerfile = (ROOT / "Dockerfile").read_text()
    for src in re.findall(r"^COPY (\S+)", dockerfile, flags=re.M):
        assert (ROOT / src).exists(), src
    assert '"meshtune", "serve"' in dockerfile


def test_compose_file_is_valid_under_the_compose_specification(compose_validator) -> None:
    raw = yaml.safe_load(COMPOSE.read_text())  # YAML anchors and << merge keys resolved, as Compose does
    rendered = interpolate(raw, ENV)
    assert _errors(compose_validator, rendered) == []
    url = rendered["services"]["coordinator"]["environment"]["MESHTUNE_DATABASE_URL"]
    assert url == "postgresql+psycopg://meshtune:pw-for-config@postgres:5432/meshtune"
    assert rendered["services"]["ray-worker"]["deploy"]["resources"]["reservations"]["devices"][0]["count"] == "all"
    # The secrets are required: without them Compose refuses the file (not an empty password).
    for name in ENV:
        with pytest.raises(MissingVariableError, match=name):
            interpolate(raw, {k: v for k, v in ENV.items() if k != name})


BREAKAGES = {
    "misspelt key": (lambda d: d["services"]["migrate"].update(comand=["meshtune"]), "'comand' does not match"),
    "unknown condition": (lambda d: d["services"]["coordinator"]["depends_on"]["postgres"].update(
        condition="service_heathy"), "$.services.coordinator.depends_on"),
    "wrong type": (lambda d: d["services"]["ray-worker"]["deploy"]["resources"]["reservations"]["devices"][0]
                   .update(capabilities="gpu"), "'gpu' is not of type 'array'"),
    "misspelt section": (lambda d: d.update(volume=d.pop("volumes")), "'volume' does not match"),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_a_broken_compose_file_is_rejected(compose_validator, breakage) -> None:
    document = copy.deepcopy(interpolate(yaml.safe_load(COMPOSE.read_text()), ENV))
    change, expected = BREAKAGES[breakage]
    change(document)
    errors = _errors(compose_validator, document)
    assert len(errors) == 1 and expected in errors[0], errors
