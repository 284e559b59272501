"""Coordinator configuration from the environment (pydantic-settings), prefix ``MESHTUNE_``.

Embedded default: a SQLite file under ``MESHTUNE_HOME`` and a local Ray started on demand.
``MESHTUNE_HOME`` defaults to one per-user data directory (``$XDG_DATA_HOME/meshtune``, else
``~/.local/share/meshtune``), never to something under the current directory: a store that moved with
the shell's ``cd`` made ``meshtune show 5`` miss a sweep recorded from elsewhere.
Production: ``MESHTUNE_DATABASE_URL=postgresql+psycopg://...`` and ``RAY_ADDRESS`` (Ray's own name).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from tuner import SpecError

ROLES = ("admin", "member", "read-only")
# Settings whose value is never shown in an error line (a token list); a URL's secret is masked anyway.
SECRET_SETTINGS = frozenset({"api_tokens"})
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class SettingsError(SpecError):
    """A MESHTUNE_* variable with a value that cannot work: one line naming it (exit 2)."""


def default_home() -> Path:
    """``$XDG_DATA_HOME/meshtune``, else ``~/.local/share/meshtune``. The XDG Base Directory
    Specification (freedesktop.org, basedir-spec 0.8): an unset or empty ``XDG_DATA_HOME`` means
    ``$HOME/.local/share``, and a relative one "should be considered invalid and ignored"."""
    xdg = os.environ.get("XDG_DATA_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".local" / "share"
    return base / "meshtune"


class Settings(BaseSettings):
    # An empty variable means unset (the XDG Base Directory rule for its own variables): MESHTUNE_HOME=""
    # is the default home, not the current directory.
    model_config = SettingsConfigDict(env_prefix="MESHTUNE_", extra="ignore", env_ignore_empty=True)

    home: Path = Field(default_factory=default_home,
                       description="Directory for the embedded SQLite file (default: the per-user data dir).")
    database_url: str | None = Field(default=None, description="SQLAlchemy URL; default sqlite:///<home>/meshtune.db")
    ray_address: str | None = Field(
        default_factory=lambda: os.environ.get("RAY_ADDRESS") or None,
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
    # Roles of the named tokens, "alice:admin,dash:read-only" (or a JSON object): admin, member or
    # read-only. A token not named here is a member, so configurations from before roles keep working.
    api_roles: Annotated[dict[str, str], NoDecode] = Field(default_factory=dict, description="token name -> role")
    # Sharing one cluster (api/engine/_share.py): per-owner limits, "alice:8,*:4" ("*": every other
    # owner; absent: no limit), and how many sweeps one coordinator runs side by side.
    owner_max_devices: Annotated[dict[str, int], NoDecode] = Field(
        default_factory=dict, description="owner -> devices its trials may hold at once")
    owner_device_hours_per_day: Annotated[dict[str, float], NoDecode] = Field(
        default_factory=dict, description="owner -> device-hours its trials may hold in any 24 h")
    max_concurrent_sweeps: int = Field(default=8, ge=1, description="Sweeps one coordinator runs at once.")
    # Coordinators that share one cluster's devices name it (api/engine/_shared.py); unset: the
    # backend's own cluster id (Ray's), else the backend's name.
    cluster_name: str | None = Field(default=None, description="The cluster this coordinator's devices belong to.")
    # The simulate backend's cluster: its devices (unset: unbounded) and the wall seconds a trial
    # takes per second of the run it simulates (0: answer at once).
    simulate_devices: int | None = Field(default=None, ge=1, description="Devices of the simulated cluster.")
    simulate_pace: float = Field(default=0.0, ge=0, le=1000, description="Wall seconds per simulated second.")
    probe: Literal["auto", "off"] = Field(
        default="auto", description="auto: a sweep whose cluster, model and environment have no stored probe "
        "probes it before its first trial (api/probes); off: sweeps model the cluster from its datasheet.")
    # Proxies whose X-Forwarded-For is believed ("10.0.0.5,192.168.0.0/16"): IP literals or CIDRs.
    # Empty: the peer's own address is the client's, whatever the header says (api/_http.client_address).
    trusted_proxies: Annotated[tuple[IPNetwork, ...], NoDecode] = Field(
        default=(), description="addresses whose X-Forwarded-For names the client")

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:  # one line naming the variable, never a traceback nor a token
            raise SettingsError(settings_error_line(exc)) from None

    @field_validator("api_tokens", mode="before")
    @classmethod
    def _parse_tokens(cls, value: object) -> object:
        if isinstance(value, str) and value.lstrip().startswith("{"):
            return json.loads(value)
        if isinstance(value, str):
            pairs = [p.split(":", 1) for p in value.split(",") if p.strip()]
            bad = [i for i, p in enumerate(pairs, 1) if len(p) != 2 or not p[0].strip() or not p[1].strip()]
            if bad:  # its text is not shown: an entry without its name may be the token itself
                raise ValueError(f"entry {bad[0]} of {len(pairs)} is not name:token")
            return {name.strip(): token.strip() for name, token in pairs}
        return value

    @field_validator("api_roles", "owner_max_devices", "owner_device_hours_per_day", mode="before")
    @classmethod
    def _parse_pairs(cls, value: object) -> object:
        if isinstance(value, str) and value.lstrip().startswith("{"):
            return json.loads(value)
        if isinstance(value, str):
            pairs = [p.rsplit(":", 1) for p in value.split(",") if p.strip()]
            bad = [p[0] for p in pairs if len(p) != 2 or not p[0].strip() or not p[1].strip()]
            if bad:
                raise ValueError(f"entry {bad[0]!r} is not name:value")
            return {k.strip(): v.strip() for k, v in pairs}
        return value

    @field_validator("cluster_name")
    @classmethod
    def _check_cluster_name(cls, value: str | None) -> str | None:
        if not value:
            return None
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:/@-]{0,149}", value):
            raise ValueError("not a name (letters, digits and ._:/@-, "
                             "at most 150, starting with a letter or digit)")
        return value

    @field_validator("api_roles")
    @classmethod
    def _check_roles(cls, value: dict[str, str]) -> dict[str, str]:
        for name, role in value.items():
            if role not in ROLES:
                raise ValueError(f"role {role!r} of {name!r} is not one of {', '.join(ROLES)}")
        return value

    @field_validator("owner_max_devices", "owner_device_hours_per_day")
    @classmethod
    def _check_limits(cls, value: dict[str, float]) -> dict[str, float]:
        for name, limit in value.items():
            if limit <= 0:
                raise ValueError(f"owner limit of {name!r} must be positive, got {limit!r}")
        return value

    @field_validator("trusted_proxies", mode="before")
    @classmethod
    def _parse_proxies(cls, value: object) -> object:
        items = [p.strip() for p in value.split(",") if p.strip()] if isinstance(value, str) else value
        out = []
        for item in items or ():
            try:
                out.append(ipaddress.ip_network(item, strict=False) if isinstance(item, str) else item)
            except ValueError:
                raise ValueError(f"{item!r} is not an IP address or CIDR network (e.g. 10.0.0.5 or 10.0.0.0/8)") from None
        return tuple(out)

    def trusts_proxy(self, address: str) -> bool:
        """Whether ``address`` (a peer) is one of ``trusted_proxies``."""
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in net for net in self.trusted_proxies if net.version == ip.version)

    def secret_values(self) -> list[str]:
        """What no error answer or log line may show: the tokens and the database URL's password."""
        out = list(self.api_tokens.values())
        if self.database_url:
            from sqlalchemy.engine import make_url

            try:
                password = make_url(self.database_url).password
            except Exception:  # not a URL at all: refused by resolved_database_url, masked as text
                password = None
            if password:
                out.append(str(password))
        return out

    def role_of(self, name: str) -> str:
        """A token's role: as configured, else member (tokens configured before roles existed)."""
        return self.api_roles.get(name, "member")

    def owner_limit(self, limits: dict, owner: str | None) -> float | None:
        """The owner's entry of ``limits``, else its "*" entry, else None (no limit)."""
        return limits.get(owner or "", limits.get("*"))

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


def settings_error_line(exc: ValidationError) -> str:
    """``MESHTUNE_X=value: why`` for the first error (``MESHTUNE_API_TOKENS: why``, no value, for a secret)."""
    from api.redact import redact_text

    err = exc.errors()[0]
    field = str(err["loc"][0]) if err.get("loc") else ""
    name = f"MESHTUNE_{field.upper()}" if field else "MESHTUNE_*"
    why = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    value = err.get("input")
    if field in SECRET_SETTINGS or not isinstance(value, (str, int, float)):
        return redact_text(f"{name}: {why}")
    return redact_text(f"{name}={value!r}: {why}")


@lru_cache
def get_settings() -> Settings:
    return Settings()
