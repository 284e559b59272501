"""Typed FastAPI dependencies: settings, a database session per request, and the calling principal.

The app keeps its settings and session factory on ``app.state`` (set by ``create_app`` and its
lifespan), so a test can build an app on any settings without touching process-wide caches.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import Depends, Path, Query, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from api.auth import Principal, authenticate, require_writer
from api.paging import MAX_ID, MAX_OFFSET, MAX_PAGE, MAX_RANKING_PAGE
from api.settings import Settings

bearer = HTTPBearer(
    auto_error=False,
    scheme_name="bearer",
    description="A token from MESHTUNE_API_TOKENS (name:token pairs); the name is recorded as the sweep owner.",
)


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


SettingsDep = Annotated[Settings, Depends(get_settings)]


async def get_session(request: Request) -> AsyncIterator[Session]:
    """One session per request; services commit their own writes, anything left is rolled back."""
    with request.app.state.sessions() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]

Credentials = Annotated[HTTPAuthorizationCredentials | None, Security(bearer)]


async def reader(settings: SettingsDep, credentials: Credentials) -> Principal:
    """The caller of a read endpoint: a token is needed only when ``read_requires_auth`` is set."""
    return authenticate(
        credentials.scheme if credentials else None,
        credentials.credentials if credentials else None,
        tokens=settings.api_tokens,
        required=settings.read_requires_auth,
        roles=settings.api_roles,
    )


async def writer(settings: SettingsDep, credentials: Credentials) -> Principal:
    """The caller of a mutating endpoint: always needs a valid token (unless no tokens are configured)
    whose role may write (a read-only token: 403). Whether it may act on a given sweep or schedule
    (its owner, or an admin) is the service's check (api.auth.require_owner)."""
    return require_writer(authenticate(
        credentials.scheme if credentials else None,
        credentials.credentials if credentials else None,
        tokens=settings.api_tokens,
        required=True,
        roles=settings.api_roles,
    ))


ReaderDep = Annotated[Principal, Depends(reader)]
WriterDep = Annotated[Principal, Depends(writer)]


# Every stored row's id is an INTEGER column: 32-bit signed on PostgreSQL (an id above 2^31 - 1 is a
# database error there, and above 2^63 - 1 an OverflowError in SQLite's driver). One bound for every
# id a route takes, so an out-of-range id is a 422 naming the parameter, never a 500; the pages' bounds
# are api.paging's, documented on each parameter.
Limit = Annotated[int, Query(ge=1, le=MAX_PAGE, description=f"Page size, 1..{MAX_PAGE}.")]
Offset = Annotated[int, Query(ge=0, le=MAX_OFFSET, description=f"Items to skip, 0..{MAX_OFFSET} (past the last "
                                                               "item the page is empty).")]
RankingLimit = Annotated[int | None, Query(ge=1, le=MAX_RANKING_PAGE, description=(
    f"Only this many rows, 1..{MAX_RANKING_PAGE:,} (default: all)."))]


def path_id(description: str) -> Any:
    """The id type of a path parameter (1 .. MAX_ID)."""
    return Annotated[int, Path(ge=1, le=MAX_ID, description=description)]


def query_id(description: str, *, optional: bool = False) -> Any:
    """The id type of a query parameter (1 .. MAX_ID); ``optional``: it may be left out (None)."""
    return Annotated[int | None if optional else int, Query(ge=1, le=MAX_ID, description=description)]


SweepId = path_id("Sweep id.")
TrialId = path_id("Trial row id (TrialOut.id).")
ScheduleId = path_id("Schedule id.")
