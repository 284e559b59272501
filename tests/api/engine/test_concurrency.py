"""Sharing one cluster: several sweeps of several owners at once on one coordinator.

* Real runs on the session's local Ray (4 CPUs): two owners' sweeps of 2-rank trials run side by
  side (their stored intervals overlap), the devices held never exceed the cluster's (nor an owner's
  limit of 2) at any instant of the stored intervals; cancelling a sweep stops its running trial,
  removes its placement group and frees its devices (timed, printed).
* A coordinator killed with two sweeps in flight (scripted backend, no Ray) is resumed by a new one:
  no trial lost, none doubled, in either sweep, on SQLite and on PostgreSQL.
* The ledger's order (fair share, then priority, then age) and owner limits, without any backend.
"""

from __future__ import annotations

import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from api import store
from api.engine import SweepRunner
from api.engine._share import Claimant, DeviceLedger, OwnerLimits
from api.settings import Settings
from api.spec import SweepSpec
from api.sweeps import service as svc
from tests.helpers.coordinator import start_coordinator
from tests.helpers.devices_held import T0, peak_devices, wait_for
from tuner import ConflictError

# --- the ledger alone ----------------------------------------------------------------------------


def test_ledger_fair_share_then_priority_then_age_and_owner_limits() -> None:
    limits = {"carol": OwnerLimits(max_devices=2), "dave": OwnerLimits(spent=True)}
    ledger = DeviceLedger(4, limits=lambda owner: limits.get(owner, OwnerLimits()))
    a1 = Claimant(1, "alice", "low", T0)
    b_old = Claimant(2, "bob", "normal", T0)
    b_high = Claimant(3, "bob", "high", T0 + timedelta(hours=1))
    first = ledger.try_acquire(a1, 4)  # the whole cluster
    assert first is not None and ledger.held_by("alice") == 4 and ledger.free() == 0
    for who in (b_old, b_high, a1):  # each asks for 2 and waits
        assert ledger.try_acquire(who, 2) is None
    # bob holds nothing, so bob's sweeps come before alice's next trial; of bob's two the higher
    # priority goes first although it is younger.
    assert ledger.waiting() == [3, 2, 1]
    ledger.release(first)
    assert ledger.try_acquire(a1, 2) is None and ledger.try_acquire(b_old, 2) is None  # not their turn
    assert ledger.try_acquire(b_high, 2) is not None
    # Now bob holds 2 and alice none: alice's turn before bob's older sweep.
    assert ledger.waiting() == [1, 2]
    assert ledger.try_acquire(b_old, 2) is None and ledger.try_acquire(a1, 2) is not None
    assert ledger.free() == 0 and ledger.try_acquire(b_old, 2) is None
    # Owner limits: carol may hold 2 (a second trial waits, not fails); dave's device-hours are spent.
    roomy = DeviceLedger(8, limits=lambda owner: limits.get(owner, OwnerLimits()))
    c = Claimant(4, "carol", "normal", T0)
    assert roomy.try_acquire(c, 2) is not None and roomy.try_acquire(c, 2) is None
    assert roomy.try_acquire(Claimant(5, "dave", "high", T0), 1) is None
    assert roomy.try_acquire(Claimant(6, "erin", "low", T0), 4) is not None  # not held back by those two
    with pytest.raises(ValueError, match="priority='urgent'"):
        Claimant(7, "x", "urgent", T0)


def test_a_queued_sweep_is_claimed_only_when_it_would_be_served_first(tmp_path: Path) -> None:
    """A coordinator claims a queued sweep only if it would get devices before every sweep already
    waiting in it; otherwise the sweep stays queued (and shows its queue position)."""
    from types import SimpleNamespace

    _, sessions = store.open_store(f"sqlite:///{tmp_path / 'q.db'}")  # its grants are device leases there
    runner = SweepRunner(Settings(database_url="sqlite://"), sessions=sessions)
    ledger = runner.ledger_for("scripted", 8)
    alice = Claimant(1, "alice", "normal", T0)
    assert ledger.try_acquire(alice, 8) is not None  # alice holds the cluster
    queued = SimpleNamespace(id=3, owner="alice", priority="high", created_at=T0 + timedelta(hours=2))
    assert runner._served_first(queued)  # nobody waits: claim it (it will wait for devices itself)
    assert ledger.try_acquire(Claimant(2, "bob", "low", T0 + timedelta(hours=1)), 4) is None  # bob waits
    assert not runner._served_first(queued)  # alice holds 8, bob 0: bob's waiter goes first
    carol = SimpleNamespace(id=4, owner="carol", priority="high", created_at=T0 + timedelta(hours=3))
    assert runner._served_first(carol)  # carol holds 0 too and has the higher priority


