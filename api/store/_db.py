"""Engines, sessions and migrations. A database that cannot be reached is a StoreUnavailableError that
names the URL without its password (never a driver traceback).

SQLite (the embedded default) runs in WAL mode with a busy timeout so the API and the engine thread
can share the file; PostgreSQL is used as is. The schema is Alembic's (``migrations/``, configured by
``api/alembic.ini``); the app's version table is ``meshtune_alembic_version`` so that it can never
collide with another tool's default ``alembic_version`` (Optuna's RDBStorage uses that one).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.orm import Session, sessionmaker

from tuner import MeshtuneError

ALEMBIC_INI = Path(__file__).resolve().parent.parent / "alembic.ini"
VERSION_TABLE = "meshtune_alembic_version"


class StoreUnavailableError(MeshtuneError):
    """The database cannot be reached or is not migrated; the message names the URL sans password."""


def safe_url(url: str | sa.URL) -> str:
    """``url`` with its password masked, for messages and logs."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # an unparsable URL: show nothing secret-looking
        return "<unparsable database URL>"


def create_engine(url: str) -> Engine:
    """An Engine for ``url``; SQLite gets WAL, a busy timeout and cross-thread use."""
    try:
        parsed = make_url(url)
    except Exception as exc:
        raise StoreUnavailableError(f"invalid database URL {safe_url(url)!r}: {exc}") from None
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = sa.create_engine(parsed, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record) -> None:  # type: ignore[no-untyped-def]
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA synchronous=NORMAL")  # WAL: durable at checkpoints, never corrupt
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    connect_args = {"connect_timeout": 5} if parsed.get_backend_name() == "postgresql" else {}
    return sa.create_engine(parsed, pool_pre_ping=True, connect_args=connect_args)


def check_connection(engine: Engine) -> None:
    """Raise StoreUnavailableError naming the URL (password hidden) unless a query round-trips."""
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    except Exception as exc:
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        raise StoreUnavailableError(f"cannot reach the database at {safe_url(engine.url)}: {reason}") from None


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def session_scope(sessions: sessionmaker[Session]) -> Iterator[Session]:
    """A session that commits on success and rolls back on error."""
    with sessions() as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise


def alembic_config(url: str):  # -> alembic.config.Config
    from alembic.config import Config

    import migrations  # the Alembic environment ships as a package next to ``api``

    cfg = Config(str(ALEMBIC_INI))
    where = next((Path(p) for p in migrations.__path__ if (Path(p) / "env.py").exists()), None)
    if where is None:
        raise StoreUnavailableError(f"meshtune's migrations are not installed (looked in {list(migrations.__path__)})")
    cfg.set_main_option("script_location", str(where))
    cfg.attributes["database_url"] = url
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """``alembic upgrade`` on ``url`` (what ``meshtune db upgrade`` and coordinator start-up run)."""
    from alembic import command

    check_connection(create_engine(url))
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    from alembic import command

    check_connection(create_engine(url))
    command.downgrade(alembic_config(url), revision)


def current_revision(url: str) -> str | None:
    from alembic.runtime.migration import MigrationContext

    engine = create_engine(url)
    check_connection(engine)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}).get_current_revision()
    finally:
        engine.dispose()


def open_store(url: str, *, upgrade_schema: bool = True) -> tuple[Engine, sessionmaker[Session]]:
    """Engine + sessionmaker for ``url``, migrated to head first (unless ``upgrade_schema=False``)."""
    engine = create_engine(url)
    check_connection(engine)
    if upgrade_schema:
        upgrade(url)
    return engine, make_sessionmaker(engine)
