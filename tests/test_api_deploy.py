"""The docker-compose deployment: structure checked by parsing (always) and by the compose CLI's own
validator (`docker compose config` or `docker-compose config`) where one is installed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from api.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
ENV = {"POSTGRES_PASSWORD": "pw-for-config", "MESHTUNE_API_TOKENS": "alice:tok"}


def compose_cli() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


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


def test_compose_cli_validates_the_file() -> None:
    cli = compose_cli()
    if cli is None:
        pytest.skip("no docker compose / docker-compose CLI installed (structure is checked above)")
    env = {**os.environ, **ENV}
    rendered = subprocess.run([*cli, "-f", str(COMPOSE), "config"], capture_output=True, text=True, env=env)
    assert rendered.returncode == 0, rendered.stderr
    assert "pw-for-config@postgres:5432" in rendered.stdout
    missing = {k: v for k, v in env.items() if k != "POSTGRES_PASSWORD"}
    bad = subprocess.run([*cli, "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True, env=missing)
    assert bad.returncode != 0 and "POSTGRES_PASSWORD" in bad.stderr