def test_submission_refuses_what_an_owner_may_never_run(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'l.db'}"
    engine, sessions = store.open_store(url)
    settings = Settings(database_url=url, owner_max_devices={"*": 2})
    spec = SweepSpec.model_validate({"model": "tiny", "cluster": "cpu-local", "training": {"global_batch": 16},
                                     "backend": "simulate"})
    with sessions() as s:
        with pytest.raises(ValueError, match=r"^cluster: a trial of this sweep needs 4 devices but owner 'alice' may hold"
                                             r" at most 2 at once \(MESHTUNE_OWNER_MAX_DEVICES\)$"):
            svc.create_sweep(s, spec=spec, owner="alice", settings=settings)
        with pytest.raises(ValueError, match="priority='urgent' is not a priority"):
            svc.create_sweep(s, spec=spec, owner="alice", priority="urgent")
        assert store.list_sweeps(s)[1] == 0  # nothing stored
        # bob's trials held 2 device-hours in the last day; his limit is 1: refused (409) until they age.
        earlier = svc.create_sweep(s, spec=spec, owner="bob")
        store.insert_trial(s, sweep_id=earlier.id, number=0, layout={"dp": 4}, layout_key="dp4", world_size=4)
        s.execute(sa.update(store.Trial).values(status="completed", device_seconds=7200.0, finished_at=sa.func.now()))
        s.commit()
        with pytest.raises(ConflictError, match=r"^owner 'bob' has used 2.00 of its 1 device-hours in the last 24 h"):
            svc.create_sweep(s, spec=spec, owner="bob", settings=Settings(database_url=url, owner_device_hours_per_day={"bob": 1}))
        assert store.list_sweeps(s)[1] == 1
    engine.dispose()


# --- real runs on one local Ray --------------------------------------------------------------------


class Shared:
    """The session's Ray backend, left open when a sweep ends (cancel passed through)."""

    name = "ray"

    def __init__(self, backend) -> None:  # noqa: ANN001
        self.backend = backend

    def run(self, request):  # noqa: ANN001, ANN201
        return self.backend.run(request)

    def capacity(self) -> int:
        return self.backend.capacity()

    def cancel(self, trial_id: str) -> None:
        self.backend.cancel(trial_id)

    def close(self) -> None:
        return None


def _real_spec(name: str, *, sleep: float | None = None) -> SweepSpec:
    options = {"sleep_per_step_s": sleep} if sleep else {}
    return SweepSpec.model_validate({
        "name": name, "model": "tiny", "cluster": {"preset": "cpu-local", "devices_per_node": 2},
        "training": {"global_batch": 8, "precision": "fp32"},
        "search": {"layouts": [{"dp": 2}, {"tp": 2}], "repeats": 1},
        "trial": {"warmup_steps": 1, "measure_steps": 1 if not sleep else 5, "step_timeout_s": 120,
                  "options": options},
        "backend": "ray",
    })


