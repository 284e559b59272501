"""Device leases in the store (api/store/_leases.py): the coordinators on one database count each
other's devices, so two of them on one cluster never hold more than it has; a crashed coordinator's
leases stop counting once their heartbeat is older than the TTL."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from test_concurrency import T0, _peak, _wait

from api import store
from api.engine._share import Claimant, DeviceLedger
from api.spec import SweepSpec
from api.store._leases import DeviceLease
from api.store._models import utcnow
from api.sweeps import service as svc

TESTS = Path(__file__).resolve().parent

# One sweep at a time per coordinator: each of the two runs the one sweep it claimed first.
COORDINATOR = """
import threading
from api.engine import SweepRunner
from api.settings import Settings
SweepRunner(Settings(max_concurrent_sweeps=1), stale_after_s=600, poll_s=0.2).run_pending(threading.Event())
"""


def _start(url: str, home: Path) -> subprocess.Popen:
    env = {**os.environ, "MESHTUNE_DATABASE_URL": url, "MESHTUNE_HOME": str(home),
           "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", COORDINATOR], env=env, cwd=TESTS.parent,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_a_lease_whose_heartbeat_expired_no_longer_counts(tmp_path: Path) -> None:
    _, sessions = store.open_store(f"sqlite:///{tmp_path / 'l.db'}")
    first = DeviceLedger(8, sessions=sessions, pool="scripted", holder="host-a:1:aa", ttl_s=30.0)
    # sync_s=0: it re-reads the others' leases on every ask (a coordinator does every SYNC_S).
    second = DeviceLedger(8, sessions=sessions, pool="scripted", holder="host-b:2:bb", ttl_s=30.0, sync_s=0)
    alice, bob = Claimant(1, "alice", "normal", T0), Claimant(2, "bob", "normal", T0)
    held = first.try_acquire(alice, 8)
    assert held is not None
    # The other coordinator sees alice's 8 devices and gets none.
    assert second.try_acquire(bob, 4) is None
    assert second.held_by("alice") == 8 and second.free() == 0
    with store.session_scope(sessions) as s:  # the first coordinator stops beating (it crashed)
        s.execute(sa.update(DeviceLease).values(heartbeat_at=utcnow() - timedelta(seconds=31)))
    got = second.try_acquire(bob, 4)
    assert got is not None and got.devices == 4
    assert second.held_by("alice") == 0 and second.free() == 4
    with sessions() as s:  # the dead lease was removed by the grant that no longer counted it
        assert [(lease.owner, lease.devices) for lease in s.scalars(sa.select(DeviceLease))] == [("bob", 4)]
    second.release(got)
    with sessions() as s:
        assert s.scalar(sa.select(sa.func.count()).select_from(DeviceLease)) == 0


def test_a_live_lease_is_kept_alive_by_its_holder(tmp_path: Path) -> None:
    _, sessions = store.open_store(f"sqlite:///{tmp_path / 'l.db'}")
    first = DeviceLedger(8, sessions=sessions, pool="scripted", holder="host-a:1:aa")
    # A TTL of 20 s: alice's lease, last beaten 25 s ago, is dead to it unless beaten since.
    second = DeviceLedger(8, sessions=sessions, pool="scripted", holder="host-b:2:bb", ttl_s=20.0, sync_s=0)
    bob = Claimant(2, "bob", "normal", T0)
    assert first.try_acquire(Claimant(1, "alice", "normal", T0), 8) is not None

    def age(seconds: float) -> None:
        with store.session_scope(sessions) as s:
            s.execute(sa.update(DeviceLease).values(heartbeat_at=utcnow() - timedelta(seconds=seconds)))

    age(25)
    first.beat(force=True)  # what a pass of any loop of the first coordinator does (throttled)
    assert second.try_acquire(bob, 4) is None  # still alice's
    # Another pool (another backend's devices) is not this cluster.
    assert DeviceLedger(8, sessions=sessions, pool="ray", holder="host-b:2:bb").try_acquire(bob, 4) is not None
    age(25)  # not beaten since: dead
    assert second.try_acquire(bob, 4) is not None


@pytest.mark.slow
@pytest.mark.parametrize("db", [pytest.param("postgresql", marks=pytest.mark.postgres), "sqlite"])
def test_two_coordinators_on_one_database_never_hold_more_than_the_cluster(tmp_path: Path, db: str, request) -> None:  # noqa: ANN001
    url = request.getfixturevalue("fresh_pg_url") if db == "postgresql" else f"sqlite:///{tmp_path / 'c.db'}"
    engine, sessions = store.open_store(url)
    spec = {"model": "tiny", "cluster": "cpu-local", "training": {"global_batch": 16},
            "search": {"sampler": "random", "max_trials": 6, "remeasure_top_k": 0},
            # ScriptedBackend: 8 "devices"; 4 per trial, so each coordinator alone would run two at once.
            "trial": {"options": {"sleep_s": 0.6}}, "backend": "_engine_backends:ScriptedBackend"}
    with sessions() as s:
        ids = [svc.create_sweep(s, spec=SweepSpec.model_validate(spec), owner=o).id for o in ("alice", "bob")]
    procs = [_start(url, tmp_path), _start(url, tmp_path)]

    def sweeps() -> list[store.Sweep]:
        with sessions() as s:
            return [store.get_sweep(s, sweep_id=i) for i in ids]

    try:
        _wait(lambda: all(sw.runner_id for sw in sweeps()), 120, "each coordinator to claim a sweep")
        runners = {sw.runner_id for sw in sweeps()}
        _wait(lambda: all(sw.status in store.FINISHED_SWEEP_STATUSES for sw in sweeps()), 240,
              "both sweeps to finish")
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
    assert len(runners) == 2  # one sweep per coordinator process
    assert [sw.status for sw in sweeps()] == ["completed", "completed"]
    with sessions() as s:
        rows = [t for i in ids for t in store.all_trials(s, sweep_id=i)]
    assert {t.world_size for t in rows if t.started_at} == {4}
    peak = _peak(rows)
    print(f"peak devices held at once over both coordinators: {peak}")
    assert peak <= 8
    with sessions() as s:  # every lease was given back
        assert s.scalar(sa.select(sa.func.count()).select_from(DeviceLease)) == 0
    engine.dispose()
