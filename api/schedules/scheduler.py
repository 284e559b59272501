"""The scheduler inside the coordinator: a thread that ticks every ``interval_s``.

Each tick: **fire** the due schedules (misfire policy ``_cron.plan_fires``; the fire claimed and its
sweeps created in one transaction, ``_launch.fire_schedule``, so exactly one replica launches each
fire), **check** fires whose sweeps have all ended (``_check.check_fire``), **deliver** due alerts to
webhooks (``webhook.deliver_due``). The sweeps are ordinary queued sweeps, run by the engine's runner.

Run on its own: ``python -m api.schedules.scheduler --database-url URL [--seconds N] [--interval S]``.
The design: docs/api.md#the-scheduler.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from api.schedules import _store
from api.schedules._check import check_fire
from api.schedules._cron import as_utc, plan_fires
from api.schedules._launch import fire_schedule
from api.schedules.webhook import DeliveryPolicy, DeliveryResult, Poster, deliver_due, post_json
from api.settings import Settings
from api.store import new_runner_id, session_scope
from api.store._models import utcnow

log = logging.getLogger("meshtune.schedules")


@dataclass
class TickReport:
    launched: list[tuple[int, int, datetime]] = field(default_factory=list)  # (fire, schedule, time) claimed here
    lost: list[tuple[int, datetime]] = field(default_factory=list)  # (schedule, fire time) another replica had
    recorded: list[tuple[int, datetime, str]] = field(default_factory=list)  # missed/coalesced it recorded
    finished: list[int] = field(default_factory=list)  # fires this replica checked and finished
    deliveries: list[DeliveryResult] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        *,
        sessions: Any,
        settings: Settings | None = None,
        replica_id: str | None = None,
        interval_s: float = 1.0,
        delivery: DeliveryPolicy | None = None,
        post: Poster = post_json,
        claim_delay_s: float = 0.0,
    ) -> None:
        self.sessions = sessions
        self.settings = settings or Settings()
        self.replica_id = replica_id or new_runner_id()
        self.interval_s = interval_s
        self.delivery = delivery or DeliveryPolicy(timeout_s=self.settings.webhook_timeout_s)
        self.post = post
        # Diagnostics only: wait this long between planning a fire and claiming it, which widens the
        # window in which two replicas race for the same fire (the replica test uses it).
        self.claim_delay_s = claim_delay_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- one tick ------------------------------------------------------------------------------

    def tick(self, now: datetime | None = None) -> TickReport:
        now = as_utc(now or utcnow())
        report = TickReport()
        self.fire_due(now, report)
        self.check_finished(report)
        # Alerts written by this tick's checks are due at once (they are stamped with the real clock).
        report.deliveries = deliver_due(self.sessions, now=max(now, utcnow()), policy=self.delivery, post=self.post)
        return report

    def fire_due(self, now: datetime, report: TickReport) -> None:
        with self.sessions() as s:
            schedules, _ = _store.list_schedules(s, enabled=True, limit=None)
        for schedule in schedules:
            try:
                self._fire_one(schedule.id, now, report)
            except Exception:  # one broken schedule must not stop the others
                log.exception("schedule %s: fire failed", schedule.id)

    def _fire_one(self, schedule_id: int, now: datetime, report: TickReport) -> None:
        with session_scope(self.sessions) as s:
            schedule = _store.get_schedule(s, schedule_id=schedule_id)
            if schedule is None or not schedule.enabled:
                return
            last = _store.latest_cron_fire_time(s, schedule_id=schedule.id)
            anchor = as_utc(schedule.active_since)
            if last is not None:
                anchor = max(anchor, as_utc(last))
            plan = plan_fires(schedule.cron, schedule.timezone, anchor=anchor, now=now,
                              grace_s=schedule.misfire_grace_s)
            if self.claim_delay_s and (plan.run or plan.missed or plan.coalesced):
                time.sleep(self.claim_delay_s)
            for status, times in (("missed", plan.missed), ("coalesced", plan.coalesced)):
                for t in times:
                    note = (f"due {t.isoformat()}, coordinator caught up at {now.isoformat()}: "
                            + ("older than the misfire grace window" if status == "missed"
                               else f"folded into the run of {plan.run.isoformat() if plan.run else '-'}"))
                    if _store.insert_fire(s, schedule_id=schedule.id, fire_time=t, status=status,
                                          claimed_by=self.replica_id, error=note) is not None:
                        report.recorded.append((schedule.id, t, status))
            if plan.run is not None:
                fire_id = fire_schedule(s, schedule=schedule, fire_time=plan.run, claimed_by=self.replica_id)
                if fire_id is None:
                    report.lost.append((schedule.id, plan.run))
                else:
                    report.launched.append((fire_id, schedule.id, plan.run))

    def check_finished(self, report: TickReport) -> None:
        with self.sessions() as s:
            fire_ids = [f.id for f in _store.running_fires(s)]
        for fire_id in fire_ids:
            try:
                with session_scope(self.sessions) as s:
                    fire = _store.get_fire(s, fire_id=fire_id)
                    if fire is None or fire.status != "running":
                        continue
                    schedule = _store.get_schedule(s, schedule_id=fire.schedule_id)
                    if check_fire(s, fire=fire, schedule=schedule):
                        report.finished.append(fire_id)
            except Exception:
                log.exception("fire %s: regression check failed", fire_id)

    # --- the background thread ---------------------------------------------------------------

    def start(self) -> None:
        assert self._thread is None, "scheduler already started"
        self._thread = threading.Thread(target=self._loop, name="meshtune-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # the database may be briefly unreachable: log and try again next tick
                log.exception("scheduler tick failed")
            # Tick on wall-clock multiples of the interval, so a fire is claimed within one interval.
            self._stop.wait(self.interval_s - (time.time() % self.interval_s))


def main(argv: list[str] | None = None) -> int:
    """Run only the scheduler against a database; prints one JSON line per claim attempt."""
    parser = argparse.ArgumentParser(prog="python -m api.schedules.scheduler")
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--seconds", type=float, default=None, help="stop after this long (default: run forever)")
    parser.add_argument("--start-at", type=float, default=None, help="UNIX time to begin ticking at")
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--replica-id", default=None)
    parser.add_argument("--claim-delay", type=float, default=0.0,
                        help="diagnostics: seconds between planning and claiming a fire (widens races)")
    args = parser.parse_args(argv)
    from api.store import create_engine, make_sessionmaker

    engine = create_engine(args.database_url)
    scheduler = Scheduler(sessions=make_sessionmaker(engine), replica_id=args.replica_id, interval_s=args.interval,
                          claim_delay_s=args.claim_delay)
    if args.start_at is not None:
        time.sleep(max(0.0, args.start_at - time.time()))
    end = None if args.seconds is None else time.time() + args.seconds
    try:
        while end is None or time.time() < end:
            report = scheduler.tick()
            for fire_id, schedule_id, t in report.launched:
                print(json.dumps({"replica": scheduler.replica_id, "won": True, "fire_id": fire_id,
                                  "schedule_id": schedule_id, "fire_time": t.isoformat()}), flush=True)
            for schedule_id, t in report.lost:
                print(json.dumps({"replica": scheduler.replica_id, "won": False, "schedule_id": schedule_id,
                                  "fire_time": t.isoformat()}), flush=True)
            time.sleep(args.interval - (time.time() % args.interval))
    finally:
        engine.dispose()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
