"""Shared fixtures: a fresh PostgreSQL database per test session, one local Ray per session, a headless
Chromium per browser-test module, and a throw-away MESHTUNE_HOME for the whole run."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

# The shared checks of tests/helpers assert as the tests do: their failures show the values too.
pytest.register_assert_rewrite("tests.helpers")

# No test touches a real store: not the per-user data dir that is MESHTUNE_HOME's default
# (~/.local/share/meshtune), nor a database the developer configured. Set when pytest loads this file,
# before any test runs, so every in-process Settings() and every CLI subprocess (they inherit
# os.environ) gets a throw-away home; a test that needs a home of its own sets MESHTUNE_HOME itself.
TEST_HOME = tempfile.mkdtemp(prefix="meshtune-test-home-")
os.environ["MESHTUNE_HOME"] = TEST_HOME
os.environ.pop("MESHTUNE_DATABASE_URL", None)
# Sweeps model the cluster from its datasheet unless a test asks for the probe (tests/tuner/test_probe.py, tests/api/probes/):
# a real probe takes tens of seconds on these machines, and most tests' sweeps are about other things.
os.environ["MESHTUNE_PROBE"] = "off"


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(TEST_HOME, ignore_errors=True)

PG_ADMIN_URL = os.environ.get("MESHTUNE_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
ARTIFACTS = Path(os.environ.get("MESHTUNE_TEST_ARTIFACTS", Path(__file__).resolve().parent.parent / "test-artifacts"))


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    """Where a test run keeps files a person may want to look at (screenshots, reports)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    """A headless Chromium shared by a module's tests (each opens its own context); once per module,
    not per session: tests/helpers/browser.py says why."""
    from tests.helpers.browser import chromium

    with chromium() as b:
        yield b


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """URL of a PostgreSQL database created for this test session and dropped after it."""
    import sqlalchemy as sa

    name = f"meshtune_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(
                sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"), {"n": name}
            )
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}"'))
        admin.dispose()


@pytest.fixture
def fresh_pg_url(pg_url: str) -> Iterator[str]:
    """A PostgreSQL database of its own for one test (for migration and contract tests)."""
    import sqlalchemy as sa

    name = f"meshtune_t_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.connect() as conn:
            conn.execute(
                sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"), {"n": name}
            )
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}"'))
        admin.dispose()


class StoreDb(NamedTuple):
    """A fresh SQLite store: ``settings, sessions = db``; ``db.url`` is its database URL."""

    settings: object  # api.settings.Settings (imported lazily, as every project import here)
    sessions: object  # its sqlalchemy sessionmaker

    @property
    def url(self) -> str:
        return self.settings.database_url


@pytest.fixture
def db(tmp_path: Path) -> Iterator[StoreDb]:
    """A SQLite file of its own for one test, migrated to head, and Settings on it (home: tmp_path)."""
    from api import store
    from api.settings import Settings

    url = f"sqlite:///{tmp_path / 'meshtune.db'}"
    engine, sessions = store.open_store(url)
    yield StoreDb(Settings(database_url=url, home=tmp_path), sessions)
    engine.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database URL on each store the project supports: a SQLite file, and a PostgreSQL
    database of its own (``fresh_pg_url``)."""
    return f"sqlite:///{tmp_path / 'store.db'}" if request.param == "sqlite" else request.getfixturevalue("fresh_pg_url")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A MESHTUNE_HOME of its own (tmp_path/home) and no configured database, for CLI runs in process;
    returns tmp_path, where a test writes its spec files."""
    monkeypatch.setenv("MESHTUNE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MESHTUNE_DATABASE_URL", raising=False)
    return tmp_path


@pytest.fixture(scope="session")
def ray_local() -> Iterator[None]:
    """One local Ray for the whole session (logical CPUs may exceed the 2 real cores). Always a new
    one (``address="local"``): a plain ``ray.init()`` joins the latest Ray cluster it finds on the
    machine (another test run's, a multi-node test's head), whose nodes and devices are not these."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=4,
            object_store_memory=200 * 2**20,
            include_dashboard=False,
            log_to_driver=False,
        )
    yield
    ray.shutdown()


class WebhookReceiver:
    """A local HTTP server that records JSON POSTs; ``statuses`` are answered in order, then 200."""

    def __init__(self) -> None:
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.received: list[dict] = []
        self.statuses: list[int] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status = receiver.statuses.pop(0) if receiver.statuses else 200
                receiver.received.append({"path": self.path, "status": status, "json": json.loads(body or b"null"),
                                          "content_type": self.headers.get("Content-Type")})
                self.send_response(status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def webhook_receiver() -> Iterator[WebhookReceiver]:
    """A webhook endpoint on 127.0.0.1 that records what is POSTed to it (``.url``, ``.received``)."""
    receiver = WebhookReceiver()
    try:
        yield receiver
    finally:
        receiver.close()


@pytest.fixture(scope="session")
def ray_backend(ray_local: None) -> Iterator[object]:
    """One RayBackend for the session; its warm rank processes live in the process-wide gang pool
    (workers/_gangs.py), which every other RayBackend of this process shares and may evict."""
    from workers.ray_backend import RayBackend

    backend = RayBackend()
    yield backend
    backend.close()
