"""Bearer-token authentication and roles for the coordinator.

Named tokens from ``MESHTUNE_API_TOKENS`` (the name is a sweep's owner), roles from
``MESHTUNE_API_ROLES`` (``admin``, ``member`` by default, ``read-only``). Mutations always need a
token, reads when ``read_requires_auth``; no token is 401, an unknown one 403. Tokens are compared
in constant time and never shown; with none configured auth is off (one anonymous admin).

The rules in full: docs/api.md#authentication.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from fastapi import HTTPException, status

from api.settings import ROLES
from tuner import MeshtuneError

ANONYMOUS = "anonymous"


class ForbiddenError(MeshtuneError, PermissionError):
    """The caller's role does not allow this action (HTTP 403 with the message)."""


@dataclass(frozen=True)
class Principal:
    """Who is calling: the token's configured name, or ``anonymous`` when auth is off/not needed."""

    name: str
    authenticated: bool
    role: str = "admin"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role {self.role!r} is not one of {', '.join(ROLES)}")

    @property
    def can_write(self) -> bool:
        return self.role != "read-only"

    def may_act_on(self, owner: str | None) -> bool:
        """Whether this caller may cancel, change or delete a thing ``owner`` submitted."""
        return self.role == "admin" or (self.role == "member" and owner == self.name)


def require_writer(who: Principal) -> Principal:
    if not who.can_write:
        raise ForbiddenError(f"token {who.name!r} is read-only: it may read, not submit, cancel, change or delete")
    return who


def require_owner(who: Principal | None, *, owner: str | None, what: str) -> None:
    """Raise ForbiddenError unless ``who`` (None: an in-process caller, e.g. the CLI) may act on
    ``what``, owned by ``owner``."""
    if who is None or who.may_act_on(owner):
        return
    if not who.can_write:
        require_writer(who)
    raise ForbiddenError(f"{what} belongs to {owner!r}; token {who.name!r} (member) may act only on its own")


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
    scheme: str | None, credentials: str | None, *, tokens: Mapping[str, str], required: bool,
    roles: Mapping[str, str] | None = None,
) -> Principal:
    """Resolve the caller from the ``Authorization`` header parts (already split by HTTPBearer).

    ``required`` says whether this endpoint needs a token; when it does not, a missing header is
    anonymous but a presented wrong token is still refused (a typo should not silently downgrade).
    """
    if not tokens:
        return Principal(ANONYMOUS, authenticated=False, role="admin")
    if not credentials:
        if required:
            raise unauthorized("missing bearer token: send 'Authorization: Bearer <token>'")
        return Principal(ANONYMOUS, authenticated=False, role="read-only")
    if (scheme or "").lower() != "bearer":
        raise unauthorized("the Authorization header must use the Bearer scheme")
    name = match_token(credentials, tokens)
    if name is None:
        raise HTTPException(status_code=status.HTTP_403_FORBIDDEN, detail="the bearer token is not valid")
    return Principal(name, authenticated=True, role=(roles or {}).get(name, "member"))
