"""The coordinator's API in process for tests: the tokens, the sweep specs the API tests submit, and a
TestClient on a migrated SQLite file (``client_for``); the ``db_url`` and ``client`` fixtures of
tests/api/conftest.py are built on it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fastapi.testclient import TestClient

from api.main import create_app
from api.settings import Settings

TOKENS = {"alice": "tok-alice-5a1d7f0c9e", "ci": "tok-ci-0b3e6c2d81"}
ALICE = {"Authorization": f"Bearer {TOKENS['alice']}"}
CI = {"Authorization": f"Bearer {TOKENS['ci']}"}
WRONG = {"Authorization": "Bearer tok-alice-5a1d7f0c9X"}

TINY = {"model": "tiny", "cluster": "cpu-local", "training": {"global_batch": 16, "precision": "fp32"}}
SIMULATED = {
    **TINY,
    "name": "simulated",
    "space": {"cp": [1], "mbs": [1, 2], "ac": ["none"], "schedules": ["1f1b"]},
    "search": {"sampler": "random", "max_trials": 4, "warm_start_top_k": 1, "remeasure_top_k": 2, "repeats": 2},
    "backend": "simulate",
}


def settings_for(db_url: str, **overrides) -> Settings:
    values = {"home": Path(db_url.removeprefix("sqlite:///")).parent, "database_url": db_url,
              "api_tokens": TOKENS, "read_requires_auth": False, "ray_address": None, **overrides}
    return Settings(**values)


@contextmanager
def client_for(db_url: str, **overrides) -> Iterator[TestClient]:
    app = create_app(settings_for(db_url, **overrides), run_engine=False)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client
