"""Coordinator configuration from the environment (pydantic-settings), prefix ``MESHTUNE_``.

Embedded default: a SQLite file under ``MESHTUNE_HOME`` and a local Ray started on demand.
``MESHTUNE_HOME`` defaults to one per-user data directory (``$XDG_DATA_HOME/meshtune``, else
``~/.local/share/meshtune``), never to something under the current directory: a store that moved with
the shell's ``cd`` made ``meshtune show 5`` miss a sweep recorded from elsewhere.
Production: ``MESHTUNE_DATABASE_URL=postgresql+psycopg://...`` and ``RAY_ADDRESS`` (Ray's own name).
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


def default_home() -> Path:
    """``$XDG_DATA_HOME/meshtune``, else ``~/.local/share/meshtune``. The XDG Base Directory
    Specification (freedesktop.org, basedir-spec 0.8): an unset or empty ``XDG_DATA_HOME`` means
    ``$HOME/.local/share``, and a relative one "should be considered invalid and ignored"."""
    xdg = os.environ.get("XDG_DATA_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".local" / "share"
    return base / "meshtune"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MESHTUNE_", extra="ignore")

    home: Path = Field(default_factory=default_home,
                       description="Directory for the embedded SQLite file (default: the per-user data dir).")
    database_url: str | None = Field(default=None, description="SQLAlchemy URL; default sqlite:///<home>/meshtune.db")
    ray_address: str | None = Field(
        default_factory=lambda: os.environ.get("RAY_ADDRESS"),
        description="Ray cluster to join (read from RAY_ADDRESS); unset starts a local Ray.",
    )
    # Named bearer tokens, "alice:secret1,bob:secret2" (or a JSON object). Empty disables auth.
    api_tokens: Annotated[dict[str, str], NoDecode] = Field(default_factory=dict, description="name -> bearer token")
    read_requires_auth: bool = Field(default=False, description="Require a token for GET endpoints too.")
    backend: str = Field(default="ray", description="Default trial backend: ray, simulate, or module:attr.")
    max_concurrent_trials: int = Field(default=0, description="0 = as many as the backend's capacity allows.")
    webhook_timeout_s: float = 5.0
    webhook_allow_private: bool = Field(
        default=False, description="Allow webhook URLs on loopback/private addresses (link-local and cloud "
        "metadata targets are refused regardless).")
    scheduler_enabled: bool = True

    @field_validator("api_tokens", mode="before")
    @classmethod
    def _parse_tokens(cls, value: object) -> object:
        if isinstance(value, str) and value.lstrip().startswith("{"):
            return json.loads(value)
        if isinstance(value, str):
            pairs = [p.split(":", 1) for p in value.split(",") if p.strip()]
            bad = [p[0] for p in pairs if len(p) != 2 or not p[1]]
            if bad:
                raise ValueError(f"MESHTUNE_API_TOKENS entry {bad[0]!r} is not name:token")
            return {name.strip(): token.strip() for name, token in pairs}
        return value

    @property
    def resolved_database_url(self) -> str:
        """The store's URL. A ``MESHTUNE_DATABASE_URL`` that cannot work (no such kind of database,
        its driver not installed, a SQLite file in a directory that does not exist) is refused here,
        naming the variable and its value (password masked): every entry point (CLI commands,
        ``serve``, the app, the Alembic environment) resolves the URL through this property. Only the
        embedded default's directory is created: a given path with a typo is an error, not a new,
        empty store somewhere unexpected."""
        from api.store import StoreUnavailableError, safe_url, url_problem

        if self.database_url:
            problem = url_problem(self.database_url)
            if problem:
                raise StoreUnavailableError(f"MESHTUNE_DATABASE_URL={safe_url(self.database_url)!r}: {problem}")
            return self.database_url
        self.home.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{(self.home / 'meshtune.db').resolve()}"


@lru_cache
def get_settings() -> Settings:
    return Settings()
