"""Alembic: upgrade head and downgrade base on SQLite and PostgreSQL; the models match the migrations."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from api import store


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def url(request, tmp_path):
    return f"sqlite:///{tmp_path / 'm.db'}" if request.param == "sqlite" else request.getfixturevalue("fresh_pg_url")


def _tables(url: str) -> set[str]:
    engine = store.create_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_head_then_downgrade_base(url):
    store.upgrade(url)
    assert store.current_revision(url) is not None
    assert {"sweeps", "trials", store.VERSION_TABLE} <= _tables(url)
    assert "alembic_version" not in _tables(url)  # our own version table: no clash with Optuna's
    engine = store.create_engine(url)
    with engine.connect() as conn:  # the migrated schema is exactly what the models declare
        diff = compare_metadata(MigrationContext.configure(conn, opts={"version_table": store.VERSION_TABLE}),
                                store.Base.metadata)
    engine.dispose()
    assert diff == []
    store.upgrade(url)  # idempotent
    store.downgrade(url)
    assert store.current_revision(url) is None
    assert _tables(url) <= {store.VERSION_TABLE}


def test_unreachable_database_is_named_without_password():
    with pytest.raises(store.StoreUnavailableError) as exc:
        store.open_store("postgresql+psycopg://meshtune:s3cr3t@127.0.0.1:1/nowhere")
    assert "127.0.0.1:1/nowhere" in str(exc.value) and "s3cr3t" not in str(exc.value)
    assert "***" in str(exc.value)
