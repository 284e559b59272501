"""Engines, sessions and migrations. A database that cannot be used (a URL of an unknown kind, a driver
that is not installed, a SQLite file in a directory that does not exist) or reached is a
StoreUnavailableError that names the URL without its password: one line, never a driver traceback.
A SQLite URL never creates directories: only the embedded default's home is created (api/settings.py).

SQLite (the embedded default) runs in WAL mode with a busy timeout so the API and the engine thread
can share the file; PostgreSQL is used as is. The schema is Alembic's (``migrations/``, configured by
``api/alembic.ini``); the app's version table is ``meshtune_alembic_version`` so that it can never
collide with another tool's default ``alembic_version`` (Optuna's RDBStorage uses that one).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError
from sqlalchemy.orm import Session, sessionmaker

from tuner import MeshtuneError

ALEMBIC_INI = Path(__file__).resolve().parent.parent / "alembic.ini"
VERSION_TABLE = "meshtune_alembic_version"
SUPPORTED = "meshtune supports sqlite:///PATH and postgresql+psycopg://USER@HOST/DB"

# Says where the store is: INFO "store: URL (created)" when a database gets its schema from nothing,
# DEBUG "store: URL" on every open. Each record carries ``store_url`` (password masked). The CLI prints
# the INFO lines and names the last store opened in a not-found error (api/cli/__init__.py).
log = logging.getLogger("meshtune.store")


class StoreUnavailableError(MeshtuneError):
    """The database cannot be reached or is not migrated; the message names the URL sans password."""


def safe_url(url: str | sa.URL) -> str:
    """``url`` with its password and query masked, for messages and logs (api.redact's rule)."""
    from api.redact import mask_url

    text = url.render_as_string(hide_password=False) if isinstance(url, sa.URL) else str(url)
    if "://" not in text:  # not a URL at all: shown (it is what was given), anything like user:password@ masked
        return re.sub(r"(?<=:)[^:/@]*(?=@)", "***", text)
    return mask_url(text) or text


def url_problem(url: str) -> str | None:
    """Why ``url`` cannot work, in a few words, or None. Checked before any engine exists, because
    SQLAlchemy only finds out on ``create_engine`` (an ImportError from deep in the dialect) and
    SQLite's driver would create an empty file wherever the path points."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        return f"not a database URL ({SUPPORTED})"
    try:
        dialect = parsed.get_dialect()
    except NoSuchModuleError:
        return f"unknown kind of database {parsed.drivername!r} ({SUPPORTED})"
    try:
        dialect.import_dbapi()
    except ImportError as exc:
        return f"the database driver for {parsed.drivername!r} is not installed ({exc}); {SUPPORTED}"
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:") \
            and not parsed.query.get("uri"):  # a file: URI names its file in its own syntax
        parent = Path(parsed.database).expanduser().parent
        if not parent.is_dir():
            return f"directory {parent} does not exist (the SQLite file's directory is never created)"
    return None


def create_engine(url: str) -> Engine:
    """An Engine for ``url``; SQLite gets WAL, a busy timeout and cross-thread use."""
    problem = url_problem(url)
    if problem:
        raise StoreUnavailableError(f"database URL {safe_url(url)!r}: {problem}")
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
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


def _revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}).get_current_revision()


def upgrade(url: str, revision: str = "head") -> None:
    """``alembic upgrade`` on ``url`` (what ``meshtune db upgrade`` and coordinator start-up run).
    A database that had no schema says so on the ``meshtune.store`` logger: a new store was made."""
    from alembic import command

    engine = create_engine(url)
    try:
        check_connection(engine)
        before = _revision(engine)
    finally:
        engine.dispose()
    command.upgrade(alembic_config(url), revision)
    if before is None:
        shown = safe_url(url)
        log.info("store: %s (created)", shown, extra={"store_url": shown})


def downgrade(url: str, revision: str = "base") -> None:
    from alembic import command

    engine = create_engine(url)
    try:
        check_connection(engine)
    finally:
        engine.dispose()
    command.downgrade(alembic_config(url), revision)


def current_revision(url: str) -> str | None:
    engine = create_engine(url)
    try:
        check_connection(engine)
        return _revision(engine)
    finally:
        engine.dispose()


def open_store(url: str, *, upgrade_schema: bool = True) -> tuple[Engine, sessionmaker[Session]]:
    """Engine + sessionmaker for ``url``, migrated to head first (unless ``upgrade_schema=False``)."""
    engine = create_engine(url)
    check_connection(engine)
    if upgrade_schema:
        upgrade(url)
    shown = safe_url(url)
    log.debug("store: %s", shown, extra={"store_url": shown})
    return engine, make_sessionmaker(engine)
