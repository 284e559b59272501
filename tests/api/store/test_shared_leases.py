"""The coordinators' one device queue in the store (api/store/_leases.py, api/engine/_shared.py): a
release goes to the sweep the order names whichever coordinator runs it, owners holding alike take
turns, owner limits and the capacity count every coordinator, a crashed coordinator's leases are freed
and the lease table keeps every grant for an audit; two coordinator processes on one cluster never
hold more than it has. Three coordinators under load and faults: tests/api/engine/test_coordinators.py."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from api import store
from api.engine._share import Claimant, OwnerLimits
from api.engine._shared import SharedLedger, cluster_identity
from api.settings import Settings
from api.spec import SweepSpec
from api.store._leases import ClusterMember, DeviceWaiter, lease_intervals, peak_held
from api.store._models import utcnow
from api.sweeps import service as svc
from tests.helpers.devices_held import T0, peak_devices, wait_for

TESTS = Path(__file__).resolve().parents[2]

# One sweep at a time per coordinator: each of the two runs the one sweep it claimed first.
COORDINATOR = """
import threading
from api.engine import SweepRunner
from api.settings import Settings
SweepRunner(Settings(max_concurrent_sweeps=1), stale_after_s=600, poll_s=0.2).run_pending(threading.Event())
"""


def _start(url: str, home: Path) -> subprocess.Popen:
    env = {**os.environ, "MESHTUNE_DATABASE_URL": url, "MESHTUNE_HOME": str(home),
           "PYTHONPATH": os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", COORDINATOR], env=env, cwd=TESTS.parent,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _ledger(sessions, holder: str, capacity: int = 8, **kw) -> SharedLedger:  # noqa: ANN001
    # poll_s=0, sync_s=0: it reads the store on every ask (a coordinator does every POLL_S / SYNC_S).
    return SharedLedger(capacity, sessions=sessions, pool="scripted", holder=holder, poll_s=0, sync_s=0, **kw)


def _age(sessions, holder: str, seconds: float) -> None:  # noqa: ANN001
    with store.session_scope(sessions) as s:
        s.execute(sa.update(ClusterMember).where(ClusterMember.holder == holder)
                  .values(heartbeat_at=utcnow() - timedelta(seconds=seconds)))


def test_one_queue_a_release_goes_to_the_sweep_the_order_names_on_any_coordinator(tmp_path: Path) -> None:
    """Before, the coordinator that released devices took them back at once for its own waiter; the
    store's queue gives them to the owner holding the fewest, whichever coordinator runs its sweep."""
    _, sessions = store.open_store(f"sqlite:///{tmp_path / 'l.db'}")
    first, second = _ledger(sessions, "host-a:1:aa"), _ledger(sessions, "host-b:2:bb")
    alice, bob, alice2 = (Claimant(i, o, "normal", T0) for i, o in ((1, "alice"), (2, "bob"), (3, "alice")))
    held = first.try_acquire(alice, 8)
    assert held is not None and held.lease_id is not None
    assert second.try_acquire(bob, 8) is None  # waits (on the other coordinator)
    assert first.try_acquire(alice2, 8) is None  # waits too, behind bob: alice holds 8
    assert first.waiting() == [2, 3] and second.held_by("alice") == 8 and second.free() == 0
    first.release(held)  # its dispatch grants bob's request, not the releasing coordinator's
    assert first.try_acquire(alice2, 8) is None
    got = second.try_acquire(bob, 8)
    assert got is not None and got.devices == 8 and first.held_by("bob") == 8
    second.release(got)
    again = first.try_acquire(alice2, 8)
    assert again is not None
    first.release(again)
    with sessions() as s:  # the history: three grants, each released, never over 8 at once
        leases = lease_intervals(s, pool="scripted")
        assert [(x.owner, x.holder, x.release_cause) for x in leases] == [
            ("alice", "host-a:1:aa", "released"), ("bob", "host-b:2:bb", "released"),
            ("alice", "host-a:1:aa", "released")]
        assert peak_held(leases)[0] == 8
        assert not s.scalars(sa.select(DeviceWaiter)).all()


