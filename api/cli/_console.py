"""What every ``meshtune`` command prints besides its own output, set up once in ``api.cli.main``.

- The store's whereabouts: ``api.store`` logs ``store: URL (created)`` (INFO) when a database gets its
  schema from nothing, and ``store: URL`` (DEBUG) on every open, on the ``meshtune.store`` logger.
  ``StoreLines`` prints the INFO lines on stderr (so ``--json`` output stays clean) and remembers the
  last store opened, which ``main`` adds to a not-found error: "sweep 5 does not exist (store: ...)".
  No command module has to do anything: every store open goes through ``api.store``.
- Ray's token-authentication notice: see ``quiet_ray_token_auth``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

STORE_LOGGER = "meshtune.store"

# Ray >= 2.5x: a ray.init() that starts a new local cluster with RAY_AUTH_MODE unset turns token
# authentication on and logs, on this logger, the WARNING "Token authentication is enabled for this Ray
# cluster. Set RAY_AUTH_MODE=disabled to opt out." (ray/_private/authentication/
# authentication_token_setup.py, enable_token_auth_by_default; also on joining a local cluster when a
# token file exists). It reports the secure default on every command that starts Ray.
RAY_TOKEN_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
RAY_TOKEN_AUTH_ENABLED = "Token authentication is enabled for this Ray cluster"


class StoreLines(logging.Handler):
    """Prints the store's INFO records as they are (one line each) on the current ``sys.stderr``
    (looked up per record: tests swap it), and keeps the URL of the last store opened."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.opened: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        self.opened = getattr(record, "store_url", None) or self.opened
        if record.levelno >= logging.INFO:
            print(record.getMessage(), file=sys.stderr)


@contextmanager
def store_lines() -> Iterator[StoreLines]:
    """``StoreLines`` on the store's logger for one command; the logger is left as it was after."""
    logger = logging.getLogger(STORE_LOGGER)
    handler = StoreLines()
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    # DEBUG reaches the handler (the last store opened); not propagated, so that `serve`'s root
    # logging does not print the same line again in its own format.
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


class _DropTokenAuthEnabled(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(RAY_TOKEN_AUTH_ENABLED)


def quiet_ray_token_auth() -> None:
    """Drop Ray's "token authentication is enabled" notice, and only that: Ray's behaviour is left
    as it is (token auth on for the local cluster it starts, a cluster joined by RAY_ADDRESS decides
    its own mode, RAY_AUTH_MODE still rules), and its warning that token auth is *disabled* (anyone
    on the network can run code on the cluster) still shows. Setting RAY_AUTH_MODE=token ourselves
    would silence it too, but would also make joining a local `ray start` cluster that has no token
    fail. Idempotent; Ray need not be imported yet (the logger object is shared by name)."""
    logger = logging.getLogger(RAY_TOKEN_AUTH_LOGGER)
    if not any(isinstance(f, _DropTokenAuthEnabled) for f in logger.filters):
        logger.addFilter(_DropTokenAuthEnabled())
