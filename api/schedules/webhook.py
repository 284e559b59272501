"""Alert delivery: one JSON POST per fire to the schedule's webhook, retried with backoff, every
attempt recorded (``schedule_alert_deliveries``).

Delivery is at-least-once: a replica leases a fire's due alerts (their next attempt is pushed
``lease_s`` ahead) before posting, so replicas do not post the same alerts at once; a replica that
dies mid-post leaves them to be posted again after the lease. Every payload carries
``idempotency_key`` (fire id + alert ids) for receivers that must not act twice.

Retry rule: attempt ``n`` failing (connection error, timeout, or a non-2xx status) is retried after
``min(retry_base_s * 2**(n-1), retry_max_s)``; after ``max_attempts`` the alerts are marked
``failed`` (still listed by GET /api/alerts with their last error; nothing is deleted).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import httpx

from api.redact import mask_url
from api.schedules import _store
from api.schedules._urls import RefusedTarget, check_target
from api.schedules.models import Schedule, ScheduleAlert, ScheduleFire

log = logging.getLogger("meshtune.schedules")

Poster = Callable[[str, dict[str, Any], float], tuple[bool, int | None, str | None]]


def post_json(url: str, payload: dict[str, Any], timeout_s: float) -> tuple[bool, int | None, str | None]:
    """POST ``payload`` as JSON; (ok, status code, error). Never raises for a failed delivery. The
    target is re-checked first (its name may resolve elsewhere now). The recorded error is the status
    code and a short reason only — never the response body, which an internal service could fill
    with secrets that alerts would then show to every reader."""
    try:
        check_target(url, strict=True)
    except RefusedTarget as exc:
        return False, None, f"refused: {exc}"
    try:
        response = httpx.post(url, json=payload, timeout=timeout_s, follow_redirects=False,
                              headers={"User-Agent": "meshtune-alerts/1"})
    except httpx.HTTPError as exc:
        return False, None, type(exc).__name__
    if 200 <= response.status_code < 300:
        return True, response.status_code, None
    return False, response.status_code, f"HTTP {response.status_code} {response.reason_phrase}"[:80]


def alert_json(alert: ScheduleAlert) -> dict[str, Any]:
    return {
        "id": alert.id, "kind": alert.kind, "layout": alert.layout_key, "message": alert.message,
        "ratio": alert.ratio, "ratio_low": alert.ratio_low, "ratio_high": alert.ratio_high,
        "change": None if alert.ratio is None else alert.ratio - 1.0, "p_value": alert.p_value,
        "env_changes": (alert.detail or {}).get("env_changes", {}), "detail": alert.detail,
    }


def payload(schedule: Schedule, fire: ScheduleFire, alerts: list[ScheduleAlert]) -> dict[str, Any]:
    kinds = sorted({a.kind for a in alerts})
    return {
        "event": "meshtune.schedule.alerts",
        "idempotency_key": f"fire-{fire.id}-alerts-{'-'.join(str(a.id) for a in alerts)}",
        "schedule": {"id": schedule.id, "name": schedule.name, "cron": schedule.cron, "timezone": schedule.timezone},
        "fire": {"id": fire.id, "fire_time": fire.fire_time.isoformat(), "trigger": fire.trigger,
                 "status": fire.status, "sweep_ids": fire.sweep_ids, "env": fire.env, "env_changes": fire.env_changes},
        "summary": f"{len(alerts)} alert(s): {', '.join(kinds)}",
        "alerts": [alert_json(a) for a in alerts],
    }


@dataclass
class DeliveryPolicy:
    timeout_s: float = 5.0
    retry_base_s: float = 5.0
    retry_max_s: float = 3600.0
    max_attempts: int = 8
    lease_s: float = 60.0

    def backoff(self, attempt: int) -> float:
        return min(self.retry_base_s * 2 ** max(attempt - 1, 0), self.retry_max_s)


@dataclass
class DeliveryResult:
    fire_id: int
    alert_ids: list[int]
    attempt: int
    ok: bool
    status_code: int | None
    error: str | None


def deliver_due(sessions: Any, *, now: datetime, policy: DeliveryPolicy, post: Poster = post_json) -> list[DeliveryResult]:
    """One attempt for every fire whose alerts are due; the POST happens outside any transaction."""
    from api.store import session_scope

    results = []
    with sessions() as s:
        fire_ids = _store.due_delivery_fires(s, now=now)
    for fire_id in fire_ids:
        with session_scope(sessions) as s:
            alerts = _store.lease_delivery(s, fire_id=fire_id, now=now, lease_s=policy.lease_s)
            if not alerts:
                continue
            fire = _store.get_fire(s, fire_id=fire_id)
            schedule = _store.get_schedule(s, schedule_id=fire.schedule_id)
            url = schedule.webhook_url
            body = payload(schedule, fire, alerts) if url else None
            ids, attempt = [a.id for a in alerts], max(a.attempts for a in alerts)
        if url:
            ok, code, error = post(url, body, policy.timeout_s)
        else:  # the webhook was removed after the alert was written
            ok, code, error = False, None, "the schedule has no webhook_url any more"
        give_up = not ok and (attempt >= policy.max_attempts or not url)
        if not ok:
            log.warning("webhook for fire %s attempt %s failed: %s", fire_id, attempt, error)
        with session_scope(sessions) as s:
            _store.record_delivery(
                s, fire_id=fire_id, alert_ids=ids, attempt=attempt, url=mask_url(url) or "", ok=ok, status_code=code,
                error=error, next_attempt_at=now + timedelta(seconds=policy.backoff(attempt)), give_up=give_up,
            )
        results.append(DeliveryResult(fire_id, ids, attempt, ok, code, error))
    return results
