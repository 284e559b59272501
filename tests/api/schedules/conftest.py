"""The schedule tests' client: the API with no tokens (every caller is the anonymous admin) on a
fresh store per test (``db``), since a test's schedules and fires must not meet another's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from api.settings import Settings


@pytest.fixture
def client(db) -> Iterator[TestClient]:
    """Overrides tests/api/conftest.py's module-wide client: no tokens, and the test's own ``db``."""
    from api.main import create_app

    with TestClient(create_app(Settings(database_url=db.url, api_tokens={}), run_engine=False)) as c:
        yield c
