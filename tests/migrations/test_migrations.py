"""Alembic: upgrade head and downgrade base on SQLite and PostgreSQL; the models match the migrations."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from api import store


def _tables(url: str) -> set[str]:
    engine = store.create_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_head_then_downgrade_base(url):
    store.upgrade(url)
    assert store.current_revision(url) is not None
    assert {"sweeps", "trials", store.VERSION_TABLE} <= _tables(url)
    assert "alembic_version" not in _tables(url)  # our own version table: no clash with Optuna's
    engine = store.create_engine(url)
    with engine.connect() as conn:  # the migrated schema is exactly what the models declare
        diff = compare_metadata(MigrationContext.configure(conn, opts={"version_table": store.VERSION_TABLE}),
                                store.Base.metadata)
    engine.dispose()
    assert diff == []
    store.upgrade(url)  # idempotent
    store.downgrade(url)
    assert store.current_revision(url) is None
    assert _tables(url) <= {store.VERSION_TABLE}


def test_unreachable_database_is_named_without_password():
    with pytest.raises(store.StoreUnavailableError) as exc:
        store.open_store("postgresql+psycopg://meshtune:s3cr3t@127.0.0.1:1/nowhere")
    assert "127.0.0.1:1/nowhere" in str(exc.value) and "s3cr3t" not in str(exc.value)
    assert "***" in str(exc.value)


def _old_sweep(session, **values) -> int:  # noqa: ANN001
    """A queued sweep as a store at an older revision holds it: only the columns that revision has
    (the models' later columns are not there yet)."""
    from api.store._models import utcnow

    table = sa.Table("sweeps", sa.MetaData(), autoload_with=session.connection())
    row = {"status": "queued", "priority": "normal", "created_at": utcnow(), "n_trials": 0, "n_completed": 0,
           "n_pruned": 0, "n_failed": 0, "device_seconds": 0.0, **values}
    return session.execute(table.insert().values({k: v for k, v in row.items() if k in table.c})).inserted_primary_key[0]


def test_old_sweeps_are_rekeyed_to_canonical_layouts_and_a_resume_runs_no_twin(url, tmp_path):
    """A store created at the revision before canonical keys (u0001), holding a sweep that measured
    twins as different layouts (ZeRO-1 and ZeRO-0 of tp=4 without a data axis are one program; so are
    ZeRO-3 and ZeRO-0 with sp). After the upgrade (d210001) each twin carries its canonical key, the
    pair is one ranked layout measured twice, and resuming the sweep runs no twin of a layout it ran:
    before, its grid proposed the canonical twin of the ZeRO-3 run."""
    from api.engine import SweepRunner
    from api.settings import Settings
    from api.spec import SweepSpec
    from tuner import Layout, canonical_layout, training_spec
    from workers import TrialResult

    store.upgrade(url, "u0001")
    spec = SweepSpec.model_validate({
        "name": "old", "model": "tiny", "cluster": "cpu-local", "training": {"global_batch": 16},
        "backend": "simulate", "space": {"tp": [4], "pp": [1], "cp": [1], "mbs": [4], "ac": ["none"]},
        "search": {"sampler": "grid", "max_trials": 4, "warm_start_top_k": 0, "remeasure_top_k": 0}})
    old = [Layout(tp=4, mbs=4, zero=1), Layout(tp=4, mbs=4), Layout(tp=4, mbs=4, zero=3, sp=True)]
    engine, sessions = store.open_store(url, upgrade_schema=False)
    try:
        with store.session_scope(sessions) as s:
            sid = _old_sweep(s, name="old", owner="a", spec=spec.model_dump(mode="json"), backend="simulate",
                             sampler="grid")
            for n, lay in enumerate(old):  # stored as the code before canonical keys stored them
                store.insert_trial(s, sweep_id=sid, number=n, layout=lay.__dict__.copy(), layout_key=lay.key,
                                   world_size=4, backend="simulate")
                store.record_result(s, sweep_id=sid, number=n, attempt=0, result=TrialResult(
                    status="completed", backend="simulate", simulated=True, step_time_s=1.0, step_times_s=[1.0],
                    tokens_per_s=4000.0 + n, tokens_per_s_per_device=1000.0 + n, peak_memory_bytes=2**28))
            store.refresh_sweep_cache(s, sweep_id=sid)
            store.set_sweep_status(s, sweep_id=sid, status="running")  # interrupted mid-sweep
            assert len({t.layout_key for t in store.all_trials(s, sweep_id=sid)}) == 3
    finally:
        engine.dispose()

    store.upgrade(url)  # d210001
    training = training_spec({"global_batch": 16}, seq_len=64)
    canon = [canonical_layout(lay, training=training) for lay in old]
    assert canon[0] == canon[1] != canon[2] and all(c.zero == 0 for c in canon)
    engine, sessions = store.open_store(url)
    try:
        with sessions() as s:
            rows = store.all_trials(s, sweep_id=sid)
            assert [t.layout_key for t in rows] == [c.key for c in canon]
            assert [Layout(**t.layout) for t in rows] == canon
            from api.ranking import service

            ranked = service.ranking(s, sweep_id=sid).rows
            assert sorted((r.layout_key, r.n) for r in ranked) == sorted([(canon[0].key, 2), (canon[2].key, 1)])
        runner = SweepRunner(Settings(home=tmp_path, database_url=url, ray_address=None), sessions=sessions)
        final = runner.run_sweep(sid)
        assert final.status == "completed"
        with sessions() as s:
            after = store.all_trials(s, sweep_id=sid)
        assert [t.layout_key for t in after] == [c.key for c in canon]  # nothing re-ran: both layouts measured
    finally:
        engine.dispose()


def test_a_downgrade_that_rebuilds_a_table_keeps_every_row(url):
    """SQLite alters a column by rebuilding the table; with foreign keys on, dropping the old ``sweeps``
    cascaded to every trial (q0001's downgrade lost them all). Rows survive each step down."""
    from workers import TrialResult

    store.upgrade(url)
    engine, sessions = store.open_store(url, upgrade_schema=False)
    try:
        with store.session_scope(sessions) as s:
            sid = store.insert_sweep(s, name="kept", owner="a", spec={"model": "tiny"}, backend="simulate",
                                     sampler="grid").id
            for n in range(3):
                store.insert_trial(s, sweep_id=sid, number=n, layout={"tp": 1}, layout_key=f"k{n}", world_size=1,
                                   backend="simulate")
                store.record_result(s, sweep_id=sid, number=n, attempt=0, result=TrialResult(
                    status="completed", backend="simulate", simulated=True, step_time_s=1.0, step_times_s=[1.0],
                    tokens_per_s=10.0, tokens_per_s_per_device=10.0, peak_memory_bytes=2**20))
    finally:
        engine.dispose()

    def counts() -> tuple[int, int]:
        e = store.create_engine(url)
        try:
            with e.connect() as conn:
                return (conn.scalar(sa.text("SELECT count(*) FROM sweeps")),
                        conn.scalar(sa.text("SELECT count(*) FROM trials")))
        finally:
            e.dispose()

    for revision in ("k0001", "q0001", "t0001", "r0001"):  # below the rank-nodes and the queue columns, and on down
        store.downgrade(url, revision)
        assert counts() == (1, 3), revision
