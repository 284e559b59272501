"""Placement proven on a real multi-node Ray cluster on this machine (CPU ranks on gloo): a head
and 3 worker nodes of 2 devices each (tests/helpers/multinode.py, in a child process so that the session's
own Ray stays connected here). Each trial's ranks land as the tuner's placement says — a node's
ranks contiguous and on one Ray node, every TP group inside a node, PP crossing nodes — and the
rank processes report it themselves; a TP group that would cross a node is refused unless allowed;
killing a worker node mid-trial fails only the trial on it, as a node-lost crash within 60 s,
frees its devices, and the next trial is placed on the remaining nodes and completes; the same with
three coordinators placing gangs at once."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

import psutil
import pytest

from tuner import Layout, cluster_spec, model_spec, place, training_spec
from workers import TrialRequest

HERE = Path(__file__).resolve().parent
NODES = 3
LOST_WITHIN_S = 60.0

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # hang guard: actors start slowly on a loaded machine


class Cluster:
    """The child process that holds the cluster; ``call(op, **kw)`` runs one of its commands."""

    def __init__(self, tmp: Path) -> None:
        key = secrets.token_bytes(16)
        sock = str(tmp / "driver.sock")
        self.listener = Listener(sock, family="AF_UNIX", authkey=key)
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
        # A private Ray temp dir: a head node writes its address to <tmp>/ray/ray_current_cluster, and a
        # plain ray.init() anywhere on the machine would join that cluster instead of starting its own.
        # Short (not under pytest's tmp_path): Ray's unix sockets live there and paths are capped at 107.
        self.ray_tmp = tempfile.mkdtemp(prefix="mt-ray-", dir="/tmp")
        env["RAY_TMPDIR"] = self.ray_tmp
        self.log = tmp / "driver.log"
        with open(self.log, "w") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen([sys.executable, str(HERE.parent / "helpers" / "multinode.py"), sock, key.hex(), str(NODES)],
                                         env=env, stdout=subprocess.DEVNULL, stderr=log)
        accepted: list[Any] = []
        waiter = threading.Thread(target=lambda: accepted.append(self.listener.accept()), daemon=True)
        waiter.start()
        while waiter.is_alive():
            waiter.join(1.0)
            self._check_alive()
        self.conn = accepted[0]
        ready = self._recv()
        assert ready.get("ready"), ready.get("raised")

    def _check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"the cluster's driver exited ({self.proc.returncode}):\n"
                                 + self.log.read_text()[-4000:])

    def _recv(self) -> dict[str, Any]:
        while not self.conn.poll(1.0):  # a command waits on trials (minutes); a dead child is seen at once
            self._check_alive()
        return self.conn.recv()

    def call(self, op: str, **kwargs: Any) -> dict[str, Any]:
        self.conn.send((op, kwargs))
        out = self._recv()
        assert "raised" not in out or op in ("result",), out["raised"]
        return out

    def close(self) -> None:
        try:
            self.call("stop")
        finally:
            self.conn.close()
            self.listener.close()
            rest = psutil.Process(self.proc.pid).children(recursive=True) if self.proc.poll() is None else []
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:  # a wedged driver: stop it and the Ray processes it started
                for p in [*rest, psutil.Process(self.proc.pid)]:
                    with contextlib.suppress(psutil.Error):
                        p.kill()
                self.proc.wait(30)
            shutil.rmtree(self.ray_tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("multinode"))
    try:
        yield c
    finally:
        c.close()


def _request(layout: Layout, nodes: int, **kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = dict(
        model=model_spec("tiny"), training=training_spec({"global_batch": 8}), layout=layout,
        cluster=cluster_spec({"preset": "cpu-local", "nodes": nodes, "devices_per_node": 2}),
        warmup_steps=1, measure_steps=1, step_timeout_s=120)
    return TrialRequest(**{**base, **kw}).to_dict()


def _run(cluster: Cluster, tag: str, request: dict[str, Any], program: str | None = None) -> dict[str, Any]:
    cluster.call("start", tag=tag, request=request, program=program)
    return cluster.call("result", tag=tag)


@pytest.mark.parametrize("layout", [Layout(tp=2, pp=2), Layout(tp=2, dp=2), Layout(dp=2, pp=2)],
                         ids=lambda x: x.key)
def test_each_trials_ranks_land_as_the_placement_says(cluster: Cluster, layout: Layout) -> None:
    nodes = set(cluster.call("nodes")["nodes"].values())
    out = _run(cluster, layout.key, _request(layout, 2), program="probe")
    assert out.get("error") is None and "raised" not in out, out
    reports = sorted(out["reports"], key=lambda r: r["rank"])
    where = [r["node_id"] for r in reports]  # what each rank's own process says
    assert where == out["rank_nodes"]  # ... is what the trial records
    assert set(where) <= nodes and len(set(where)) == 2  # two worker nodes, never the head
    # A node's ranks are contiguous (node-major, as the tuner numbers them) and share one Ray node.
    placement = place(layout, cluster_spec({"preset": "cpu-local", "nodes": 2, "devices_per_node": 2}))
    for rank, (node, _) in enumerate(placement.rank_devices):
        assert where[rank] == where[2 * node]
    assert where[0] != where[2]
    # The gang's placement group is one bundle per node of the placement, each on its own Ray node.
    (group,) = cluster.call("groups_of", groups=[2, 2])["groups"]
    assert group["strategy"] == "STRICT_SPREAD" and group["state"] == "CREATED"
    assert {int(k): v for k, v in group["bundles"].items()} == {0: {"CPU": 2.0}, 1: {"CPU": 2.0}}
    assert {int(k): v for k, v in group["bundles_to_node_id"].items()} == {0: where[0], 1: where[2]}
    for r in reports:
        for axis in ("tp", "dp", "pp"):  # the mesh the workers built is the tuner's placement
            assert tuple(r["groups"][axis]) == placement.group(axis, r["rank"])
            assert r["sums"][axis] == getattr(layout, axis)  # every group's all-reduce went through
        assert len({where[m] for m in r["groups"]["tp"]}) == 1  # TP inside one node
        if layout.pp > 1:
            assert len({where[m] for m in r["groups"]["pp"]}) == layout.pp  # PP crosses nodes


def test_a_real_trial_records_its_rank_to_node_map(cluster: Cluster) -> None:
    out = _run(cluster, "train-tp2-pp2", _request(Layout(tp=2, pp=2, schedule="gpipe"), 2))
    result = out["result"]
    assert result["status"] == "completed", result["error"]
    a, b = result["rank_nodes"][0], result["rank_nodes"][2]
    assert result["rank_nodes"] == [a, a, b, b] and a != b


def test_tp_across_nodes_is_refused_unless_allowed(cluster: Cluster) -> None:
    refused = _run(cluster, "tp4", _request(Layout(tp=4), 2), program="probe")
    assert refused["raised"].startswith("LayoutError: tp=4 groups would cross nodes (devices_per_node=2)")
    allowed = _run(cluster, "tp4-allowed", _request(Layout(tp=4), 2, options={"allow_tp_across_nodes": True}),
                   program="probe")
    assert allowed.get("error") is None and "raised" not in allowed, allowed
    where = allowed["rank_nodes"]
    for r in allowed["reports"]:
        assert r["groups"]["tp"] == [0, 1, 2, 3] and r["sums"]["tp"] == 4
    assert len(set(where)) == 2  # the one TP group spans both nodes, as asked


def test_a_lost_node_fails_only_the_trial_on_it_frees_its_devices_and_the_next_trial_runs(cluster: Cluster) -> None:
    # The doomed trial spans two nodes (TP inside each, PP across; the warm gang of the tests above),
    # the survivor holds the third; the node of the doomed trial's ranks 0-1 is killed mid-step.
    long = dict(measure_steps=400, options={"sleep_per_step_s": 0.25})  # minutes: killed long before
    cluster.call("start", tag="doomed", request=_request(Layout(tp=2, pp=2, schedule="gpipe"), 2, **long))
    doomed = cluster.call("wait_steps", tag="doomed")["rank_nodes"]
    cluster.call("start", tag="survivor", request=_request(Layout(dp=2), 1, measure_steps=30,
                                                           options={"sleep_per_step_s": 0.25}))
    survivor = cluster.call("wait_steps", tag="survivor")
    assert set(doomed).isdisjoint(survivor["rank_nodes"])
    gone, kept_node = doomed[0], doomed[2]
    group = cluster.call("gang_group", tag="doomed")["group"]
    killed_at = cluster.call("kill_node", node_id=gone)["killed_at"]

    lost = cluster.call("result", tag="doomed")
    result = lost["result"]
    assert result["status"] == "crash" and result["error"]["message"].startswith(
        f"node lost: node {gone[:12]} died with ranks 0-1 of this trial"), result["error"]
    assert result["rank_nodes"] == doomed
    print(f"node loss classified {lost['finished_at'] - killed_at:.1f} s after the kill")
    assert lost["finished_at"] - killed_at < LOST_WITHIN_S
    kept = cluster.call("result", tag="survivor")
    assert kept["result"]["status"] == "completed", kept["result"]["error"]
    assert kept["result"]["rank_nodes"] == survivor["rank_nodes"]
    assert kept["finished_at"] > killed_at  # it was mid-trial when the node went

    # Its devices are released: its placement group is gone (the bundle on the surviving node too),
    # and no gang of the pool holds it.
    state = cluster.call("resources")
    assert state["groups"][group] == "REMOVED"
    assert group not in [g["group"] for g in state["gangs"]]
    # The sweep goes on: a trial over two nodes is placed on the two that remain and completes.
    after = _run(cluster, "after", _request(Layout(pp=2, dp=2, schedule="gpipe"), 2))["result"]
    assert after["status"] == "completed", after["error"]
    assert set(after["rank_nodes"]) == {kept_node, survivor["rank_nodes"][0]}  # never the lost node


def test_a_gang_idle_on_a_lost_node_is_replaced_not_refilled(cluster: Cluster) -> None:
    """The last trial's gang idles on the two nodes left; one of them dies and a new one joins. The next
    trial of that shape must not respawn ranks into the lost node's bundle (Ray re-places it only
    when there is room): the gang is destroyed and the trial gets a fresh one on the live nodes."""
    (idle,) = cluster.call("groups_of", groups=[2, 2])["groups"]
    first, second = (idle["bundles_to_node_id"][k] for k in sorted(idle["bundles_to_node_id"], key=int))
    joined = cluster.call("add_node", index=NODES)["node_id"]
    cluster.call("kill_node", node_id=second)
    again = _run(cluster, "again", _request(Layout(tp=2, pp=2, schedule="gpipe"), 2))["result"]
    assert again["status"] == "completed", again["error"]
    assert set(again["rank_nodes"]) == {first, joined}
    # A new group: the idle one was removed, not re-placed (that would keep its id).
    assert cluster.call("resources")["groups"][idle["placement_group_id"]] == "REMOVED"
    (now,) = cluster.call("groups_of", groups=[2, 2])["groups"]
    assert now["placement_group_id"] != idle["placement_group_id"]


def test_the_rank_to_node_map_is_stored_and_shown(tmp_path: Path) -> None:
    """A result's rank -> node map lands in trials.rank_nodes, the trial JSON of the API and the
    trial page (one row per node with its ranks). A store round trip: no cluster needed."""
    from fastapi.testclient import TestClient

    from api import store
    from api.main import create_app
    from api.settings import Settings
    from api.spec import SweepSpec
    from api.sweeps import service
    from workers import TrialResult

    url = f"sqlite:///{tmp_path / 'm.db'}"
    engine, sessions = store.open_store(url)
    spec = SweepSpec.model_validate({"model": "tiny", "cluster": {"preset": "cpu-local", "nodes": 2, "devices_per_node": 2},
                                     "training": {"global_batch": 8}, "backend": "simulate", "name": "placed"})
    a, b = "a" * 56, "b" * 56
    lay = Layout(tp=2, pp=2)
    with store.session_scope(sessions) as session:
        sid = service.create_sweep(session, spec=spec, owner="alice").id
        store.insert_trial(session, sweep_id=sid, number=0, layout=lay.__dict__.copy(), layout_key=lay.key,
                           world_size=4, backend="ray")
        assert store.record_result(session, sweep_id=sid, number=0, attempt=0, result=TrialResult(
            status="crash", backend="ray", rank_nodes=[a, a, b, b], wall_s=1.0, device_seconds=4.0))
    engine.dispose()
    with TestClient(create_app(Settings(database_url=url), run_engine=False)) as c:
        (trial,) = c.get(f"/api/sweeps/{sid}/trials").json()["items"]
        assert trial["rank_nodes"] == [a, a, b, b]
        assert c.get(f"/api/sweeps/{sid}/trials/{trial['id']}").json()["rank_nodes"] == [a, a, b, b]
        page = c.get(f"/sweeps/{sid}/trials/{trial['id']}").text
    table = page.split('id="rank-nodes"')[1].split("</table>")[0]
    assert table.count("<tr><td>") == 2
    assert f"<code>{a[:12]}</code></td><td>0-1</td><td>2</td>" in table
    assert f"<code>{b[:12]}</code></td><td>2-3</td><td>2</td>" in table


def test_a_gang_spreads_over_ray_nodes_and_a_single_node_ray_stands_in() -> None:
    from api.dashboard.views import rank_nodes
    from workers._gangs import strategy_for

    three = {"a": 2.0, "b": 2.0, "c": 2.0}
    assert strategy_for((2, 2), three) == "STRICT_SPREAD"  # one Ray node per placement node
    assert strategy_for((2, 2, 2, 2), three) is None  # four nodes' worth on three: refused
    assert strategy_for((4,), three) is None  # no Ray node holds four
    assert strategy_for((2, 2), {"local": 4.0}) == "STRICT_PACK"  # a laptop's Ray holds both "nodes"
    assert strategy_for((2, 2), {"local": 3.0}) is None
    assert rank_nodes(["x", "x", "y", "x"]) == [
        {"node": 0, "node_id": "x", "ranks": "0-1, 3", "count": 3}, {"node": 1, "node_id": "y", "ranks": "2", "count": 1}]
    assert rank_nodes(None) == []


def _peak_devices(trials: list[dict[str, Any]], *, after: float = float("-inf")) -> int:
    """The most devices the stored [started_at, finished_at) intervals hold at one instant >= ``after``."""
    edges = sorted((t, d) for r in trials if r["started_at"] is not None and (r["finished_at"] or 1e18) > after
                   for t, d in ((max(r["started_at"], after), r["world_size"]), (r["finished_at"] or 1e18, -r["world_size"])))
    peak = now = 0
    for _, d in sorted(edges, key=lambda e: (e[0], e[1])):  # a release before a grant at the same instant
        now += d
        peak = max(peak, now)
    return peak


def _peak_leases(leases: list[dict[str, Any]], *, after: float = float("-inf")) -> int:
    """The most devices the lease history holds at one instant >= ``after``."""
    return _peak_devices([{"started_at": x["granted_at"], "finished_at": x["released_at"], "world_size": x["devices"]}
                          for x in leases], after=after)


def test_three_coordinators_go_on_after_a_node_dies_under_one_of_their_trials(cluster: Cluster, tmp_path: Path) -> None:
    """Three coordinators (runners of their own on one store: own runner ids and ledgers, one device
    queue) place real gangs on 3 worker nodes of 2 devices: three sweeps of three owners, 2-rank trials
    (one node each, 3 at once). One node is killed mid-trial: that trial is a `crash` with the node-lost
    cause within 60 s, its layout is not told to the sampler (not infeasible) and runs once more on
    the nodes that remain, the listed layouts still waiting run too, every coordinator's ledger follows
    the live cluster (the lease history never holds more devices than it has, nor more than the 4 left
    once the loss is seen), all named by the Ray cluster's id. A sweep that needs the three nodes is
    refused trial by trial with the reason, and completes."""
    nodes = cluster.call("ensure_nodes", count=3)["nodes"]
    assert len(nodes) == 3
    trial = {"warmup_steps": 1, "measure_steps": 12, "step_timeout_s": 120, "options": {"sleep_per_step_s": 0.4}}
    base = {"model": "tiny", "backend": "ray", "cluster": {"preset": "cpu-local", "nodes": 1, "devices_per_node": 2},
            "training": {"global_batch": 8, "precision": "fp32"}, "trial": trial}
    listed = ([{"dp": 2}, {"tp": 2}], [{"pp": 2, "schedule": "gpipe"}], [{"dp": 2, "zero": 1}])
    small = [{**base, "name": f"after-a-node-dies-{i}", "search": {"layouts": lay, "repeats": 1}}
             for i, lay in enumerate(listed)]
    wide = {**base, "name": "needs-three-nodes", "cluster": {"preset": "cpu-local", "nodes": 3, "devices_per_node": 2},
            "training": {"global_batch": 12, "precision": "fp32"},
            "search": {"layouts": [{"tp": 2, "dp": 3}, {"dp": 6}], "repeats": 1}}
    *ids, second = cluster.call("sweep_start", db=str(tmp_path / "s.db"), specs=[*small, wide], coordinators=3)["ids"]
    now = cluster.call("sweep_stepping", count=3)
    stepping = now["stepping"]
    doomed_id = min(stepping, key=now["steps"].__getitem__)  # the furthest from its end
    gone = stepping[doomed_id][0]
    killed = cluster.call("kill_node", node_id=gone)
    out = cluster.call("sweep_result")
    assert "raised" not in out, out["raised"]
    sweeps = {int(k): v for k, v in out["sweeps"].items()}
    assert all(sweeps[i]["status"] == "completed" for i in ids), sweeps
    every = [r for i in ids for r in sweeps[i]["trials"]]

    hit, number = (int(x) for x in doomed_id.split("-")[:2])
    (lost,) = [r for r in every if r["infra"] == "node_lost"]
    rows = sorted(sweeps[hit]["trials"], key=lambda r: r["number"])
    assert lost in rows and lost["number"] == number and lost["status"] == "crash"
    assert lost["cause"].startswith(f"crash: node lost: node {gone[:12]} died with ranks 0-1 of this trial"), lost
    print(f"node loss recorded {lost['finished_at'] - killed['killed_at_wall']:.1f} s after the kill")
    assert lost["finished_at"] - killed["killed_at_wall"] < LOST_WITHIN_S
    # Not told to the sampler (so never infeasible); told: every other search result.
    told = sorted((t["sweep_id"], t["number"]) for t in out["told"] if t["sweep_id"] in ids)
    assert (hit, number) not in told
    assert told == sorted((i, r["number"]) for i in ids for r in sweeps[i]["trials"] if (i, r["number"]) != (hit, number))
    # The lost layout ran once more in its sweep, and every listed layout completed, none on the lost node.
    (again,) = [r for r in every if r["source"] == "requeued"]
    assert again in rows and again["layout_key"] == lost["layout_key"] and again["number"] > number
    for i, lay in zip(ids, listed, strict=True):
        done = [r for r in sweeps[i]["trials"] if r["status"] == "completed"]
        assert len(done) == len(lay) and len({r["layout_key"] for r in done}) == len(lay)
    assert all(gone not in r["rank_nodes"] for r in every if r["status"] == "completed"
               and r["started_at"] > killed["killed_at_wall"])
    assert len(every) == 5 and all(r["status"] in ("completed", "crash") for r in every)
    # Devices held: never over the 6 the cluster had; never over the 4 left once the loss was seen;
    # by the trial rows and by the lease history of the three coordinators, one pool: the Ray cluster's.
    assert _peak_devices(every) <= 6 and _peak_devices(every, after=lost["finished_at"]) <= 4
    leases = out["leases"]
    (pool,) = {x["pool"] for x in leases}
    assert pool.startswith("ray:") and len(pool) > len("ray:") + 8  # named by the cluster's id
    assert len({x["holder"] for x in leases}) == 3 and all(x["released_at"] for x in leases)
    # The lost trial's own lease holds the dead node's devices until its result is in: from its release on.
    freed = max(x["released_at"] for x in leases if x["sweep_id"] == hit and x["granted_at"] <= lost["started_at"])
    assert _peak_leases(leases) <= 6 and _peak_leases(leases, after=freed) <= 4
    assert min(m["capacity"] for m in out["members"]) == 4  # what the coordinators saw after the loss

    # Needs 3 nodes, 2 are left: each trial is refused with the reason (a result), the sweep completes.
    assert sweeps[second]["status"] == "completed", sweeps[second]
    refused = sweeps[second]["trials"]
    assert len(refused) == 2 and all(r["status"] == "crash" and r["infra"] == "cluster_shrank" for r in refused)
    assert "no longer fits the cluster left after a node loss" in refused[0]["cause"], refused[0]["cause"]
    assert not refused[0]["rank_nodes"]  # refused before any rank process started


class _LosesANode:
    """Simulated results (labelled so) from a backend whose cluster loses a node under its first
    trial: that trial is a node-lost crash, as the Ray backend reports one, and the capacity drops
    from 4 devices to 2; a trial wider than what is left is refused (BackendError), as Ray does."""

    name = "loses-a-node"

    def __init__(self) -> None:
        from workers.simulate import SimulateBackend

        self.sim, self.devices, self.lock = SimulateBackend(seed=0), 4, threading.Lock()

    def capacity(self) -> int:
        return self.devices

    def close(self) -> None:
        return None

    def run(self, request: Any) -> Any:
        from tuner import BackendError
        from workers import TrialError, TrialResult

        with self.lock:
            first, self.devices = self.devices == 4, 2
        if first:
            return TrialResult(status="crash", backend=self.name, simulated=True, device_seconds=1.0, error=TrialError(
                kind="crash", message="node lost: node abc died with ranks 0-1 of this trial", infra="node_lost"))
        if request.layout.world_size > self.devices:
            raise BackendError(f"needs {request.layout.world_size} devices, the cluster has {self.devices}")
        return self.sim.run(request)


def test_the_engine_does_not_hold_a_lost_node_against_the_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No cluster (simulated results): the engine's side of a node loss with an Optuna sampler. The
    lost trial is recorded but not told (its asked trial ends FAIL), not counted in max_trials, its
    layout re-queued once; the ledger follows the smaller capacity; a wider sweep is refused trial by
    trial as results, and completes."""
    from api import store
    from api.engine import SweepRunner, _learning
    from api.settings import Settings
    from api.spec import SweepSpec
    from api.sweeps import service

    told: list[int] = []
    tell = _learning.Learning.tell
    monkeypatch.setattr(_learning.Learning, "tell", lambda self, lay, h, row: (told.append(row.number), tell(self, lay, h, row)))
    url = f"sqlite:///{tmp_path / 'e.db'}"
    _, sessions = store.open_store(url)
    backend = _LosesANode()
    runner = SweepRunner(Settings(database_url=url, home=tmp_path), sessions=sessions, backend_factory=lambda spec: backend)
    base = {"model": "tiny", "training": {"global_batch": 8}, "backend": "simulate", "trial": {"measure_steps": 1}}
    with sessions() as s:
        small = service.create_sweep(s, owner="a", spec=SweepSpec.model_validate({
            **base, "cluster": {"preset": "cpu-local", "devices_per_node": 2},
            "search": {"sampler": "tpe", "max_trials": 3, "repeats": 1}})).id
        wide = service.create_sweep(s, owner="a", spec=SweepSpec.model_validate({
            **base, "cluster": {"preset": "cpu-local", "devices_per_node": 4},
            "search": {"sampler": "tpe", "max_trials": 2, "repeats": 1}})).id
    assert runner.run_sweep(small).status == "completed"
    with sessions() as s:
        rows = sorted(store.all_trials(s, sweep_id=small), key=lambda t: t.number)
    lost, *rest = rows
    assert (lost.status, lost.error["infra"], lost.cause) == ("crash", "node_lost", "crash: " + lost.error["message"])
    assert lost.number not in told and told == [t.number for t in rest]
    (again,) = [t for t in rest if t.source == "requeued"]
    assert again.layout_key == lost.layout_key and again.status == "completed"
    assert len(rest) == 3 and all(t.status == "completed" for t in rest)  # max_trials=3 besides the lost one
    assert runner._ledgers[backend.name].capacity == 2
    assert runner.run_sweep(wide).status == "completed"
    with sessions() as s:
        refused = store.all_trials(s, sweep_id=wide)
    assert len(refused) == 2 and all(t.status == "crash" and t.error["infra"] == "cluster_shrank" for t in refused)
    assert len(told) == 3  # a refusal is not the layout's either
    assert refused[0].cause == ("crash: refused: it no longer fits the cluster left after a node loss:"
                                " needs 4 devices, the cluster has 2")