def test_equal_owners_take_turns_and_owner_limits_count_every_coordinator(tmp_path: Path) -> None:
    _, sessions = store.open_store(f"sqlite:///{tmp_path / 'l.db'}")
    limit = {"carol": OwnerLimits(max_devices=2)}
    a, b = (_ledger(sessions, h, 2, limits=lambda o: limit.get(o, OwnerLimits())) for h in ("host-a:1:aa", "host-b:2:bb"))
    # Three owners holding nothing; the sweep created first does not win every tie: the request that
    # has waited longest does (before, the youngest owner's sweep could wait for ever).
    old, mid, young = (Claimant(i, o, "normal", T0 + timedelta(hours=i)) for i, o in ((1, "x"), (2, "y"), (3, "z")))
    g = a.try_acquire(old, 2)
    assert g is not None
    assert b.try_acquire(young, 2) is None and a.try_acquire(mid, 2) is None
    a.release(g)
    assert a.try_acquire(old, 2) is None  # x asks again: behind z and y, which waited longer
    g = b.try_acquire(young, 2)
    assert g is not None and a.try_acquire(mid, 2) is None
    b.release(g)
    g = a.try_acquire(mid, 2)
    assert g is not None
    a.release(g)
    assert a.try_acquire(old, 2) is not None
    # carol may hold 2 in all: her second request, on another coordinator, waits for her own room and
    # does not hold back erin's behind it.
    c, d = (SharedLedger(8, sessions=sessions, pool="p8", holder=h, poll_s=0, sync_s=0,
                         limits=lambda o: limit.get(o, OwnerLimits())) for h in ("host-c:3:cc", "host-d:4:dd"))
    assert c.try_acquire(Claimant(5, "carol", "normal", T0), 2) is not None
    assert d.try_acquire(Claimant(6, "carol", "high", T0), 2) is None
    assert d.try_acquire(Claimant(7, "erin", "low", T0 + timedelta(hours=9)), 4) is not None
    assert d.free() == 2 and d.held_by("carol") == 2 and d.head_key() is None  # carol's is out of the order
    # Two coordinators that disagree on the cluster's size: grants use the smaller figure, in both.
    e = SharedLedger(4, sessions=sessions, pool="p8", holder="host-e:5:ee", poll_s=0, sync_s=0)
    assert e.try_acquire(Claimant(8, "fred", "normal", T0), 1) is None  # 6 held of the 4 now counted
    assert d.free() == -2 and (c.capacity, d.capacity, e.capacity) == (8, 4, 4)  # c has not read it yet


def test_a_dead_coordinators_leases_are_freed_and_a_late_grant_is_given_back(tmp_path: Path) -> None:
    _, sessions = store.open_store(f"sqlite:///{tmp_path / 'l.db'}")
    first = _ledger(sessions, "host-a:1:aa", ttl_s=30.0)
    second = _ledger(sessions, "host-b:2:bb", ttl_s=30.0)
    alice, bob = Claimant(1, "alice", "normal", T0), Claimant(2, "bob", "normal", T0)
    assert first.try_acquire(alice, 8) is not None
    assert second.try_acquire(bob, 4) is None
    first.flush()  # nothing due: no beat
    _age(sessions, "host-a:1:aa", 25)
    first._beat_at = -1e9  # its next call beats (a loop's pass does, every LEASE_BEAT_S)
    first.flush()
    assert second.try_acquire(bob, 4) is None  # beaten 0 s ago: still alice's
    _age(sessions, "host-a:1:aa", 31)  # the first coordinator stopped beating (crashed)
    second._beat_at = -1e9
    got = second.try_acquire(bob, 4)  # its beat, due, dispatches: the dead member is found
    assert got is not None and got.devices == 4
    with sessions() as s:
        causes = {(x.owner, x.release_cause) for x in lease_intervals(s, pool="scripted")}
        assert causes == {("alice", "holder gone"), ("bob", None)}
        assert [m.holder for m in s.scalars(sa.select(ClusterMember))] == ["host-b:2:bb"]
    # A request withdrawn after the store granted it: the grant is given back, not left held.
    carol = Claimant(3, "carol", "normal", T0)
    assert second.try_acquire(carol, 8) is None  # waits for bob's 4
    second.release(got)  # dispatched to carol's request ...
    second.withdraw(3)  # ... which the loop no longer makes
    with sessions() as s:
        assert not [x for x in lease_intervals(s, pool="scripted") if x.released_at is None]
    # Another pool (another cluster's devices) is not this one.
    assert SharedLedger(8, sessions=sessions, pool="ray:other", holder="host-b:2:bb").try_acquire(bob, 8) is not None


