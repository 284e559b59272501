"""Alembic environment: the URL comes from the caller (``api.store.upgrade``) or the settings.

The version table is ``meshtune_alembic_version`` (not Alembic's default) so that this schema's
history can never be confused with another Alembic user's in the same database (Optuna's RDBStorage
stamps ``alembic_version``: docs/api.md#optuna-export).
"""

from __future__ import annotations

from alembic import context

import api.probes.models  # noqa: E402,F401 - registers the cluster-probe table on Base
import api.reshard.models  # noqa: E402,F401 - registers the reshard-check table on Base
import api.schedules.models  # noqa: E402,F401 - registers the schedule tables on Base
from api.store._db import VERSION_TABLE, create_engine
from api.store._models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = config.attributes.get("database_url") or config.get_main_option("sqlalchemy.url")
    if not url:
        from api.settings import Settings

        url = Settings().resolved_database_url
    return url


def run_migrations_offline() -> None:
    context.configure(
        url=_url(), target_metadata=target_metadata, literal_binds=True, version_table=VERSION_TABLE,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = create_engine(_url())
    try:
        with engine.connect() as connection:
            if connection.dialect.name == "sqlite":
                # A batch migration rebuilds a table (create, copy, drop, rename); with foreign keys on, the
                # drop of the old ``sweeps`` cascades to every trial. The pragma is a no-op inside a
                # transaction, so it is set and committed before Alembic's begins.
                connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
                connection.commit()
            context.configure(
                connection=connection,
                target_metadata=target_metadata,
                version_table=VERSION_TABLE,
                render_as_batch=connection.dialect.name == "sqlite",
            )
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
