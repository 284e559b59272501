"""Scheduled sweeps: schedules (cron + time zone), the scheduler that fires them exactly once across
coordinator replicas, regression detection against each schedule's history, and webhook alerts.

- ``models``: Schedule, ScheduleFire, ScheduleAlert, AlertDelivery (on the store's ``Base``).
- ``scheduler.Scheduler``: the coordinator's scheduling thread (fire -> check -> deliver per tick).
- ``schemas``: request/response models; ``service``: what the routes, dashboard and CLI call;
  ``routes``: the thin HTTP layer.
"""

from api.schedules.models import (
    ALERT_KINDS,
    FIRE_STATUSES,
    SCHEDULE_KINDS,
    AlertDelivery,
    Schedule,
    ScheduleAlert,
    ScheduleFire,
)
from api.schedules.scheduler import Scheduler, TickReport
from api.schedules.webhook import DeliveryPolicy

__all__ = [
    "ALERT_KINDS",
    "FIRE_STATUSES",
    "SCHEDULE_KINDS",
    "AlertDelivery",
    "DeliveryPolicy",
    "Schedule",
    "ScheduleAlert",
    "ScheduleFire",
    "Scheduler",
    "TickReport",
]