def test_the_cluster_is_named_explicitly_or_by_the_backend() -> None:
    from types import SimpleNamespace

    ray_like = SimpleNamespace(name="ray", cluster_id=lambda: "6da5cd80")
    assert cluster_identity(ray_like) == "ray:6da5cd80"  # two coordinators on one Ray share it
    assert cluster_identity(ray_like, "prod-a") == "ray:prod-a"  # the configured name wins
    assert cluster_identity(SimpleNamespace(name="simulate")) == "simulate"  # none: the backend's name
    assert cluster_identity(SimpleNamespace(name="simulate"), "prod-a") == "simulate:prod-a"
    with pytest.raises(ValueError, match=r"^MESHTUNE_CLUSTER_NAME='two words': not a name") as bad:
        Settings(cluster_name="two words")
    assert str(bad.value).count("MESHTUNE_CLUSTER_NAME") == 1  # the line names the variable once
    assert Settings(cluster_name="").cluster_name is None


@pytest.mark.slow
def test_two_coordinators_on_sqlite_share_the_cluster_fairly(tmp_path: Path) -> None:
    """SQLite, the embedded store (PostgreSQL with three coordinators: tests/api/engine/test_coordinators.py)."""
    url = f"sqlite:///{tmp_path / 'c.db'}"
    engine, sessions = store.open_store(url)
    spec = {"model": "tiny", "cluster": "cpu-local", "training": {"global_batch": 16},
            "search": {"sampler": "random", "max_trials": 6, "remeasure_top_k": 0},
            # ScriptedBackend: 8 "devices"; 4 per trial, so each coordinator alone would run two at once.
            "trial": {"options": {"sleep_s": 0.6}}, "backend": "tests.helpers.engine_backends:ScriptedBackend"}
    with sessions() as s:
        ids = [svc.create_sweep(s, spec=SweepSpec.model_validate(spec), owner=o).id for o in ("alice", "bob")]
    procs = [_start(url, tmp_path), _start(url, tmp_path)]

    def sweeps() -> list[store.Sweep]:
        with sessions() as s:
            return [store.get_sweep(s, sweep_id=i) for i in ids]

    try:
        wait_for(lambda: all(sw.runner_id for sw in sweeps()), 120, "each coordinator to claim a sweep")
        runners = {sw.runner_id for sw in sweeps()}
        wait_for(lambda: all(sw.status in store.FINISHED_SWEEP_STATUSES for sw in sweeps()), 240,
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
    peak = peak_devices(rows)
    print(f"peak devices held at once over both coordinators: {peak}")
    assert peak <= 8
    # Fair between the coordinators: each owner held one of the two 4-device slots at a time (before,
    # the coordinator that released took its devices back at once and bob's sweep began after alice's).
    a, b = ([t for t in rows if t.sweep_id == i and t.started_at] for i in ids)
    assert any(x.started_at < y.finished_at and y.started_at < x.finished_at for x in a for y in b)
    with sessions() as s:  # every lease was given back; the history never held more than the cluster
        leases = lease_intervals(s, pool="scripted")
        assert leases and all(x.released_at is not None for x in leases)
        assert peak_held(leases)[0] <= 8
    engine.dispose()
