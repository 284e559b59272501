"""The stored ranking (api/store/_ranking.py) maintained as results land is exactly the ranking
recomputed from every trial (api.ranking.service.ranking_from_trials), on SQLite and PostgreSQL:
after every single result of a sweep with ties, failures, re-measured layouts (pooled noise moves every
interval), a non-positive measurement, trials without useful throughput and predictions made under
several calibration versions; plus the backfill migration, paging and the route's ETag/304."""

from __future__ import annotations

import dataclasses
import random

import sqlalchemy as sa
from fastapi.testclient import TestClient

from api import store
from api.ranking import service as rankings
from api.spec import SweepSpec
from api.sweeps import service as svc
from tests.helpers.dashboard_seed import seed_sweep
from workers import TrialError, TrialResult

SPEC = SweepSpec.model_validate(
    {"name": "r", "model": "tiny", "cluster": "cpu-local", "training": {"global_batch": 16}, "backend": "simulate"}
)
LAYOUTS = [dict(tp=tp, dp=4 // (tp * pp), pp=pp, mbs=mbs) for tp in (1, 2) for pp in (1, 2) for mbs in (1, 2)]



def _key(layout: dict) -> str:
    return "-".join(f"{k}{v}" for k, v in sorted(layout.items()))


def _result(tps: float | None, *, status: str = "completed") -> TrialResult:
    if status != "completed":
        return TrialResult(status=status, backend="test", error=TrialError(kind=status, message=f"{status}!"),
                           device_seconds=1.0)
    return TrialResult(status="completed", backend="test", step_time_s=0.1, tokens_per_s=tps * 4,
                       tokens_per_s_per_device=tps, peak_memory_bytes=int(2**30 + tps * 1000) | 1,
                       device_seconds=2.0, simulated=True)


def _assert_same(s, sweep_id: int) -> None:
    for metric in store.RANKING_METRICS:
        stored, recomputed = rankings.ranking(s, sweep_id=sweep_id, metric=metric), rankings.ranking_from_trials(
            s, sweep_id=sweep_id, metric=metric)
        assert [dataclasses.asdict(r) for r in stored.rows] == [dataclasses.asdict(r) for r in recomputed.rows]
        assert (stored.total, stored.simulated, stored.calibration) == (
            recomputed.total, recomputed.simulated, recomputed.calibration)


def _script(rng: random.Random) -> list[tuple[dict, float | None, str, float | None, int]]:
    """(layout, tokens/s, status, useful fraction, calibration version) per trial, in number order."""
    out = []
    for i, lay in enumerate(LAYOUTS):
        tps = 100.0 if i in (2, 3) else rng.uniform(50, 150)  # 2 and 3: an exact tie (order by key)
        out.append((lay, tps, "completed", 0.5 if i % 3 else None, 0))
    out.append((LAYOUTS[4], None, "oom", None, 0))  # a failure of a measured layout
    out.append((dict(tp=4, dp=1, pp=1, mbs=1), None, "crash", None, 0))  # a layout that only failed
    for r in range(2):  # re-measure the top three: the pooled noise moves every interval
        for i in (0, 1, 5):
            out.append((LAYOUTS[i], out[i][1] * rng.uniform(0.9, 1.1), "completed", 0.5, 1 + r))
    out.append((LAYOUTS[6], 0.0, "completed", 0.5, 1))  # a non-positive value: no log-scale pooling for it
    return out


def test_stored_ranking_equals_recomputation_after_every_result(url):
    engine, sessions = store.open_store(url)
    try:
        with sessions() as s:
            sid = svc.create_sweep(s, spec=SPEC, owner="alice").id
            for number, (lay, tps, status, useful, version) in enumerate(_script(random.Random(7))):
                repeat = sum(1 for t in store.all_trials(s, sweep_id=sid) if t.layout_key == _key(lay))
                store.insert_trial(s, sweep_id=sid, number=number, layout=lay, layout_key=_key(lay),
                                   world_size=4, repeat=repeat, phase="remeasure" if repeat else "search",
                                   predicted_tokens_per_s_per_device=90.0 + number, predicted_memory_bytes=2**30,
                                   calibration_version=version)
                store.record_result(s, sweep_id=sid, number=number, attempt=0,
                                    result=_result(tps, status=status), useful_fraction=useful)
                store.refresh_sweep_cache(s, sweep_id=sid)
                s.commit()
                _assert_same(s, sid)
            # A new calibration version: rows predicted under an older one are re-predicted under it.
            store.set_calibration(s, sweep_id=sid, calibration={"version": 1})
            s.commit()
            _assert_same(s, sid)
            ranking = rankings.ranking(s, sweep_id=sid)
            assert {r.n for r in ranking.rows} == {1, 2, 3} and ranking.total == len(LAYOUTS)
            assert len({r.tie_group for r in ranking.rows}) > 1  # not all one tie: the check has teeth
            sweep = svc.get_sweep(s, sweep_id=sid)
            assert (sweep.best_layout_key, sweep.best_tokens_per_s_per_device) == (
                ranking.rows[0].layout_key, ranking.rows[0].median)
            # Pages are slices of the whole, by rank.
            whole = [r.layout_key for r in ranking.rows]
            page = rankings.ranking(s, sweep_id=sid, limit=3, offset=2)
            assert [r.layout_key for r in page.rows] == whole[2:5] and page.total == len(whole)
            assert [r.layout_key for r in rankings.ranking(s, sweep_id=sid, offset=6).rows] == whole[6:]
    finally:
        engine.dispose()


def _stored_rows(session, sweep_id: int) -> list[tuple]:
    return [(r.rank, r.layout_key, r.n, r.median, r.low, r.high, r.tie_group, r.tied_with_best, r.simulated)
            for r in store.ranked_rows(session, sweep_id=sweep_id, metric="tokens_per_s_per_device")]


def test_results_stored_without_refresh_and_the_backfill(url):
    """A seeded sweep whose results were recorded with one refresh at the end (tests/helpers/dashboard_seed:
    failures and re-measurements) ranks as recomputed; after downgrading below the ranking tables and
    upgrading again, the migration's backfill gives the same rows."""
    engine, sessions = store.open_store(url)
    try:
        sid = seed_sweep(sessions, n_trials=30, name="seeded", rich=True)
        with sessions() as s:
            _assert_same(s, sid)
            before = _stored_rows(s, sid)
        store.downgrade(url, "q0001")
        assert "ranked_layouts" not in sa.inspect(engine).get_table_names()
        store.upgrade(url, "u0001")  # the last revision before d210001 re-keys twins (the fixture seeds some)
        with sessions() as s:
            state = store.ranking_state(s, sweep_id=sid)
            assert state.version is not None and state.version == state.ranked_version  # backfilled
            # the stored rows alone: the ORM's Sweep has columns of later revisions, absent at u0001
            assert _stored_rows(s, sid) == before
        store.upgrade(url)  # twins re-keyed to one canonical layout: still what the trials give
        with sessions() as s:
            _assert_same(s, sid)
    finally:
        engine.dispose()


def test_ranking_route_pages_and_etag(tmp_path):
    from api.main import create_app
    from api.settings import Settings

    url = f"sqlite:///{tmp_path / 'e.db'}"
    engine, sessions = store.open_store(url)
    sid = seed_sweep(sessions, n_trials=12, name="etag")
    app = create_app(Settings(database_url=url, api_tokens="", scheduler_enabled=False), run_engine=False)
    try:
        with TestClient(app) as client:
            full = client.get(f"/api/sweeps/{sid}/ranking")
            page = client.get(f"/api/sweeps/{sid}/ranking", params={"limit": 5, "offset": 2})
            assert full.status_code == page.status_code == 200
            assert page.json()["rows"] == full.json()["rows"][2:7] and page.json()["total"] == full.json()["total"]
            etag = page.headers["etag"]
            again = client.get(f"/api/sweeps/{sid}/ranking", params={"limit": 5, "offset": 2},
                               headers={"If-None-Match": etag})
            assert again.status_code == 304 and again.content == b"" and again.headers["etag"] == etag
            assert etag != full.headers["etag"]  # each representation has its own tag
            csv = client.get(f"/api/sweeps/{sid}/ranking", params={"format": "csv", "limit": 5, "offset": 2},
                             headers={"If-None-Match": etag})
            assert csv.status_code == 200 and csv.text.count("\n") == 6
            # A new result moves the version: the old tag no longer matches.
            from tests.helpers.dashboard_seed import add_running_trial

            add_running_trial(sessions, sweep_id=sid, tokens=1e9, peak=2**30)
            fresh = client.get(f"/api/sweeps/{sid}/ranking", params={"limit": 5, "offset": 2},
                               headers={"If-None-Match": etag})
            assert fresh.status_code == 200 and fresh.headers["etag"] != etag
            assert fresh.json()["total"] == full.json()["total"] + 1
            top = client.get(f"/api/sweeps/{sid}/ranking", params={"limit": 1}).json()["rows"][0]
            assert top["tokens_per_s_per_device"] == 1e9
            assert client.get("/api/sweeps/999999/ranking").status_code == 404
    finally:
        engine.dispose()
