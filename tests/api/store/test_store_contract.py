"""One contract for the store, run against SQLite and a fresh PostgreSQL database each."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
import sqlalchemy as sa

from api import store
from api.ranking import service as rankings
from api.spec import SweepSpec
from api.sweeps import service as svc
from tuner import ConflictError, NotFoundError, SpecError
from workers import TrialError, TrialResult

SPEC = SweepSpec.model_validate(
    {"name": "c", "model": "tiny", "cluster": "cpu-local", "training": {"global_batch": 16}, "backend": "simulate"}
)
LAYOUT = {"tp": 2, "pp": 1, "dp": 2, "cp": 1, "ep": 1, "zero": 0, "mbs": 1, "ac": "none", "sp": False,
          "schedule": "1f1b", "vpp": 1}


def _result(tps: float, status: str = "completed") -> TrialResult:
    if status != "completed":
        return TrialResult(status=status, backend="test", error=TrialError(kind=status, message=f"{status}!"),
                           peak_memory_bytes=5 * 2**30, device_seconds=3.0)
    return TrialResult(status="completed", backend="test", step_time_s=0.1, tokens_per_s=tps * 4,
                       tokens_per_s_per_device=tps, peak_memory_bytes=2**30, losses=[2.0, float("nan")],
                       env={"torch": "x"}, device_seconds=2.0, simulated=True)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def sessions(request, tmp_path):
    url = f"sqlite:///{tmp_path / 'c.db'}" if request.param == "sqlite" else request.getfixturevalue("fresh_pg_url")
    engine, sessions = store.open_store(url)
    yield sessions
    engine.dispose()


class TestStoreContract:
    def test_sweep_lifecycle_and_listing(self, sessions):
        with sessions() as s:
            a = svc.create_sweep(s, spec=SPEC, owner="alice")
            b = svc.create_sweep(s, spec=SPEC, owner="bob")
            assert a.status == "queued" and a.spec["model"] == "tiny" and a.sampler == "surrogate"
            page = svc.list_sweeps(s, limit=1)
            assert page.total == 2 and [x.id for x in page.items] == [b.id]  # newest first
            assert svc.list_sweeps(s, owner="alice").total == 1
            assert svc.list_sweeps(s, status="running").total == 0
            with pytest.raises(SpecError, match="status='bogus'"):
                svc.list_sweeps(s, status="bogus")
            with pytest.raises(SpecError, match="limit"):
                svc.list_sweeps(s, limit=0)
            assert svc.cancel_sweep(s, sweep_id=a.id).status == "cancelled"
            with pytest.raises(ConflictError, match="already cancelled"):
                svc.cancel_sweep(s, sweep_id=a.id)
            with pytest.raises(NotFoundError):
                svc.cancel_sweep(s, sweep_id=999_999)
            with pytest.raises(NotFoundError):
                svc.get_sweep(s, sweep_id=999_999)
            assert svc.counts(s).sweeps_by_status == {"cancelled": 1, "queued": 1}

    def test_claim_is_exclusive_and_dead_runner_is_taken_over(self, sessions):
        with sessions() as s:
            sw = svc.create_sweep(s, spec=SPEC, owner=None)
            got = store.claim_sweep(s, runner_id="thishost-not:1:a")
            s.commit()
            assert got.id == sw.id and got.status == "running"
            # A live runner elsewhere with a fresh heartbeat keeps it.
            assert store.claim_sweep(s, runner_id="other:2:b") is None
            assert store.heartbeat(s, sweep_id=sw.id, runner_id="thishost-not:1:a") == "running"
            # A silent runner is taken over after stale_after_s.
            got = store.claim_sweep(s, runner_id="other:2:b", stale_after_s=0.0)
            s.commit()
            assert got.runner_id == "other:2:b"
            assert store.heartbeat(s, sweep_id=sw.id, runner_id="thishost-not:1:a") is None

    def test_result_reporting_is_idempotent(self, sessions):
        with sessions() as s:
            sw = svc.create_sweep(s, spec=SPEC, owner=None)
            kw = dict(sweep_id=sw.id, layout=LAYOUT, layout_key="k1", world_size=4)
            assert store.insert_trial(s, number=0, **kw)
            assert not store.insert_trial(s, number=0, **kw)  # same (sweep, number, attempt)
            assert store.record_result(s, sweep_id=sw.id, number=0, attempt=0, result=_result(100.0),
                                       useful_fraction=0.5)
            # A duplicate (or conflicting) report of the same trial changes nothing.
            assert not store.record_result(s, sweep_id=sw.id, number=0, attempt=0, result=_result(1.0))
            store.refresh_sweep_cache(s, sweep_id=sw.id)
            s.commit()
            t = store.get_trial_by_number(s, sweep_id=sw.id, number=0)
            assert t.tokens_per_s_per_device == 100.0 and t.useful_tokens_per_s == 200.0
            assert t.losses == [2.0, None] and t.env_fingerprint and t.simulated
            sw = svc.get_sweep(s, sweep_id=sw.id)
            assert (sw.n_trials, sw.n_completed, sw.best_layout_key, sw.device_seconds) == (1, 1, "k1", 2.0)
            assert svc.get_trial(s, sweep_id=sw.id, trial_id=t.id).number == 0
            with pytest.raises(NotFoundError):
                svc.get_trial(s, sweep_id=sw.id, trial_id=t.id + 1000)

    def test_interrupted_attempts_and_failures(self, sessions):
        with sessions() as s:
            sw = svc.create_sweep(s, spec=SPEC, owner=None)
            kw = dict(sweep_id=sw.id, layout=LAYOUT, world_size=4)
            store.insert_trial(s, number=0, layout_key="a", **kw)
            store.insert_trial(s, number=1, layout_key="b", **kw)
            store.insert_trial(s, number=2, layout_key="c", status="pruned", predicted_memory_bytes=9 * 2**30,
                               cause="pruned", **kw)
            store.record_result(s, sweep_id=sw.id, number=1, attempt=0, result=_result(0, "oom"))
            stale = store.mark_interrupted(s, sweep_id=sw.id)
            assert [t.number for t in stale] == [0]
            store.insert_trial(s, number=0, attempt=1, layout_key="a", **kw)
            store.refresh_sweep_cache(s, sweep_id=sw.id)
            s.commit()
            rows, total = store.list_trials(s, sweep_id=sw.id)
            assert total == 4
            assert [(t.number, t.attempt, t.status) for t in rows] == [
                (0, 0, "interrupted"), (0, 1, "running"), (1, 0, "oom"), (2, 0, "pruned")]
            assert rows[2].cause == "oom: oom!" and rows[2].error["kind"] == "oom"
            sw = svc.get_sweep(s, sweep_id=sw.id)
            assert (sw.n_trials, sw.n_failed, sw.n_pruned) == (3, 1, 1)  # interrupted attempts not counted
            assert svc.list_trials(s, sweep_id=sw.id, status="pruned").total == 1
            assert store.next_number(s, sweep_id=sw.id) == 3

    def test_a_node_lost_trial_counts_once_its_rerun_is_recorded(self, sessions):
        """A trial a node died under (``infra="node_lost"``) is re-run once as a later trial of the same
        layout, phase and repeat (api/engine/_lost.py): the sweep's counts hold the re-run, not both;
        the lost row stays listed. Until the re-run exists, and when the re-run is lost too (no
        second re-run), the lost row is the layout's trial and counts."""
        lost = TrialResult(status="crash", backend="ray", device_seconds=1.0, error=TrialError(
            kind="crash", message="node lost: node abc died with ranks 0-1 of this trial", infra="node_lost"))

        def counted(s, sweep_id):
            store.refresh_sweep_cache(s, sweep_id=sweep_id)
            s.commit()
            sw = svc.get_sweep(s, sweep_id=sweep_id)
            return sw.n_trials, sw.n_completed, sw.n_failed, sw.device_seconds

        with sessions() as s:
            sw = svc.create_sweep(s, spec=SPEC, owner=None)
            kw = dict(sweep_id=sw.id, layout=LAYOUT, world_size=4)

            def run(number, key, result, source="sampler"):
                store.insert_trial(s, number=number, layout_key=key, source=source, **kw)
                assert store.record_result(s, sweep_id=sw.id, number=number, attempt=0, result=result)

            run(0, "a", lost)
            assert counted(s, sw.id) == (1, 0, 1, 1.0)  # not re-run yet: it is the layout's trial
            run(1, "b", _result(50.0))
            store.insert_trial(s, number=2, layout_key="a", source="requeued", **kw)  # the re-run, running
            assert counted(s, sw.id) == (2, 1, 0, 3.0)
            assert store.record_result(s, sweep_id=sw.id, number=2, attempt=0, result=_result(60.0))
            assert counted(s, sw.id) == (2, 2, 0, 5.0)  # device time: every row spent it
            run(3, "c", lost)
            run(4, "c", lost, source="requeued")  # lost again: re-queued only once, so it counts
            assert counted(s, sw.id) == (3, 2, 1, 7.0)
            rows, total = store.list_trials(s, sweep_id=sw.id)
            assert total == 5 and [(t.number, (t.error or {}).get("infra")) for t in rows] == [
                (0, "node_lost"), (1, None), (2, None), (3, "node_lost"), (4, "node_lost")]

    def test_ranking_ties_pareto_and_csv(self, sessions):
        with sessions() as s:
            sw = svc.create_sweep(s, spec=SPEC, owner=None)
            n = 0
            for key, values, mem in (("a", [100, 102, 98], 3), ("b", [99, 101, 97], 1), ("c", [50, 51, 49], 2),
                                     ("d", [40], 4)):
                for rep, v in enumerate(values):
                    store.insert_trial(s, sweep_id=sw.id, number=n, layout=LAYOUT, layout_key=key, world_size=4,
                                       repeat=rep, phase="search" if rep == 0 else "remeasure",
                                       predicted_tokens_per_s_per_device=110.0)
                    r = _result(float(v))
                    r.peak_memory_bytes = mem * 2**30
                    store.record_result(s, sweep_id=sw.id, number=n, attempt=0, result=r, useful_fraction=1.0)
                    n += 1
            s.commit()
            rk = rankings.ranking(s, sweep_id=sw.id)
            assert [r.layout_key for r in rk.rows] == ["a", "b", "c", "d"]
            a, b, c, d = rk.rows
            assert a.n == 3 and a.median == 100 and a.low < 100 < a.high
            assert b.tied_with_best and b.tie_group == a.tie_group  # overlapping intervals
            assert not c.tied_with_best and c.tie_group != a.tie_group
            # One run: its interval is the noise pooled over the repeated layouts, clear of a's.
            assert d.n == 1 and d.low < 40 < d.high < a.low and not d.tied_with_best
            assert a.prediction_error == pytest.approx(0.1)
            csv_text = rankings.ranking_csv(rk)
            assert csv_text.splitlines()[0].startswith("rank,layout_key") and len(csv_text.splitlines()) == 5
            front = {p.layout_key: p.on_front for p in svc.pareto(s, sweep_id=sw.id)}
            assert front == {"a": True, "b": True, "c": False, "d": False}  # c, d: dominated by b
            with pytest.raises(SpecError, match="metric"):
                rankings.ranking(s, sweep_id=sw.id, metric="nope")

    def test_the_sweeps_best_is_the_rankings_first_row_not_the_fastest_run(self, sessions):
        """One lucky run of a noisy layout (130 among 20s) is the fastest trial, but
        the steady layout has the best median and is the ranking's #1: the sweep says the same."""
        from api.sweeps.schemas import SweepOut

        with sessions() as s:
            sw = svc.create_sweep(s, spec=SPEC, owner=None)
            n = 0
            for key, values in (("lucky", [130, 20, 20]), ("steady", [100, 101, 99])):
                for rep, v in enumerate(values):
                    store.insert_trial(s, sweep_id=sw.id, number=n, layout=LAYOUT, layout_key=key, world_size=4,
                                       repeat=rep, phase="search" if rep == 0 else "remeasure")
                    store.record_result(s, sweep_id=sw.id, number=n, attempt=0, result=_result(float(v)))
                    n += 1
            store.refresh_sweep_cache(s, sweep_id=sw.id)
            s.commit()
            out = SweepOut.model_validate(svc.get_sweep(s, sweep_id=sw.id))
            assert out.best_layout_key == rankings.ranking(s, sweep_id=sw.id).rows[0].layout_key == "steady"
            assert out.best_tokens_per_s_per_device == 100.0
            assert out.simulated and out.device_seconds == 12.0  # simulate backend: labelled simulated

    def test_stored_ranking_follows_each_result(self, sessions):
        """The ranking is stored and kept in order as results land (api/store/_ranking.py):
        every result moves the sweep's results version (the ETag), a re-measurement's pooled noise
        moves every interval, and the stored rows are exactly the ranking recomputed from the trials."""
        with sessions() as s:
            sw = svc.create_sweep(s, spec=SPEC, owner=None)
            tags = [rankings.ranking_tag(s, sweep_id=sw.id)]
            plan = [("a", 100.0, "completed"), ("b", 90.0, "completed"), ("c", None, "oom"), ("a", 104.0, "completed"),
                    ("b", 88.0, "completed")]
            for n, (key, tps, status) in enumerate(plan):
                store.insert_trial(s, sweep_id=sw.id, number=n, layout=LAYOUT, layout_key=key, world_size=4,
                                   repeat=sum(k == key for k, _, _ in plan[:n]))
                store.record_result(s, sweep_id=sw.id, number=n, attempt=0, result=_result(tps or 0.0, status))
                store.refresh_sweep_cache(s, sweep_id=sw.id)
                s.commit()
                tags.append(rankings.ranking_tag(s, sweep_id=sw.id))
                for metric in store.RANKING_METRICS:
                    assert rankings.ranking(s, sweep_id=sw.id, metric=metric).rows == rankings.ranking_from_trials(
                        s, sweep_id=sw.id, metric=metric).rows
            assert len(set(tags)) == len(tags)  # a failure moves the version too
            rows = rankings.ranking(s, sweep_id=sw.id).rows
            assert [(r.layout_key, r.n) for r in rows] == [("a", 2), ("b", 2)] and rows[0].low is not None
            assert [r.layout_key for r in rankings.ranking(s, sweep_id=sw.id, limit=1, offset=1).rows] == ["b"]
            assert rankings.ranking_tag(s, sweep_id=sw.id) == tags[-1]  # reading changes nothing
            with pytest.raises(NotFoundError):
                rankings.ranking_tag(s, sweep_id=999_999)

    def test_metrics_counts(self, sessions):
        with sessions() as s:
            sw = svc.create_sweep(s, spec=SPEC, owner=None)
            store.insert_trial(s, sweep_id=sw.id, number=0, layout=LAYOUT, layout_key="a", world_size=4)
            store.record_result(s, sweep_id=sw.id, number=0, attempt=0, result=_result(10.0))
            s.commit()
            c = svc.counts(s)
            assert c.trials_by_status == {("completed", True): 1} and c.device_seconds == {False: 0.0, True: 2.0}

    def test_released_sweep_is_taken_at_once_and_marked_trials_keep_their_cause(self, sessions):
        with sessions() as s:
            sw = svc.create_sweep(s, spec=SPEC, owner=None)
            store.claim_sweep(s, runner_id="elsewhere:1:a")
            store.insert_trial(s, sweep_id=sw.id, number=0, layout=LAYOUT, layout_key="k1", world_size=4)
            s.commit()
            assert store.claim_sweep(s, runner_id="other:2:b") is None  # live, fresh heartbeat
            assert not store.release_sweep(s, sweep_id=sw.id, runner_id="other:2:b")  # not its runner
            assert store.release_sweep(s, sweep_id=sw.id, runner_id="elsewhere:1:a")
            s.commit()
            got = store.claim_sweep(s, runner_id="other:2:b")  # released: taken over at once
            assert got is not None and got.runner_id == "other:2:b" and got.status == "running"
            marked = store.mark_interrupted(s, sweep_id=sw.id, cause="sweep failed: ImportError: x")
            s.commit()
            assert [t.number for t in marked] == [0]
            (row,) = store.all_trials(s, sweep_id=sw.id)
            assert row.status == "interrupted" and row.cause == "sweep failed: ImportError: x"
            assert svc.counts(s).trials_by_status == {("interrupted", False): 1}


