"""Column types shared by every table of the store.

``UTCDateTime`` is the one timestamp type (every DateTime column uses it; tests/api/store/test_store_contract.py
checks it): it writes every value as UTC and hands back aware UTC datetimes on SQLite and PostgreSQL
alike, with the DDL of ``DateTime(timezone=True)``.

Why a type of its own: docs/store.md#column-types.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import DateTime
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator


def as_utc(value: datetime) -> datetime:
    """``value`` as an aware UTC datetime. A naive value is taken to be UTC already: that is the
    store's convention (what SQLite's naive wall times always meant), not the machine's local time."""
    if value.tzinfo is None:
        return value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc)


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp stored as UTC and always read back as an aware UTC ``datetime``."""

    impl = DateTime(timezone=True)
    cache_ok = True  # no per-instance state: safe in SQLAlchemy's statement cache

    def process_bind_param(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if not isinstance(value, datetime):  # a date or a string would be stored as something else
            raise TypeError(f"a timestamp column takes a datetime, got {type(value).__name__} {value!r}")
        # SQLite then stores this UTC wall time; PostgreSQL gets an aware value (the instant) either way.
        return as_utc(value)

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        return None if value is None else as_utc(value)
