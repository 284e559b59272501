"""Bearer-token authentication for the coordinator.

Tokens come from the settings (``MESHTUNE_API_TOKENS="alice:secret1,ci:secret2"``): several named
tokens, the name is who a sweep records as its owner. Rules:

* mutating endpoints always need a token; reads need one when ``read_requires_auth`` is set;
* no ``Authorization: Bearer`` header -> 401 (with ``WWW-Authenticate: Bearer``), a token that
  matches no configured token -> 403;
* every configured token is compared with :func:`hmac.compare_digest` (on SHA-256 digests, so
  lengths do not leak either) and the loop never stops early, so the time taken does not reveal
  which token (or how much of one) matched;
* a token never appears in a response, an exception message or a log line;
* with no tokens configured at all auth is off (the embedded single-user default): every request
  is served as ``anonymous`` and ``meshtune serve`` logs a warning.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from fastapi import HTTPException, status

ANONYMOUS = "anonymous"


@dataclass(frozen=True)
class Principal:
    """Who is calling: the token's configured name, or ``anonymous`` when auth is off/not needed."""

    name: str
    authenticated: bool


def match_token(presented: str, tokens: Mapping[str, str]) -> str | None:
    """The name of the configured token equal to ``presented``, compared in constant time."""
    found: str | None = None
    # Digests first: compare_digest on raw strings of different lengths returns early, leaking length.
    presented_d = hashlib.sha256(presented.encode()).digest()
    for name, token in tokens.items():
        # No early exit: every token is compared whatever matched before.
        if hmac.compare_digest(presented_d, hashlib.sha256(token.encode()).digest()):
            found = name
    return found


def unauthorized(message: str) -> HTTPException:
    return HTTPException(
        status_code=status.HTTP_401_UNAUTHORIZED, detail=message, headers={"WWW-Authenticate": "Bearer"}
    )


def authenticate(
    scheme: str | None, credentials: str | None, *, tokens: Mapping[str, str], required: bool
) -> Principal:
    """Resolve the caller from the ``Authorization`` header parts (already split by HTTPBearer).

    ``required`` says whether this endpoint needs a token; when it does not, a missing header is
    anonymous but a presented wrong token is still refused (a typo should not silently downgrade).
    """
    if not tokens:
        return Principal(ANONYMOUS, authenticated=False)
    if not credentials:
        if required:
            raise unauthorized("missing bearer token: send 'Authorization: Bearer <token>'")
        return Principal(ANONYMOUS, authenticated=False)
    if (scheme or "").lower() != "bearer":
        raise unauthorized("the Authorization header must use the Bearer scheme")
    name = match_token(credentials, tokens)
    if name is None:
        raise HTTPException(status_code=status.HTTP_403_FORBIDDEN, detail="the bearer token is not valid")
    return Principal(name, authenticated=True)