@pytest.mark.slow
@pytest.mark.timeout(900)  # a hang guard: on a loaded machine starting rank processes takes minutes
def test_two_owners_share_one_ray_and_cancel_frees_devices(tmp_path: Path, ray_backend) -> None:  # noqa: ANN001
    from ray.util import placement_group_table

    url = f"sqlite:///{tmp_path / 'c.db'}"
    engine, sessions = store.open_store(url)
    capacity = ray_backend.capacity()
    assert capacity >= 4
    # Each owner may hold 2 devices: alice's second trial waits (at launch, not failed) while bob's runs.
    settings = Settings(database_url=url, backend="ray", owner_max_devices={"*": 2})
    runner = SweepRunner(settings, sessions=sessions, backend_factory=lambda spec: Shared(ray_backend), poll_s=0.2)
    with sessions() as s:
        a = svc.create_sweep(s, spec=_real_spec("alice-sweep"), owner="alice", settings=settings).id
        b = svc.create_sweep(s, spec=_real_spec("bob-sweep"), owner="bob", priority="low", settings=settings).id
        assert svc.describe_sweep(s, sweep_id=b).queue_position == 2
    stop = threading.Event()
    thread = threading.Thread(target=runner.run_pending, args=(stop,), daemon=True)
    thread.start()
    try:
        def finished(*ids):  # noqa: ANN002, ANN202
            with sessions() as s:
                return all(store.get_sweep(s, sweep_id=i).status in store.FINISHED_SWEEP_STATUSES for i in ids)
        wait_for(lambda: finished(a, b), 800, "both sweeps to finish")
        with sessions() as s:
            assert [store.get_sweep(s, sweep_id=i).status for i in (a, b)] == ["completed", "completed"]
            rows = {i: store.all_trials(s, sweep_id=i) for i in (a, b)}
        for i in (a, b):
            assert sorted(t.number for t in rows[i]) == [0, 1], rows[i]
            assert all(t.status == "completed" and not t.simulated for t in rows[i])
        both = rows[a] + rows[b]
        # Side by side: some trial of alice's overlaps some trial of bob's.
        assert any(x.started_at < y.finished_at and y.started_at < x.finished_at for x in rows[a] for y in rows[b])
        # Never more devices than the cluster's, nor than an owner's limit, at any stored instant.
        assert peak_devices(both) <= capacity and peak_devices(both) == 4
        assert peak_devices(rows[a]) <= 2 and peak_devices(rows[b]) <= 2

        # Cancelling stops the running trial at once: its gang is killed, its group removed.
        with sessions() as s:
            c = svc.create_sweep(s, spec=_real_spec("to-cancel", sleep=30.0), owner="alice").id

        def running_gang():  # noqa: ANN202
            from workers._gangs import POOL
            return next((g for g in POOL._gangs if g.busy and (g.trial_id or "").startswith(f"{c}-")), None)
        wait_for(lambda: running_gang() is not None and all(s.info for s in running_gang().ranks), 600,
              "the cancelled sweep's trial to run")
        gang = running_gang()
        groups = [pg.id.hex() for pg in gang.pgs]
        with sessions() as s:
            svc.cancel_sweep(s, sweep_id=c)
        t0 = time.monotonic()

        def freed() -> bool:
            table = placement_group_table()
            with sessions() as s:
                live = [t for t in store.all_trials(s, sweep_id=c) if t.status == "running"]
            return not live and all(table.get(g, {}).get("state") in ("REMOVED", None) for g in groups)
        wait_for(freed, 120, "the cancelled trial's devices to be freed")
        took = time.monotonic() - t0
        print(f"cancel -> trial stopped and placement group removed in {took:.1f} s")
        with sessions() as s:
            cancelled = store.all_trials(s, sweep_id=c)
            assert store.get_sweep(s, sweep_id=c).status == "cancelled"
        assert cancelled and all(t.status == "interrupted" and "sweep cancelled" in t.cause for t in cancelled)
        assert took < 30  # the trial alone would have slept 6 x 30 s
        ledger = runner.ledger_for("ray", capacity)
        wait_for(lambda: ledger.free() == ledger.capacity, 30, "the ledger to be free")
        from workers._gangs import POOL
        assert gang not in POOL._gangs and not gang.pgs  # destroyed, not returned to the pool idle
    finally:
        stop.set()
        thread.join(120)
        engine.dispose()
    assert not thread.is_alive()


