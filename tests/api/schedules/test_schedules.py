"""Schedules: bad input (API 422 / CLI exit 2), the misfire policy, re-measurement through the engine,
no alert for plain noise, webhook delivery with retries that never lose an alert, trends."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from api import store
from api.engine import SweepRunner
from api.schedules import DeliveryPolicy, Scheduler, _store
from api.schedules import service as svc
from api.schedules.schemas import ScheduleIn
from api.settings import Settings
from api.store import Trial
from tests.helpers.schedules import SIM_TEMPLATE

UTC = timezone.utc




@pytest.fixture
def allow_private_webhooks(monkeypatch):
    """The local test receiver listens on 127.0.0.1, which is refused unless the setting allows it."""
    monkeypatch.setenv("MESHTUNE_WEBHOOK_ALLOW_PRIVATE", "true")


def run_sweeps(url: str, sessions, sweep_ids: list[int]) -> None:
    runner = SweepRunner(Settings(database_url=url), sessions=sessions)
    for sweep_id in sweep_ids:
        assert runner.run_sweep(sweep_id).status == "completed"


def make_schedule(sessions, **fields) -> int:
    data = {"name": "s", "cron": "0 2 * * *", "timezone": "UTC", "template": SIM_TEMPLATE, **fields}
    with sessions() as s:
        return svc.create_schedule(s, data=ScheduleIn.model_validate(data), owner="test").id


def set_active_since(sessions, schedule_id: int, when: datetime) -> None:
    with store.session_scope(sessions) as s:
        _store.update_schedule(s, schedule_id=schedule_id, values={"active_since": when})


def fires_by_status(sessions, schedule_id: int) -> dict[str, list[datetime]]:
    out: dict[str, list[datetime]] = {}
    with sessions() as s:
        for f in _store.list_fires(s, schedule_id=schedule_id, limit=None)[0]:
            out.setdefault(f.status, []).append(f.fire_time.replace(tzinfo=UTC))
    return {k: sorted(v) for k, v in out.items()}


# --- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, field, needle",
    [
        ({"cron": "61 2 * * *"}, "cron", "not a valid cron"),
        ({"cron": "every night"}, "cron", "not a valid cron"),
        ({"timezone": "Mars/Olympus_Mons"}, "timezone", "not an IANA time zone"),
        ({"webhook_url": "ftp://example.com/hook"}, "webhook_url", "not an http:// or https:// URL"),
        ({"webhook_url": "javascript:alert(1)"}, "webhook_url", "not an http:// or https:// URL"),
        ({"template": {**SIM_TEMPLATE, "model": "no-such-model"}}, "template", "model.preset='no-such-model'"),
        ({"template": None, "remeasure": {"sweep_id": 987654}}, "remeasure.sweep_id", "987654"),
        ({"remeasure": {"sweep_id": 1}}, "template/remeasure", "exactly one"),
        ({"regression": {"alpha": 2}}, "regression.alpha", "alpha"),
        ({"regression": {"history_nights": 3, "min_history_nights": 4}}, "regression.min_history_nights",
         "exceeds regression.history_nights=3"),
        ({"template": {**SIM_TEMPLATE, "space": {"tp": [3]}}}, "template.space.tp", "no valid layout"),
        ({"template": {**SIM_TEMPLATE, "backend": "nosuch:mod"}}, "template.backend", "cannot import module"),
        ({"template": {**SIM_TEMPLATE, "search": {"learn_from": [987654]}}}, "template.search.learn_from[0]",
         "sweep 987654 does not exist"),
    ],
)
def test_bad_schedule_is_422_naming_the_field(client, change, field, needle) -> None:
    body = {"name": "bad", "cron": "0 2 * * *", "timezone": "UTC", "template": SIM_TEMPLATE, **change}
    r = client.post("/api/schedules", json=body)
    assert r.status_code == 422, r.text
    text = json.dumps(r.json())
    assert field in text and needle in text, text
    assert client.get("/api/schedules").json()["total"] == 0  # nothing stored


def test_unknown_ids_are_404_and_bad_queries_422(client) -> None:
    assert client.get("/api/schedules/4242").status_code == 404
    assert client.post("/api/schedules/4242/run-now").status_code == 404
    assert client.delete("/api/schedules/4242").status_code == 404
    assert client.get("/api/trends", params={"schedule_id": 4242}).status_code == 404
    assert client.get("/api/alerts", params={"kind": "bogus"}).status_code == 422
    created = client.post("/api/schedules", json={"name": "ok", "cron": "0 2 * * *", "template": SIM_TEMPLATE})
    assert created.status_code == 201, created.text
    sid = created.json()["id"]
    r = client.patch(f"/api/schedules/{sid}", json={"timezone": "Nowhere/Land"})
    assert r.status_code == 422 and "timezone" in r.text
    assert client.get(f"/api/schedules/{sid}").json()["timezone"] == "UTC"  # unchanged


def test_crud_over_http(client) -> None:
    body = {"name": "nightly", "cron": "30 2 * * *", "timezone": "Europe/Berlin", "template": SIM_TEMPLATE,
            "webhook_url": "https://hooks.example.com/x"}
    created = client.post("/api/schedules", json=body).json()
    next_fire = datetime.fromisoformat(created["next_fire_at"])
    assert next_fire.astimezone(ZoneInfo("Europe/Berlin")).strftime("%H:%M") in ("02:30", "03:00")  # DST gap
    sid = created["id"]
    assert created["policy"]["min_history_nights"] == 2  # the nightly-means test by default
    assert client.patch(f"/api/schedules/{sid}", json={"enabled": False}).json()["next_fire_at"] is None
    assert [s["id"] for s in client.get("/api/schedules", params={"enabled": False}).json()["items"]] == [sid]
    fire = client.post(f"/api/schedules/{sid}/run-now").json()  # works while disabled
    assert fire["trigger"] == "manual" and fire["status"] == "running" and len(fire["sweep_ids"]) == 1
    sweep = client.get(f"/api/sweeps/{fire['sweep_ids'][0]}").json()
    assert sweep["status"] == "queued" and sweep["owner"] == f"schedule:{sid}"
    assert client.get(f"/api/schedules/{sid}/fires").json()["total"] == 1
    assert client.delete(f"/api/schedules/{sid}").status_code == 204
    assert client.get(f"/api/schedules/{sid}").status_code == 404
    assert client.get(f"/api/sweeps/{fire['sweep_ids'][0]}").status_code == 200  # its sweeps are kept


def test_cli_errors_exit_2_and_commands_work(db, monkeypatch, capsys, tmp_path) -> None:
    from api.cli import main

    url = db.url
    monkeypatch.setenv("MESHTUNE_DATABASE_URL", url)
    spec = tmp_path / "t.json"
    spec.write_text(json.dumps(SIM_TEMPLATE))
    base = ["schedule", "add", "--name", "n", "--template", str(spec)]
    assert main([*base, "--cron", "0 25 * * *"]) == 2
    assert "cron" in capsys.readouterr().err
    assert main([*base, "--cron", "0 2 * * *", "--timezone", "Atlantis/Capital"]) == 2
    assert "timezone" in capsys.readouterr().err
    assert main([*base, "--cron", "0 2 * * *", "--webhook", "file:///etc/passwd"]) == 2
    assert "webhook_url" in capsys.readouterr().err
    assert main(["schedule", "add", "--name", "n", "--cron", "0 2 * * *", "--remeasure", "555"]) == 2
    assert "remeasure.sweep_id=555" in capsys.readouterr().err
    assert main(["schedule", "run-now", "777"]) == 2
    assert "schedule 777" in capsys.readouterr().err
    assert main([*base, "--cron", "0 2 * * *", "--timezone", "Asia/Tokyo", "--json"]) == 0
    sid = json.loads(capsys.readouterr().out)["id"]
    assert main(["schedule", "list", "--json"]) == 0
    assert [s["timezone"] for s in json.loads(capsys.readouterr().out)["items"]] == ["Asia/Tokyo"]
    assert main(["schedule", "run-now", str(sid)]) == 0
    assert "queued sweep" in capsys.readouterr().out
    assert main(["schedule", "rm", str(sid)]) == 0
    assert main(["schedule", "rm", str(sid)]) == 2


# --- misfire policy -------------------------------------------------------------------------------


def test_misfire_policy_runs_latest_within_grace_once_and_records_the_rest(db) -> None:
    """Nightly 02:00 Berlin, coordinator down from Jan 1 to Jan 4 03:30 Berlin, grace 2 h: the
    Jan 4 fire runs (1.5 h late); Jan 2 and Jan 3 are recorded missed. A later tick adds nothing."""
    sessions = db.sessions
    sid = make_schedule(sessions, cron="0 2 * * *", timezone="Europe/Berlin", misfire_grace_s=7200)
    berlin = ZoneInfo("Europe/Berlin")
    set_active_since(sessions, sid, datetime(2026, 1, 1, 12, 0, tzinfo=berlin))
    scheduler = Scheduler(sessions=sessions, replica_id="r1")
    now = datetime(2026, 1, 4, 3, 30, tzinfo=berlin)
    report = scheduler.tick(now)
    fires = fires_by_status(sessions, sid)
    assert fires["running"] == [datetime(2026, 1, 4, 1, 0, tzinfo=UTC)]  # 02:00 CET = 01:00 UTC
    assert fires["missed"] == [datetime(2026, 1, 2, 1, 0, tzinfo=UTC), datetime(2026, 1, 3, 1, 0, tzinfo=UTC)]
    assert len(report.launched) == 1 and "coalesced" not in fires
    assert scheduler.tick(now + timedelta(minutes=5)).launched == []
    assert fires_by_status(sessions, sid) == fires


def test_misfire_policy_coalesces_fires_within_grace_and_runs_nothing_too_late(db) -> None:
    sessions = db.sessions
    every_10 = make_schedule(sessions, cron="*/10 * * * *", misfire_grace_s=3600)
    hourly = make_schedule(sessions, cron="0 * * * *", misfire_grace_s=600)
    start = datetime(2026, 3, 1, 9, 58, tzinfo=UTC)
    for sid in (every_10, hourly):
        set_active_since(sessions, sid, start)
    scheduler = Scheduler(sessions=sessions, replica_id="r1")
    scheduler.tick(datetime(2026, 3, 1, 10, 45, 30, tzinfo=UTC))  # down 10:00-10:45
    fires = fires_by_status(sessions, every_10)
    assert fires["running"] == [datetime(2026, 3, 1, 10, 40, tzinfo=UTC)]  # the latest runs, once
    assert fires["coalesced"] == [datetime(2026, 3, 1, 10, m, tzinfo=UTC) for m in (0, 10, 20, 30)]
    late = fires_by_status(sessions, hourly)  # 10:00 is 45 min late, grace 10 min: missed, not run
    assert late == {"missed": [datetime(2026, 3, 1, 10, 0, tzinfo=UTC)]}
    with sessions() as s:
        assert len(_store.fire_measurements(s, sweep_ids=[])) == 0
        assert store.list_sweeps(s)[1] == 1  # exactly one sweep was created in all


def test_disabled_time_is_not_owed_and_manual_runs_do_not_move_the_anchor(db) -> None:
    sessions = db.sessions
    sid = make_schedule(sessions, cron="0 * * * *", misfire_grace_s=7200, enabled=False)
    scheduler = Scheduler(sessions=sessions, replica_id="r1")
    with sessions() as s:
        svc.run_now(s, schedule_id=sid, by="me")  # manual fire while disabled
    assert scheduler.tick(datetime.now(UTC) + timedelta(hours=5)).launched == []  # disabled: no cron fire
    with store.session_scope(sessions) as s:
        _store.update_schedule(s, schedule_id=sid, values={"enabled": True})  # active_since = now
    fires = fires_by_status(sessions, sid)
    assert list(fires) == ["running"] and len(fires["running"]) == 1  # only the manual one
    # a minute past the next full hour: exactly one cron time since enabling, whatever the clock says now
    # (now + 61 min would hold two hours when the test runs in an hour's last minute)
    with sessions() as s:
        since = _store.get_schedule(s, schedule_id=sid).active_since
    next_hour = since.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    report = scheduler.tick(next_hour + timedelta(minutes=1))
    assert len(report.launched) == 1 and report.recorded == []  # the next hour runs, nothing "missed"


# --- re-measurement through the engine, and noise ---------------------------------------------------


def test_remeasure_runs_exact_layouts_and_plain_noise_raises_no_alert(db, webhook_receiver, allow_private_webhooks) -> None:
    """Re-measure the top 2 layouts of a sweep 3 times per run, 4 runs with nothing changed (the
    simulate backend's 3% lognormal noise is the only difference): every layout is compared with
    its history, none is flagged, nothing is POSTed."""
    url, sessions = db.url, db.sessions
    with sessions() as s:
        from api.spec import SweepSpec
        from api.sweeps.service import create_sweep

        source = create_sweep(s, spec=SweepSpec.model_validate({**SIM_TEMPLATE, "name": "source"}), owner="t").id
    run_sweeps(url, sessions, [source])
    with sessions() as s:
        from api.ranking.service import ranking

        top2 = [r.layout_key for r in ranking(s, sweep_id=source).rows[:2]]
    sid = make_schedule(sessions, template=None, remeasure={"sweep_id": source, "top_k": 2, "repeats": 3},
                        webhook_url=webhook_receiver.url)
    scheduler = Scheduler(sessions=sessions, replica_id="r1")
    for _ in range(4):
        with sessions() as s:
            fire = svc.run_now(s, schedule_id=sid, by="test")
        assert len(fire.sweep_ids) == 1  # one sweep lists both layouts (search.layouts)
        with sessions() as s:
            launched = store.get_sweep(s, sweep_id=fire.sweep_ids[0])
        assert launched.sampler == "layouts" and launched.spec["search"]["repeats"] == 3
        assert len(launched.spec["search"]["layouts"]) == 2
        run_sweeps(url, sessions, fire.sweep_ids)
        assert scheduler.tick().finished == [fire.id]
        with sessions() as s:
            measured = _store.fire_measurements(s, sweep_ids=fire.sweep_ids)
        assert sorted({t.layout_key for t in measured}) == sorted(top2)  # exactly those layouts ...
        assert len(measured) == 6  # ... 3 times each
    with sessions() as s:
        fires = _store.list_fires(s, schedule_id=sid, limit=None)[0]
        verdicts = [c["verdict"] for f in fires for c in f.comparisons]
        # runs 1-2: no history, then one night (cannot tell a slow night from a slowdown)
        assert verdicts.count("unchanged") == 4 and verdicts.count("insufficient") == 4
        judged = sorted((c["history_nights"], c["history_n"], c["method"]) for f in fires for c in f.comparisons
                        if c["verdict"] == "unchanged")
        assert judged == [(2, 6, "nightly-means")] * 2 + [(3, 9, "nightly-means")] * 2  # grouped by night
        assert _store.list_alerts(s, schedule_id=sid)[1] == 0
        assert all(f.env and f.env["backend"] == "simulate" for f in fires)
    assert webhook_receiver.received == []
    with sessions() as s:
        trend = svc.trends(s, schedule_id=sid)
    assert len(trend["points"]) == 8 and set(trend["layouts"]) == set(top2)
    assert {p["verdict"] for p in trend["points"]} == {"insufficient", "unchanged"}


def test_history_is_grouped_by_previous_fire_for_the_nightly_means_test() -> None:
    """Two previous fires (one with two sweeps) become two nights per layout, newest first; a trial
    of a sweep that belongs to no previous fire is not history. (That check_fire stores the
    nightly-means verdicts is asserted on real fires in the re-measure and speed-up tests.)"""
    from api.schedules import _check
    from api.schedules.models import ScheduleFire
    from tuner import compare_night

    newer, older = ScheduleFire(id=2, sweep_ids=[20, 21]), ScheduleFire(id=1, sweep_ids=[10])
    trials = [Trial(sweep_id=sw, layout_key=key, tokens_per_s=v) for sw, key, v in [
        (10, "a", 100.0), (10, "a", 102.0), (10, "b", 50.0), (20, "a", 90.0), (21, "a", 91.0), (21, "b", 55.0),
        (20, "a", 92.0), (99, "a", 1.0),  # sweep 99: not a previous fire of this schedule
    ]]
    grouped = _check.history_by_fire([newer, older], trials)
    assert grouped == {"a": [[90.0, 91.0, 92.0], [100.0, 102.0]], "b": [[55.0], [50.0]]}
    (c,) = compare_night({"a": [95.0, 96.0, 94.0]}, grouped)
    assert c.method == "nightly-means" and c.history_nights == 2 and c.history_n == 5 and c.verdict == "unchanged"


# --- alerts and webhooks ----------------------------------------------------------------------------


def _failed_fire(sessions, url: str, webhook: str) -> tuple[int, int]:
    """A schedule whose source sweep measured nothing: its fire fails with a failure alert."""
    with sessions() as s:
        from api.spec import SweepSpec
        from api.sweeps.service import create_sweep

        empty = create_sweep(s, spec=SweepSpec.model_validate({**SIM_TEMPLATE, "name": "never-run"}), owner="t").id
    sid = make_schedule(sessions, template=None, remeasure={"sweep_id": empty, "top_k": 1, "repeats": 2},
                        webhook_url=webhook)
    with sessions() as s:
        fire = svc.run_now(s, schedule_id=sid, by="test")
    assert fire.status == "failed" and "no measured layout" in fire.error
    return sid, fire.id


def test_failing_webhook_is_retried_recorded_and_then_delivered(db, webhook_receiver, allow_private_webhooks) -> None:
    url, sessions = db.url, db.sessions
    sid, fire_id = _failed_fire(sessions, url, webhook_receiver.url)
    webhook_receiver.statuses = [500, 503]  # two failures, then 200
    scheduler = Scheduler(sessions=sessions, replica_id="r1",
                          delivery=DeliveryPolicy(timeout_s=2, retry_base_s=60, max_attempts=5))
    t0 = datetime.now(UTC)
    assert [d.ok for d in scheduler.tick(t0).deliveries] == [False]
    assert scheduler.tick(t0 + timedelta(seconds=30)).deliveries == []  # backoff: 60 s
    assert [d.ok for d in scheduler.tick(t0 + timedelta(seconds=61)).deliveries] == [False]
    assert scheduler.tick(t0 + timedelta(seconds=150)).deliveries == []  # backoff: 120 s
    assert [d.ok for d in scheduler.tick(t0 + timedelta(seconds=190)).deliveries] == [True]
    assert [r["status"] for r in webhook_receiver.received] == [500, 503, 200]
    body = webhook_receiver.received[-1]["json"]
    assert webhook_receiver.received[-1]["content_type"] == "application/json"
    assert body["schedule"]["id"] == sid and body["fire"]["id"] == fire_id
    assert body["alerts"][0]["kind"] == "failure" and "no measured layout" in body["alerts"][0]["message"]
    with sessions() as s:
        alerts = _store.list_alerts(s, schedule_id=sid)[0]
        assert [(a.delivery_status, a.attempts) for a in alerts] == [("delivered", 3)]
        log = _store.list_deliveries(s, fire_id=fire_id)
        assert sorted((d.attempt, d.ok, d.status_code) for d in log) == [(1, False, 500), (2, False, 503), (3, True, 200)]


def test_dead_webhook_gives_up_without_losing_the_alert(db, client, allow_private_webhooks) -> None:
    import socket

    with socket.socket() as probe:  # a port with nothing listening
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}/hook"
    url, sessions = db.url, db.sessions
    sid, fire_id = _failed_fire(sessions, url, dead)
    scheduler = Scheduler(sessions=sessions, replica_id="r1",
                          delivery=DeliveryPolicy(timeout_s=1, retry_base_s=1, max_attempts=3))
    t = datetime.now(UTC)
    for _ in range(6):
        t += timedelta(seconds=10)
        scheduler.tick(t)
    listed = client.get("/api/alerts", params={"schedule_id": sid}).json()
    assert listed["total"] == 1
    alert = listed["items"][0]
    assert alert["delivery_status"] == "failed" and alert["attempts"] == 3
    assert "ConnectError" in alert["last_error"] and alert["kind"] == "failure"
    with sessions() as s:
        assert len(_store.list_deliveries(s, fire_id=fire_id)) == 3


def test_router_runs_the_scheduler_only_beside_the_engine(db) -> None:
    from api.main import create_app

    url = db.url
    for run_engine, enabled, expected in ((True, True, True), (True, False, False), (False, True, False)):
        app = create_app(Settings(database_url=url, scheduler_enabled=enabled), run_engine=run_engine)
        with TestClient(app):
            assert (app.state.scheduler is not None) is expected
            if expected:
                assert app.state.scheduler._thread.is_alive()



def test_speedup_is_reported_as_improvement_with_env_change_and_marked_in_trends(db, client, webhook_receiver, allow_private_webhooks) -> None:
    """Simulated runs (labelled so): the cluster's peak FLOP/s doubles on night 5, the layout's
    tokens/s doubles; the alert is an improvement against the 4 past nightly means that names the
    changed fingerprint key."""
    from api.schedules._launch import pinned_space
    from tuner import Layout

    url, sessions = db.url, db.sessions
    one_rank = {**SIM_TEMPLATE, "cluster": {"preset": "cpu-local", "devices_per_node": 1},
                "space": pinned_space(Layout()),
                "search": {"sampler": "grid", "max_trials": 1, "warm_start_top_k": 0, "repeats": 3,
                           "remeasure_top_k": 1}}
    sid = make_schedule(sessions, template=one_rank, webhook_url=webhook_receiver.url)
    scheduler = Scheduler(sessions=sessions, replica_id="r1")
    fire_ids = []
    for night in range(5):
        if night == 4:
            faster = {**one_rank, "cluster": {**one_rank["cluster"], "peak_flops": 1e11}}
            with store.session_scope(sessions) as s:
                _store.update_schedule(s, schedule_id=sid, values={"template": faster})
                # the previous run's measurements carry a fingerprint that differs in one key (as
                # before an upgrade)
                prev = _store.get_fire(s, fire_id=fire_ids[-1])
                s.execute(sa.update(Trial).where(Trial.sweep_id.in_(prev.sweep_ids))
                          .values(env={**prev.env, "source": "model v0"}))
        with sessions() as s:
            fire = svc.run_now(s, schedule_id=sid, by="test")
        run_sweeps(url, sessions, fire.sweep_ids)
        assert scheduler.tick().finished == [fire.id]
        fire_ids.append(fire.id)

    alerts = client.get("/api/alerts", params={"schedule_id": sid}).json()["items"]
    assert [a["kind"] for a in alerts] == ["improvement"]
    (alert,) = alerts
    assert alert["layout_key"] == Layout().key and alert["fire_id"] == fire_ids[4]
    assert 1.8 < alert["ratio_low"] < alert["ratio"] < alert["ratio_high"] < 2.2
    assert alert["detail"]["env_changes"] == {"source": {"before": "model v0", "after": "tuner analytical model"}}
    assert "faster" in alert["message"] and "source: 'model v0' -> 'tuner analytical model'" in alert["message"]
    assert alert["detail"]["method"] == "nightly-means" and alert["detail"]["history_nights"] == 4
    assert "4 nights, tested on nightly means" in alert["message"]
    assert alert["detail"]["simulated"] is True and alert["delivery_status"] == "delivered"
    assert webhook_receiver.received[0]["json"]["alerts"][0]["kind"] == "improvement"

    trend = client.get("/api/trends", params={"schedule_id": sid}).json()
    assert [p["verdict"] for p in trend["points"]] == ["insufficient"] * 2 + ["unchanged"] * 2 + ["improvement"]
    assert trend["points"][4]["alert_id"] == alert["id"] and trend["points"][4]["simulated"] is True
    assert trend["points"][4]["best_tokens_per_s"] > 1.8 * trend["points"][3]["median_tokens_per_s"]


JUNK = [
    None, 0, "x", [], {}, {"name": "n"}, {"name": "n", "cron": 5, "template": SIM_TEMPLATE},
    {"name": "n", "cron": "0 0 31 2 *", "template": SIM_TEMPLATE},  # valid syntax, never fires
    {"name": "n", "cron": "0 2 * * *", "timezone": "../../etc/passwd", "template": SIM_TEMPLATE},
    {"name": "n", "cron": "0 2 * * *", "timezone": "\u0000", "template": SIM_TEMPLATE},
    {"name": "n", "cron": "0 2 * * *", "timezone": "x" * 500, "template": SIM_TEMPLATE},
    {"name": "n", "cron": "0 2 * * *", "webhook_url": "http://" + "a" * 3000, "template": SIM_TEMPLATE},
    {"name": "n", "cron": "0 2 * * *", "webhook_url": "https://", "template": SIM_TEMPLATE},
    {"name": "n", "cron": "0 2 * * *", "remeasure": {"sweep_id": 10**30}},
    {"name": "n", "cron": "0 2 * * *", "remeasure": {"sweep_id": 1, "repeats": 1}},
    {"name": "n", "cron": "0 2 * * *", "template": {**SIM_TEMPLATE, "search": {"repeats": 1}}},
    {"name": "n", "cron": "0 2 * * *", "template": SIM_TEMPLATE, "misfire_grace_s": -1},
    {"name": "n", "cron": "0 2 * * *", "template": SIM_TEMPLATE, "regression": {"min_repeats": 1}},
    {"name": "n", "cron": "0 2 * * *", "template": SIM_TEMPLATE, "regression": {"min_history_nights": 0}},
    {"name": "n", "cron": "0 2 * * *", "template": SIM_TEMPLATE, "regression": {"min_history_nights": True}},
    {"name": "n", "cron": "0 2 * * *", "template": SIM_TEMPLATE, "bogus": 1},
]


def test_junk_schedules_are_422_never_500(client) -> None:
    for body in JUNK:
        r = client.post("/api/schedules", json=body)
        assert r.status_code == 422, (body, r.status_code, r.text)
        assert r.json()["errors"][0]["field"] if "errors" in r.json() else r.json()["detail"]
    sid = client.post("/api/schedules", json={"name": "ok", "cron": "0 2 * * *", "template": SIM_TEMPLATE}).json()["id"]
    for patch in ({"cron": "0 0 30 2 *"}, {"enabled": None}, {"misfire_grace_s": 0}, {"webhook_url": "gopher://x"},
                  {"template": SIM_TEMPLATE}, {"regression": {"alpha": 0}}):
        r = client.patch(f"/api/schedules/{sid}", json=patch)
        assert r.status_code == 422, (patch, r.status_code, r.text)
    for query in ("schedule_id=0", "schedule_id=abc", "runs=0", "runs=100000", "layout=" + "l" * 500):
        assert client.get(f"/api/trends?{query}").status_code == 422, query
    assert client.get("/api/alerts?limit=0").status_code == 422
    assert client.get(f"/api/schedules/{sid}/fires?status=bogus").status_code == 422
    assert client.get("/api/schedules").json()["total"] == 1


def test_daylight_saving_nights_fire_once() -> None:
    """02:30 Berlin: skipped on 29 Mar 2026 (fires at 03:00 CEST instead), twice on 25 Oct 2026 (fires once)."""
    from api.schedules._cron import due_fires

    def due(a: datetime, b: datetime) -> list[datetime]:
        return sorted(due_fires("30 2 * * *", "Europe/Berlin", anchor=a, now=b, limit=10))

    assert due(datetime(2026, 3, 28, 12, tzinfo=UTC), datetime(2026, 3, 29, 12, tzinfo=UTC)) == [
        datetime(2026, 3, 29, 1, 0, tzinfo=UTC)]
    assert due(datetime(2026, 10, 24, 12, tzinfo=UTC), datetime(2026, 10, 25, 12, tzinfo=UTC)) == [
        datetime(2026, 10, 25, 0, 30, tzinfo=UTC)]  # 02:30 CEST; not again at 02:30 CET
    # a scheduler that fired at 02:30 CEST and ticks again after 02:30 CET owes nothing
    assert due(datetime(2026, 10, 25, 0, 30, tzinfo=UTC), datetime(2026, 10, 25, 2, tzinfo=UTC)) == []


@pytest.mark.parametrize("target, private_ok, needle", [
    ("http://169.254.169.254/latest/meta-data/", True, "metadata"),
    ("http://169.254.10.1/hook", True, "link-local"),
    ("http://[fe80::1]/hook", True, "link-local"),
    ("http://metadata.google.internal/computeMetadata/v1/", True, "metadata"),
    ("http://127.0.0.1:9/hook", False, "MESHTUNE_WEBHOOK_ALLOW_PRIVATE"),
    ("http://10.1.2.3/hook", False, "private"),
    ("http://[::ffff:169.254.169.254]/x", True, "metadata"),
])
def test_webhook_to_internal_targets_is_422(client, monkeypatch, target, private_ok, needle) -> None:
    monkeypatch.setenv("MESHTUNE_WEBHOOK_ALLOW_PRIVATE", "true" if private_ok else "false")
    body = {"name": "ssrf", "cron": "0 2 * * *", "template": SIM_TEMPLATE, "webhook_url": target}
    r = client.post("/api/schedules", json=body)
    assert r.status_code == 422, r.text
    assert "webhook_url" in r.json()["detail"] and needle in r.json()["detail"], r.json()
    assert client.get("/api/schedules").json()["total"] == 0


def test_webhook_url_is_masked_and_response_bodies_are_not_stored(db, client, allow_private_webhooks) -> None:
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Leaky(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = b"internal: db_password=SECRET-42"
            self.send_response(500)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Leaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    hook = f"http://127.0.0.1:{server.server_address[1]}/services/T000/B000/XXXXSECRETXXXX?token=abc"
    try:
        url, sessions = db.url, db.sessions
        sid, fire_id = _failed_fire(sessions, url, hook)
        listed = client.get("/api/schedules").json()["items"]
        shown = client.get(f"/api/schedules/{sid}").json()["webhook_url"]
        assert shown == f"http://127.0.0.1:{server.server_address[1]}/…"
        assert "SECRET" not in json.dumps(listed) and "token" not in json.dumps(listed)
        scheduler = Scheduler(sessions=sessions, replica_id="r1",
                              delivery=DeliveryPolicy(timeout_s=2, retry_base_s=1, max_attempts=1))
        scheduler.tick(datetime.now(UTC) + timedelta(seconds=10))
        alert = client.get("/api/alerts", params={"schedule_id": sid}).json()["items"][0]
        assert alert["last_error"].startswith("HTTP 500") and "SECRET" not in json.dumps(alert)
        with sessions() as s:
            assert all("SECRET" not in (d.error or "") + d.url for d in _store.list_deliveries(s, fire_id=fire_id))
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("hook", [
    "https://alice:pw-7781@169.254.169.254/services/T0/B0/XXXXSECRETXXXX?token=tk-9931",  # refused target
    "ftp://alice:pw-7781@hooks.example.com/services/XXXXSECRETXXXX?token=tk-9931",  # not http(s)
    "https://alice:pw-7781@hooks.example.com:99999/XXXXSECRETXXXX?token=tk-9931",  # bad port
])
def test_rejected_webhook_urls_are_masked_wherever_they_are_echoed(db, client, monkeypatch, capsys, hook) -> None:
    """A webhook URL carries its secret in its user-info, path or query: a 422 (detail and every
    errors[] value) and the CLI's exit-2 line show it only as scheme://host/…"""
    from api.cli import main

    secrets = ("pw-7781", "SECRETXXXX", "tk-9931")
    body = {"name": "leak", "cron": "0 2 * * *", "template": SIM_TEMPLATE, "webhook_url": hook}
    r = client.post("/api/schedules", json=body)
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "webhook_url", r.text
    assert not any(s in r.text for s in secrets), r.text
    sid = client.post("/api/schedules", json={**body, "webhook_url": None}).json()["id"]
    r = client.patch(f"/api/schedules/{sid}", json={"webhook_url": hook})
    assert r.status_code == 422 and not any(s in r.text for s in secrets), r.text
    url = db.url
    monkeypatch.setenv("MESHTUNE_DATABASE_URL", url)
    assert main(["schedule", "add", "--name", "n", "--cron", "0 2 * * *", "--remeasure", "1", "--webhook", hook]) == 2
    err = capsys.readouterr().err
    assert "webhook_url" in err and not any(s in err for s in secrets), err
