"""A real multi-node Ray cluster on this machine, driven over a socket by tests/workers/test_multinode.py.

A process can be connected to one Ray at a time, and the test session's own Ray (``ray_local``) must
stay up for the other tests, so the cluster lives in this child process: a head that holds no
devices and ``--nodes`` worker nodes (separate raylets, object stores and worker processes), each
declaring its own devices — 2 CPUs — and a custom resource ``meshtune_node_<i>`` naming it. The
test sends commands (start a trial, wait for it to step, kill a node, read the placement groups,
run sweeps through the engine — one ``SweepRunner`` or three, with SQLite — on this cluster) and gets
plain dicts back.

    python tests/helpers/multinode.py SOCKET AUTHKEY_HEX NODES
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import traceback
from multiprocessing.connection import Client
from typing import Any

DEVICES_PER_NODE = 2
NODE_STORE_BYTES = 80 * 2**20  # per node: the trials move no objects worth more


def probe(request: Any, *, device: str) -> dict[str, Any]:
    """Rank program: where this rank's process runs, and the groups of the mesh the workers build
    (workers.parallelize.build_mesh, the trainer's own), with one all-reduce over each group so a
    group that crosses nodes is shown to really talk across them."""
    import ray
    import torch
    import torch.distributed as dist

    from workers.parallelize import build_mesh

    mesh = build_mesh(request.layout, request.cluster, "cpu")
    groups, sums = {}, {}
    for axis in ("tp", "dp", "pp"):
        groups[axis] = [int(r) for r in mesh[axis].mesh.flatten().tolist()]
        t = torch.ones(1)
        dist.all_reduce(t, group=mesh[axis].get_group())
        sums[axis] = int(t.item())
    return {"rank": dist.get_rank(), "node_id": ray.get_runtime_context().get_node_id(), "groups": groups,
            "sums": sums}


class Driver:
    def __init__(self, nodes: int) -> None:
        import ray
        from ray.cluster_utils import Cluster

        from workers.ray_backend import RayBackend

        t0 = time.monotonic()
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "object_store_memory": NODE_STORE_BYTES, "include_dashboard": False})
        for i in range(nodes):
            self.cluster.add_node(num_cpus=DEVICES_PER_NODE, resources={f"meshtune_node_{i}": 1},
                                  object_store_memory=NODE_STORE_BYTES)
        ray.init(address=self.cluster.address, log_to_driver=False)
        self.cluster.wait_for_nodes()  # before any placement group (FIELD-NOTES: else STRICT_PACK never readies)
        self.start_s = time.monotonic() - t0
        self.backend = RayBackend()
        self.trials: dict[str, dict[str, Any]] = {}
        self.gang_of: dict[str, Any] = {}

    # --- commands ---------------------------------------------------------------------------------

    def nodes(self) -> dict[str, Any]:
        import ray

        out = {}
        for n in ray.nodes():
            labels = [k for k in n["Resources"] if k.startswith("meshtune_node_")]
            if n["Alive"] and labels:
                out[labels[0]] = n["NodeID"]
        return {"nodes": out, "start_s": self.start_s}

    def start(self, tag: str, request: dict[str, Any], program: str | None = None) -> dict[str, Any]:
        from workers import TrialRequest

        req = TrialRequest.from_dict(request)
        slot: dict[str, Any] = {"done": threading.Event()}

        def work() -> None:
            try:
                if program == "probe":
                    out = self.backend.run_program(req, probe)
                    slot["out"] = {"reports": out.reports, "rank_nodes": out.rank_nodes,
                                   "error": out.error and vars(out.error)}
                else:
                    slot["out"] = {"result": self.backend.run(req).to_dict()}
            except Exception as exc:  # noqa: BLE001 - the test reads what the backend raised
                slot["out"] = {"raised": f"{type(exc).__name__}: {exc}"}
            slot["finished_at"] = time.monotonic()
            slot["done"].set()

        self.trials[tag] = slot
        threading.Thread(target=work, daemon=True).start()
        return {}

    def result(self, tag: str, timeout_s: float = 600.0) -> dict[str, Any]:
        slot = self.trials[tag]
        if not slot["done"].wait(timeout_s):
            return {"raised": f"no result within {timeout_s:g} s"}
        return {**slot["out"], "finished_at": slot["finished_at"]}

    def wait_steps(self, tag: str, timeout_s: float = 600.0) -> dict[str, Any]:
        """Wait until ``tag``'s gang (the busy one no other trial owns) has stepped; its rank nodes."""
        import ray

        from workers._gangs import POOL

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.trials[tag]["done"].is_set():
                return {"raised": f"trial {tag} ended before stepping: {self.trials[tag]['out']}"}
            owned = {id(g) for t, g in self.gang_of.items() if t != tag}
            mine = self.gang_of.get(tag) or next(
                (g for g in list(POOL._gangs) if g.busy and id(g) not in owned and g.ranks
                 and all(s.info for s in g.ranks)), None)
            if mine is not None:
                self.gang_of[tag] = mine
                try:
                    snaps = ray.get([s.actor.snapshot.remote() for s in mine.ranks], timeout=30)
                except Exception:  # noqa: BLE001 - a rank still starting: ask again
                    snaps = []
                if snaps and all(s["phase"] == "steps" and s["steps"] >= 1 for s in snaps):
                    return {"rank_nodes": [s.info["node_id"] for s in mine.ranks],
                            "steps": [s["steps"] for s in snaps]}
            time.sleep(0.2)
        return {"raised": f"trial {tag} did not step within {timeout_s:g} s"}

    def add_node(self, index: int) -> dict[str, Any]:
        node = self.cluster.add_node(num_cpus=DEVICES_PER_NODE, resources={f"meshtune_node_{index}": 1},
                                     object_store_memory=NODE_STORE_BYTES)
        self.cluster.wait_for_nodes()
        return {"node_id": node.node_id}

    def kill_node(self, node_id: str) -> dict[str, Any]:
        """SIGKILL every process of the worker node (raylet, object store, its rank processes)."""
        import psutil
        from ray._private import ray_constants

        (node,) = [n for n in self.cluster.worker_nodes if n.node_id == node_id]
        (raylet,) = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET]
        # Its worker processes (the rank actors) are the raylet's children; Cluster.remove_node stops
        # only the node's own daemons and leaves them to notice, so they go at the same moment here,
        # as on a machine that dies.
        workers = psutil.Process(raylet.process.pid).children(recursive=True)
        killed_at = time.monotonic()
        self.cluster.remove_node(node, allow_graceful=False)
        for proc in workers:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(workers, timeout=30)
        return {"killed_at": killed_at, "killed_at_wall": time.time() - (time.monotonic() - killed_at)}

    def ensure_nodes(self, count: int) -> dict[str, Any]:
        """Add worker nodes until ``count`` are alive (earlier tests killed some)."""
        from workers._gangs import lost_nodes

        def live() -> dict[str, str]:  # the GCS calls a node killed a moment ago alive for a while
            nodes = self.nodes()["nodes"]
            gone = lost_nodes(list(nodes.values()))
            return {k: v for k, v in nodes.items() if v not in gone}

        index = 100
        while len(live()) < count:
            self.add_node(index)
            index += 1
        return {"nodes": live()}

    # --- a sweep through the engine, on this cluster ------------------------------------------------

    def sweep_start(self, db: str, specs: list[dict[str, Any]], coordinators: int = 1) -> dict[str, Any]:
        """Run ``specs`` through the coordinator's engine (``SweepRunner``, its device ledger) on this
        cluster, stored in SQLite at ``db``: with one coordinator one after the other; with several
        (runners of their own: own runner ids, own ledgers, one device queue in the store, as separate
        processes have) the first ``coordinators`` specs at once, one each and one owner each, then the
        rest one after the other on the first. What the sampler is told is recorded
        (``Learning.tell``, wrapped)."""
        from api import store
        from api.engine import _learning
        from api.engine._runner import SweepRunner
        from api.settings import Settings
        from api.spec import SweepSpec
        from api.sweeps import service
        from workers.ray_backend import RayBackend

        url = f"sqlite:///{db}"
        _, self.sessions = store.open_store(url)
        self.told: list[dict[str, Any]] = []
        tell = _learning.Learning.tell

        def spy(learning: Any, layout: Any, handle: Any, row: Any) -> None:
            self.told.append({"sweep_id": row.sweep_id, "number": row.number, "layout_key": layout.key,
                              "status": row.status})
            tell(learning, layout, handle, row)

        _learning.Learning.tell = spy  # type: ignore[method-assign]
        runners = [SweepRunner(Settings(database_url=url, backend="ray"), sessions=self.sessions,
                               backend_factory=lambda spec: RayBackend(), poll_s=0.2) for _ in range(coordinators)]
        owners = ["alice", "bob", "carol", "dave"]
        with self.sessions() as s:
            ids = [service.create_sweep(s, spec=SweepSpec.model_validate(spec), owner=owners[min(i, coordinators - 1)]).id
                   for i, spec in enumerate(specs)]
        self.sweep_done = threading.Event()
        self.sweep_out: dict[str, Any] = {}

        def work(runner: Any, sweep_ids: list[int]) -> None:
            try:
                for sid in sweep_ids:
                    runner.run_sweep(sid)
            except Exception:  # noqa: BLE001 - the test reads it
                self.sweep_out["raised"] = traceback.format_exc()

        plan = [(runners[0], ids[:1] + ids[coordinators:])] + [(runners[k], [ids[k]]) for k in range(1, coordinators)]

        def all_of() -> None:
            threads = [threading.Thread(target=work, args=p, daemon=True) for p in plan]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            self.sweep_done.set()

        threading.Thread(target=all_of, daemon=True).start()
        return {"ids": ids}

    def sweep_stepping(self, count: int, timeout_s: float = 600.0) -> dict[str, Any]:
        """Wait until ``count`` of the sweep's trials are stepping at once; trial id -> rank nodes, and
        trial id -> the optimizer steps its slowest rank has made."""
        import ray

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.sweep_done.is_set():
            busy = [g for g in self._pool() if g.busy and g.trial_id and g.ranks and all(s.info for s in g.ranks)]
            stepping, steps = {}, {}
            for g in busy:
                try:
                    snaps = ray.get([s.actor.snapshot.remote() for s in g.ranks], timeout=30)
                except Exception:  # noqa: BLE001 - a rank still starting: ask again
                    continue
                if all(s["phase"] == "steps" and s["steps"] >= 1 for s in snaps):
                    stepping[g.trial_id] = [s.info["node_id"] for s in g.ranks]
                    steps[g.trial_id] = min(s["steps"] for s in snaps)
            if len(stepping) >= count:
                return {"stepping": stepping, "steps": steps}
            time.sleep(0.2)
        return {"raised": f"{count} trials were not stepping at once within {timeout_s:g} s: {self.sweep_out}"}

    def sweep_result(self, timeout_s: float = 600.0) -> dict[str, Any]:
        from api import store

        if not self.sweep_done.wait(timeout_s):
            return {"raised": f"the sweeps did not end within {timeout_s:g} s"}
        from api.store._leases import ClusterMember, DeviceLease

        out: dict[str, Any] = {"sweeps": {}, "told": self.told, **self.sweep_out}
        with self.sessions() as s:
            out["leases"] = [{"pool": x.pool, "holder": x.holder, "sweep_id": x.sweep_id, "devices": x.devices,
                              "granted_at": x.granted_at.timestamp(),
                              "released_at": x.released_at.timestamp() if x.released_at else None}
                             for x in s.query(DeviceLease).order_by(DeviceLease.id)]
            out["members"] = [{"pool": m.pool, "holder": m.holder, "capacity": m.capacity}
                              for m in s.query(ClusterMember)]
            for sw in store.list_sweeps(s, limit=100)[0]:
                out["sweeps"][sw.id] = {"status": sw.status, "error": sw.error, "trials": [
                    {"number": t.number, "attempt": t.attempt, "status": t.status, "cause": t.cause,
                     "infra": (t.error or {}).get("infra"), "layout_key": t.layout_key, "source": t.source,
                     "world_size": t.world_size, "rank_nodes": t.rank_nodes,
                     "started_at": t.started_at.timestamp() if t.started_at else None,
                     "finished_at": t.finished_at.timestamp() if t.finished_at else None}
                    for t in store.all_trials(s, sweep_id=sw.id)]}
        return out

    def resources(self) -> dict[str, Any]:
        import ray
        from ray.util import placement_group_table

        return {"available": ray.available_resources(), "total": ray.cluster_resources(),
                "groups": {k: v["state"] for k, v in placement_group_table().items()},
                "gangs": [{"key": list(g.key), "busy": g.busy, "group": g.pgs[0].id.hex() if g.pgs else None}
                          for g in self._pool()]}

    def groups_of(self, groups: list[int]) -> dict[str, Any]:
        """Ray's own record of the placement groups of the pool's gangs of shape ("CPU", groups)."""
        from ray.util import placement_group_table

        table = placement_group_table()
        out = []
        for g in self._pool():
            if g.key == ("CPU", tuple(groups)) and g.pgs:
                row = table[g.pgs[0].id.hex()]
                out.append({k: row[k] for k in ("placement_group_id", "strategy", "bundles", "bundles_to_node_id", "state")})
        return {"groups": out}

    def gang_group(self, tag: str) -> dict[str, Any]:
        gang = self.gang_of[tag]
        return {"group": gang.pgs[0].id.hex() if gang.pgs else None}

    @staticmethod
    def _pool() -> list[Any]:
        from workers._gangs import POOL

        return list(POOL._gangs)

    def stop(self) -> dict[str, Any]:
        import ray

        self.backend.close()
        ray.shutdown()
        # Cluster.shutdown refuses to remove the head once a node was killed (the driver still looks
        # connected to it): stop every node's processes directly, waiting for them to exit.
        for node in [*self.cluster.worker_nodes, self.cluster.head_node]:
            node.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)
        ray._common.utils.reset_ray_address()  # the head's address file (in this process's RAY_TMPDIR)
        return {}


def main(sock: str, authkey_hex: str, nodes: int) -> None:
    conn = Client(sock, family="AF_UNIX", authkey=bytes.fromhex(authkey_hex))
    try:
        driver = Driver(nodes)
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        conn.send({"raised": traceback.format_exc()})
        return
    conn.send({"ready": True})
    while True:
        op, kwargs = conn.recv()
        try:
            reply = getattr(driver, op)(**kwargs)
        except Exception:  # noqa: BLE001
            reply = {"raised": traceback.format_exc()}
        conn.send(reply)
        if op == "stop":
            return


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
