"""Fixtures of the API tests: a migrated SQLite file per test module and a TestClient on it with the
tokens of tests/helpers/api_client.py (module-scoped: a module's tests share one app)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from tests.helpers.api_client import client_for


@pytest.fixture(scope="module")
def db_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A SQLite file migrated to head, one per test module."""
    from api import store

    url = f"sqlite:///{tmp_path_factory.mktemp('api') / 'api.db'}"
    store.upgrade(url)
    return url


@pytest.fixture(scope="module")
def client(db_url: str) -> Iterator[TestClient]:
    """The API on ``db_url`` (tokens alice and ci; reads open; no engine), one per test module."""
    with client_for(db_url) as c:
        yield c
