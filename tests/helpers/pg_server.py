"""A throw-away PostgreSQL server of a test's own: ``initdb`` into a temporary directory and started on
a free loopback port, so a test can restart it under load. The shared server at 127.0.0.1:5432 serves
every test session on the machine and is never restarted by a test.

The server binaries are the distribution's (``/usr/lib/postgresql/<version>/bin``, else ``pg_ctl`` on
the PATH); ``server_binaries()`` is None without them (the test then skips and says so). PostgreSQL
refuses to run as root, so as root the server runs as the ``postgres`` user (``runuser``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path


def server_binaries() -> Path | None:
    """The directory of ``pg_ctl`` and ``initdb``: the newest /usr/lib/postgresql/*/bin, else the PATH's."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name)
                   if p.parent.name.isdigit() else 0)
    for d in [*reversed(found), *([Path(shutil.which("pg_ctl")).parent] if shutil.which("pg_ctl") else [])]:
        if (d / "pg_ctl").exists() and (d / "initdb").exists():
            return d
    return None


def why_not() -> str | None:
    """Why a server of its own cannot be started here, or None."""
    if server_binaries() is None:
        return "no PostgreSQL server binaries (pg_ctl, initdb) under /usr/lib/postgresql/*/bin or on the PATH"
    if os.geteuid() == 0 and (shutil.which("runuser") is None or _uid("postgres") is None):
        return "running as root with no 'postgres' user (or no runuser) to run a PostgreSQL server as"
    return None


def _uid(name: str) -> int | None:
    import pwd

    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgServer:
    def __init__(self) -> None:
        self.bin = server_binaries()
        assert self.bin is not None, why_not()
        self.root = Path(tempfile.mkdtemp(prefix="mt-pg-", dir="/tmp"))
        self.data, self.log = self.root / "data", self.root / "server.log"
        self.port = _free_port()
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.as_user:
            os.chown(self.root, _uid("postgres"), -1)
        # --no-sync and fsync=off: a throw-away server; nothing here must survive a crash of the machine.
        self._run("initdb", "-D", self.data, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync",
                  "--no-instructions")
        self._options = (f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories='' "
                         "-c fsync=off -c max_connections=200")
        self.start()

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: object) -> None:
        out = subprocess.run([*self.as_user, str(self.bin / tool), *map(str, args)], capture_output=True,
                             text=True, timeout=180)
        if out.returncode:
            log = self.log.read_text()[-2000:] if self.log.exists() else ""
            raise AssertionError(f"{tool} {' '.join(map(str, args))} failed ({out.returncode}): {out.stderr}\n{log}")

    def _ctl(self, action: str, *args: object) -> None:
        self._run("pg_ctl", "-D", self.data, "-l", self.log, "-w", "-t", "120", *args, action)

    def stop(self) -> None:
        """Stop at once: every session is ended (``-m fast``, what a restart or a failover does)."""
        self._ctl("stop", "-m", "fast")

    def start(self) -> None:
        self._ctl("start", "-o", self._options)

    def close(self) -> None:
        try:
            self._ctl("stop", "-m", "immediate")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