# --- a restart with two sweeps in flight ---------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("db", ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def test_restart_with_two_sweeps_in_flight_loses_and_doubles_nothing(tmp_path: Path, db: str, request) -> None:  # noqa: ANN001
    url = f"sqlite:///{tmp_path / 'r.db'}" if db == "sqlite" else request.getfixturevalue("fresh_pg_url")
    engine, sessions = store.open_store(url)
    spec = {"model": "tiny", "cluster": "cpu-local", "training": {"global_batch": 16},
            "search": {"sampler": "random", "max_trials": 8, "remeasure_top_k": 0},
            # 8 "devices", 4 per trial, each owner 4 at most: one trial of each sweep at a time.
            "trial": {"options": {"sleep_s": 0.4}}, "backend": "tests.helpers.engine_backends:ScriptedBackend"}
    with sessions() as s:
        ids = [svc.create_sweep(s, spec=SweepSpec.model_validate(spec), owner=o).id for o in ("alice", "bob")]

    def rows(i):  # noqa: ANN001, ANN202
        with sessions() as s:
            return store.all_trials(s, sweep_id=i)

    def mid_sweep() -> bool:
        return all(sum(t.status == "completed" for t in rows(i)) >= 2 and any(t.status == "running" for t in rows(i))
                   for i in ids)

    first = start_coordinator(url, tmp_path, settings='owner_max_devices={"*": 4}')
    try:
        wait_for(mid_sweep, 120, "both sweeps to be mid-way")
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    finally:
        if first.poll() is None:
            first.kill()
    at_kill = {i: {t.number for t in rows(i) if t.status == "running"} for i in ids}
    assert all(at_kill.values())
    second = start_coordinator(url, tmp_path, settings='owner_max_devices={"*": 4}')
    try:
        def done() -> bool:
            with sessions() as s:
                return all(store.get_sweep(s, sweep_id=i).status in store.FINISHED_SWEEP_STATUSES for i in ids)
        wait_for(done, 180, "both resumed sweeps to finish")
    finally:
        second.send_signal(signal.SIGKILL)
        second.wait(10)
    every = []
    for i in ids:
        with sessions() as s:
            assert store.get_sweep(s, sweep_id=i).status == "completed"
        all_rows = rows(i)
        every += all_rows
        live = [t for t in all_rows if t.status != "interrupted"]
        assert sorted(t.number for t in live) == list(range(8))  # none lost, none twice
        interrupted = [t for t in all_rows if t.status == "interrupted"]
        assert {t.number for t in interrupted} == at_kill[i]
        for t in interrupted:  # re-run under the same number as attempt + 1
            rerun = next(x for x in live if x.number == t.number)
            assert rerun.attempt == t.attempt + 1 and rerun.layout_key == t.layout_key
    # The two sweeps ran side by side, within the 8 devices, one trial of each owner at a time.
    live = [t for t in every if t.status != "interrupted"]
    assert any(x.sweep_id != y.sweep_id and x.started_at < y.finished_at and y.started_at < x.finished_at
               for x in live for y in live)
    assert peak_devices(live) <= 8 and all(peak_devices(live, lambda t, i=i: t.sweep_id == i) <= 4 for i in ids)
    engine.dispose()


def test_api_priority_queue_position_and_owner_limits(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from api.main import create_app

    url = f"sqlite:///{tmp_path / 'q.db'}"
    store.upgrade(url)
    tokens = {"alice": "tok-a-1", "bob": "tok-b-2", "carol": "tok-c-3"}
    settings = Settings(home=tmp_path, database_url=url, api_tokens=tokens, ray_address=None,
                        owner_max_devices={"carol": 2}, owner_device_hours_per_day={"*": 5})
    spec = {"model": "tiny", "cluster": "cpu-local", "training": {"global_batch": 16}, "backend": "simulate"}

    def post(who: str, query: str = ""):  # noqa: ANN202
        return client.post(f"/api/sweeps{query}", json=spec, headers={"Authorization": f"Bearer {tokens[who]}"})

    with TestClient(create_app(settings, run_engine=False), raise_server_exceptions=False) as client:
        r = post("alice", "?priority=urgent")
        assert r.status_code == 422 and "priority" in r.json()["detail"] and "urgent" in r.json()["detail"]
        r = post("carol")  # a 4-device trial, carol may hold 2
        assert r.status_code == 422 and r.json()["detail"].startswith("cluster: a trial of this sweep needs 4 devices")
        low = post("alice", "?priority=low").json()
        high = post("bob", "?priority=high").json()
        normal = post("alice").json()
        assert (low["priority"], high["priority"], normal["priority"]) == ("low", "high", "normal")
        assert high["running_trials"] == 0
        # Nobody holds devices: priority, then age.
        positions = {s["id"]: s["queue_position"] for s in client.get("/api/sweeps").json()["items"]}
        assert [positions[s["id"]] for s in (high, normal, low)] == [1, 2, 3]
        assert client.get(f"/api/sweeps/{high['id']}").json()["queue_position"] == 1
        page = client.get("/").text  # the dashboard's list shows the same places
        assert 'title="place in the queue' in page and ">#1</span> <span class=\"muted\">high</span>" in page
        assert ">#3</span> <span class=\"muted\">low</span>" in page
        assert "queued #1" in client.get(f"/sweeps/{high['id']}").text
        assert store.list_sweeps(store.make_sessionmaker(store.create_engine(url))(), status="queued")[1] == 3
