"""Cron and time-zone handling on croniter + zoneinfo, and the misfire policy as a pure function.

``plan_fires``: of the fire times due since the schedule's anchor, the most recent runs once if it is
within ``grace_s``, the others within the grace window are recorded ``coalesced``, older ones
``missed``; at most ``MAX_RECORDED_MISSES`` of each kind are recorded per catch-up.

The policy in full: docs/api.md#misfire-policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterError, croniter

from tuner import SpecError

MAX_RECORDED_MISSES = 100


def check_cron(expr: str, *, field_name: str = "cron") -> str:
    """A stripped valid cron expression (5 fields, or 6 with seconds last; @daily etc.) or SpecError."""
    text = (expr or "").strip() if isinstance(expr, str) else expr
    if not isinstance(text, str) or not text:
        raise SpecError(f"{field_name} must be a cron expression such as '0 2 * * *', got {expr!r}")
    if len(text) > 200 or len(text.split()) > 6 or not croniter.is_valid(text):
        raise SpecError(f"{field_name}={expr!r} is not a valid cron expression (e.g. '0 2 * * *' = 02:00 daily)")
    try:  # valid syntax that never matches a date (e.g. '0 0 31 2 *') would never fire
        croniter(text, datetime(2000, 1, 1, tzinfo=timezone.utc)).get_next(datetime)
    except CroniterError:
        raise SpecError(f"{field_name}={expr!r} never fires (no date matches it)") from None
    return text


def check_timezone(name: str, *, field_name: str = "timezone") -> ZoneInfo:
    """The IANA zone ``name`` (e.g. 'Europe/Berlin', 'UTC') or SpecError naming the field."""
    if not isinstance(name, str) or not name.strip():
        raise SpecError(f"{field_name} must be an IANA time zone such as 'Europe/Berlin', got {name!r}")
    try:
        return ZoneInfo(name.strip())
    except (ZoneInfoNotFoundError, ValueError):
        raise SpecError(f"{field_name}={name!r} is not an IANA time zone (e.g. 'UTC', 'Europe/Berlin')") from None


def as_utc(moment: datetime) -> datetime:
    """An aware UTC datetime (SQLite returns naive datetimes; they are UTC by our convention)."""
    return moment.replace(tzinfo=timezone.utc) if moment.tzinfo is None else moment.astimezone(timezone.utc)


def next_fire(expr: str, tz_name: str, after: datetime) -> datetime:
    """The first fire strictly after ``after``, in UTC (cron evaluated in the schedule's zone)."""
    it = croniter(expr, as_utc(after).astimezone(ZoneInfo(tz_name)))
    return as_utc(it.get_next(datetime))


@dataclass
class FirePlan:
    run: datetime | None = None
    coalesced: list[datetime] = field(default_factory=list)
    missed: list[datetime] = field(default_factory=list)


def due_fires(expr: str, tz_name: str, *, anchor: datetime, now: datetime, limit: int) -> list[datetime]:
    """Fire times in (anchor, now], newest first, at most ``limit`` of them (UTC).

    A wall-clock time that happens twice when daylight saving time ends (02:30 on the last Sunday of
    October in Europe/Berlin) fires once, at its first occurrence, as cron does; a wall-clock time
    skipped when DST starts fires at the first instant after the gap (croniter's rule).
    """
    tz = ZoneInfo(tz_name)
    anchor, now = as_utc(anchor), as_utc(now)
    anchor_wall = anchor.astimezone(tz).replace(tzinfo=None)
    it = croniter(expr, now.astimezone(tz) + timedelta(microseconds=1))
    out: list[datetime] = []
    walls: list[datetime] = []
    while len(out) < limit:
        t = as_utc(it.get_prev(datetime))
        if t <= anchor:
            break
        wall = t.astimezone(tz).replace(tzinfo=None)
        if wall == anchor_wall:  # the repeat of a wall time already fired: skip it
            continue
        if walls and wall == walls[-1]:  # the same wall time twice in this window: keep the first
            out[-1] = t
            continue
        out.append(t)
        walls.append(wall)
    return out


def plan_fires(expr: str, tz_name: str, *, anchor: datetime, now: datetime, grace_s: float) -> FirePlan:
    """What to do with the fires due since ``anchor`` (see the module docstring for the policy)."""
    plan = FirePlan()
    cutoff = as_utc(now) - timedelta(seconds=grace_s)
    for t in due_fires(expr, tz_name, anchor=anchor, now=now, limit=2 * MAX_RECORDED_MISSES + 1):
        if t < cutoff:
            if len(plan.missed) == MAX_RECORDED_MISSES:
                break
            plan.missed.append(t)
        elif plan.run is None:
            plan.run = t
        elif len(plan.coalesced) < MAX_RECORDED_MISSES:
            plan.coalesced.append(t)
    return plan