# --- timestamps: every DateTime column reads back as an aware UTC datetime ------------------------------
# SQLite has no time-zone type: it stored the wall time and handed back a naive datetime, which the API then
# serialised without an offset (a JavaScript client reads that as local time). PostgreSQL returns the
# session's zone. Every DateTime column must give aware UTC on both, and an offset given on write must be
# honoured (SQLite used to drop it, shifting the instant).

WRITTEN = datetime(2026, 3, 1, 12, 30, 15, 250000, tzinfo=timezone(timedelta(hours=2)))  # = 10:30:15.25Z


def _all_models() -> list[type]:
    import api.reshard.models  # noqa: F401 - registers the reshard-check table on Base
    import api.schedules.models  # noqa: F401 - registers the schedule tables on Base

    return [m.class_ for m in store.Base.registry.mappers]


def _datetime_columns(model: type) -> list[str]:
    return [c.key for c in model.__table__.columns
            if isinstance(c.type, sa.DateTime) or isinstance(getattr(c.type, "impl", None), sa.DateTime)]


def test_every_datetime_column_is_utc_aware():
    untyped = [f"{m.__tablename__}.{c.key}" for m in _all_models() for c in m.__table__.columns
               if isinstance(c.type, sa.DateTime)]
    assert untyped == []  # a plain DateTime reads back naive on SQLite: use store.UTCDateTime
    assert {m.__tablename__: _datetime_columns(m) for m in _all_models()}.keys() >= {
        "sweeps", "trials", "schedules", "schedule_fires", "schedule_alerts", "schedule_alert_deliveries",
        "reshard_checks"}


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def zoned_sessions(request, tmp_path):
    """A store whose PostgreSQL sessions run in a non-UTC zone (libpq ``options``), so a column that
    handed back the session's zone would show it."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'tz.db'}"
    else:
        url = request.getfixturevalue("fresh_pg_url") + "?options=-c%20timezone%3DAsia/Kolkata"
    engine, sessions = store.open_store(url)
    yield sessions
    engine.dispose()


def test_timestamps_read_back_as_the_same_instant_in_utc(zoned_sessions):
    from api.reshard.models import ReshardCheck
    from api.schedules.models import AlertDelivery, Schedule, ScheduleAlert, ScheduleFire

    def stamped(obj):
        for key in _datetime_columns(type(obj)):
            setattr(obj, key, WRITTEN)
        return obj

    with zoned_sessions() as s:
        sweep = stamped(store.Sweep(name="tz", spec={}, backend="simulate", sampler="tpe"))
        s.add(sweep)
        s.flush()
        schedule = stamped(Schedule(name="n", cron="0 2 * * *", timezone="UTC", kind="template"))
        s.add_all([stamped(store.Trial(sweep_id=sweep.id, number=0, layout=LAYOUT, layout_key="k", world_size=4)),
                   schedule,
                   stamped(ReshardCheck(sweep_id=sweep.id, from_layout={}, to_layout={}, from_key="a", to_key="b",
                                        steps_before=1, steps_after=1, verdict="ok", mismatches=[],
                                        losses_before=[], losses_a=[], losses_b=[], tolerance=0.0,
                                        backend="simulate"))])
        s.flush()
        fire = stamped(ScheduleFire(schedule_id=schedule.id, status="completed"))
        s.add(fire)
        s.flush()
        s.add_all([stamped(ScheduleAlert(schedule_id=schedule.id, fire_id=fire.id, kind="failure", message="m")),
                   stamped(AlertDelivery(fire_id=fire.id, attempt=1, url="http://127.0.0.1/h", ok=True,
                                         alert_ids=[]))])
        s.commit()
    checked = []
    with zoned_sessions() as s:  # a new session: every value comes from the database, not the identity map
        for model in _all_models():
            for row in s.scalars(sa.select(model)):
                for key in _datetime_columns(model):
                    value = getattr(row, key)
                    checked.append(f"{model.__tablename__}.{key}")
                    assert value == WRITTEN, (checked[-1], value)
                    assert value.utcoffset() == timedelta(0) and value.tzinfo is timezone.utc, (checked[-1], value)
        # Column expressions (max/min, as the scheduler's queries use) carry the column's type too.
        latest = s.scalar(sa.select(sa.func.max(ScheduleFire.fire_time)))
        assert latest == WRITTEN and latest.tzinfo is timezone.utc
        # Comparisons in SQL use the same instant: 10:30Z is after 10:00Z and before 11:00Z.
        after = datetime(2026, 3, 1, 10, 0, tzinfo=timezone.utc)
        assert s.scalar(sa.select(sa.func.count()).where(store.Sweep.created_at > after,
                                                         store.Sweep.created_at < after + timedelta(hours=1))) == 1
    assert len(checked) == 18  # every DateTime column of the seven tables


@pytest.mark.parametrize("option", ["fail", "sleep_per_step_s", "min_step_s", "memory_cap_bytes"])
def test_every_diagnostic_option_flags_the_sweep(option):
    """A sweep whose trials inject failures, slowness or a cap is flagged, whichever option does it
    (the store and the spec read the workers' one list, workers.DIAGNOSTIC_OPTIONS; min_step_s was missed)."""
    from workers import DIAGNOSTIC_OPTIONS

    assert option in DIAGNOSTIC_OPTIONS
    assert store.Sweep(spec={"trial": {"options": {option: 1}}}).diagnostic
    assert not store.Sweep(spec={"trial": {"options": {}}}).diagnostic
