"""The Ray backend: every rank of a trial is a reused Ray actor inside a placement group.

Ranks run in gangs from a per-process pool (workers/_gangs.py): one placement group with a bundle
per node of the tuner's ``Placement`` and one long-lived ``RankWorker`` per rank, reused by every
trial of the same shape with a fresh process group, so a launch costs one Ray call per rank.
``run(request)`` runs the trial's rank program and merges the ranks' reports into a ``TrialResult``;
``run_program(request, program)`` runs any picklable rank program with the same validation,
watchdog and clean-up. Validation happens before any process starts; a failed trial (oom, crash,
timeout, node lost) is a classified ``TrialError``; infrastructure not there now raises
``BackendUnavailable``. Every failure rule: docs/workers.md, "Ray backend".
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import ray
from ray.exceptions import RayError

from tuner import BackendError, SpecError, check_layout, place
from workers._contract import BackendUnavailable, TrialError, TrialRequest, TrialResult
from workers._gangs import (
    POOL,
    NodeLost,
    Slot,
    alive_nodes,
    ensure_actors,
    kill_actors,
    lost_nodes,
    strategy_for,
)
from workers._ray_start import check_reachable, start_ray
from workers._watchdog import node_lost_error, stalled_verdict, watch_gang
from workers.aggregate import aggregate

__all__ = ["GangRun", "RayBackend", "local_rank_and_device"]


@dataclass
class GangRun:
    """What ``RayBackend.run_program`` returns: every rank's report (rank order; empty on failure),
    or the error that explains the failure; the hosts the ranks ran on; wall time incl. launch."""

    reports: list[dict[str, Any]]
    error: TrialError | None
    hosts: list[str]
    wall_s: float
    rank_nodes: list[str] = field(default_factory=list)  # rank -> Ray node id of its process


class RayBackend:
    """``Backend`` running real trials on a local Ray or the Ray cluster at ``address``."""

    name = "ray"
    start_retry_delays_s: tuple[float, ...] = (5.0, 20.0)  # back-off between Ray start attempts

    def __init__(
        self,
        address: str | None = None,
        *,
        num_cpus: int | None = None,
        init_timeout_s: float = 120.0,
        placement_timeout_s: float = 120.0,
        actor_start_timeout_s: float = 180.0,
    ) -> None:
        self.address = address or os.environ.get("RAY_ADDRESS") or None
        if self.address:
            check_reachable(self.address)  # fail fast, naming the address, before Ray's long retries
        self.num_cpus = num_cpus
        self.init_timeout_s = init_timeout_s
        self.placement_timeout_s = placement_timeout_s
        self.actor_start_timeout_s = actor_start_timeout_s
        self._started_ray = False
        self._cancelled: set[str] = set()  # trial ids to stop (cancel)

    # --- Ray connection ---------------------------------------------------------------------------

    def _ensure_ray(self, min_cpus: int = 0) -> None:
        """Start (or join) Ray once per process, retried with back-off (workers/_ray_start.py)."""
        cpus = max(os.cpu_count() or 1, self.num_cpus or 0, min_cpus)
        if start_ray(self.address, num_cpus=cpus, retry_delays_s=self.start_retry_delays_s):
            self._started_ray = True

    def capacity(self) -> int:
        """Devices of the live cluster (GPUs, else CPUs) on its alive nodes: a node seen lost stops
        counting at once, not when the GCS declares it dead. A GCS read, cheap enough before each claim."""
        self._ensure_ray()
        return int(sum(alive_nodes("GPU").values())) or int(sum(alive_nodes("CPU").values()))

    def cluster_id(self) -> str:
        """The Ray cluster's id, the same for every driver of the cluster: coordinators on one Ray share
        one device queue, two local Rays do not (api/engine/_shared.py). Ray 2.60 has no public accessor
        (``ray._private.worker.global_worker.node.cluster_id``, the GCS's ``ClusterID``); its GCS
        address stands in if that moves."""
        self._ensure_ray()
        cid = getattr(getattr(ray._private.worker.global_worker, "node", None), "cluster_id", None)
        return cid.hex() if cid is not None else str(ray.get_runtime_context().gcs_address)

    def close(self) -> None:
        """Free the pool's idle gangs (shared with other backends of this process; busy ones stay);
        shut Ray down if this backend started it and nothing else runs on it."""
        unused = POOL.close_idle()
        if self._started_ray and unused and ray.is_initialized():
            ray.shutdown()
        self._started_ray = False

    def cancel(self, trial_id: str) -> None:
        """Stop trial ``trial_id`` now (its sweep was cancelled): its gang's actors are killed and its
        placement groups removed, so its devices are free within seconds; a trial not started yet
        never starts (BackendUnavailable). Its result, a failure, is not the layout's."""
        self._cancelled.add(trial_id)
        POOL.cancel(trial_id)

    # --- validation -----------------------------------------------------------------------------

    @staticmethod
    def _node_groups(request: TrialRequest) -> tuple[int, ...]:
        """Ranks per node, in node order, as the tuner's placement lays them out (node-major)."""
        allow = bool(request.options.get("allow_tp_across_nodes", False))
        rank_devices = place(request.layout, request.cluster, allow_tp_across_nodes=allow).rank_devices
        per_node = Counter(node for node, _ in rank_devices)
        return tuple(per_node[n] for n in sorted(per_node))

    def _validate(self, request: TrialRequest) -> tuple[str, tuple[int, ...], str]:
        """Everything that can be known before a process starts; returns (resource, node groups,
        placement-group strategy)."""
        layout, cluster = request.layout, request.cluster
        allow = request.options.get("allow_tp_across_nodes", False)
        if not isinstance(allow, bool):
            raise SpecError(f"options.allow_tp_across_nodes must be true or false, got {allow!r}")
        check_layout(layout, model=request.model, cluster=cluster, training=request.training,
                     allow_tp_across_nodes=allow)
        cap = request.options.get("memory_cap_bytes")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
            raise SpecError(f"options.memory_cap_bytes must be a non-negative integer, got {cap!r}")
        groups = self._node_groups(request)
        resource = "GPU" if cluster.device_kind == "cuda" else "CPU"
        self._ensure_ray(min_cpus=layout.world_size if resource == "CPU" else 0)
        nodes = alive_nodes(resource)  # the live cluster: a node seen lost no longer counts
        total = sum(nodes.values())
        if total < layout.world_size:
            raise BackendError(
                f"layout {layout.key} needs world size {layout.world_size} = {layout.world_size} {resource}"
                f" bundles, but the Ray cluster has {total:g} {resource}"
            )
        biggest = max(nodes.values(), default=0)
        if max(groups) > biggest:
            raise BackendError(
                f"layout {layout.key} needs {max(groups)} {resource} on one node (cluster"
                f" {cluster.name!r}: {cluster.devices_per_node} per node), but the largest Ray node has {biggest:g}"
            )
        strategy = strategy_for(groups, nodes)
        if strategy is None:
            raise BackendError(
                f"layout {layout.key} is placed on {len(groups)} nodes of {list(groups)} {resource} (cluster"
                f" {cluster.name!r}: {cluster.devices_per_node} per node), but the Ray cluster has"
                f" {len(nodes)} nodes with {resource}: {sorted(nodes.values(), reverse=True)}"
            )
        return resource, groups, strategy

    # --- one trial --------------------------------------------------------------------------------

    def run(self, request: TrialRequest) -> TrialResult:
        out = self.run_program(request)
        if out.error is None:
            result = aggregate(out.reports, request, backend=self.name, wall_s=out.wall_s)
            return replace(result, rank_nodes=out.rank_nodes)
        world = request.layout.world_size
        return TrialResult(
            status=out.error.kind,
            backend=self.name,
            error=out.error,
            env={"hosts": out.hosts, "world_size": world},
            rank_nodes=out.rank_nodes,
            wall_s=out.wall_s,
            device_seconds=out.wall_s * world,
        )

    def run_program(self, request: TrialRequest, program: Callable[..., Any] | None = None) -> GangRun:
        """Run ``program`` on every rank of ``request``'s layout, on a pooled gang, watched.

        ``program(request, device=...)`` is called in each rank's process after the process group
        is up (``workers._launch.run_rank``; default ``workers.train.train_trial``); it must be
        picklable (a module-level function or a ``functools.partial`` of one) and return a
        dataclass or dict. Validation (``_validate``), the watchdog, and the clean-up of ranks a
        failure left stuck are those of ``run``: raises LayoutError/BackendError before any
        process starts; a failing rank is ``GangRun.error``, never an exception."""
        t0 = time.monotonic()
        resource, groups, strategy = self._validate(request)
        world = request.layout.world_size
        init_timeout = float(request.options.get("init_timeout_s", self.init_timeout_s))
        gang = POOL.acquire((resource, groups), timeout_s=self.placement_timeout_s, strategy=strategy)
        clean, lost, error = False, set(), None
        rank_nodes: list[str] = []
        try:
            gang.trial_id = request.trial_id
            if request.trial_id in self._cancelled:  # cancelled while it waited for its gang
                raise BackendUnavailable(f"trial {request.trial_id} was cancelled before it started")
            try:
                ensure_actors(gang, timeout_s=self.actor_start_timeout_s)
            except NodeLost:  # it idled on a node that died since: a fresh gang on the nodes that remain
                POOL.discard(gang)
                gang = POOL.acquire((resource, groups), timeout_s=self.placement_timeout_s, strategy=strategy)
                gang.trial_id = request.trial_id
                ensure_actors(gang, timeout_s=self.actor_start_timeout_s)
            ranks = gang.ranks  # node-major: rank r is the r-th slot, as in the tuner's Placement
            hosts = sorted({s.info["host"] for s in ranks})
            rank_nodes = [s.info["node_id"] for s in ranks]
            try:
                port = ray.get(ranks[0].actor.free_port.remote(), timeout=self.actor_start_timeout_s)
            except RayError as exc:  # rank 0 died since its health check: nothing of the trial ran
                raise BackendUnavailable(f"rank 0's process was lost before the trial started: {exc}") from exc
            addr = ranks[0].info["ip"]
            refs = {}
            for rank, slot in enumerate(ranks):
                local, device = local_rank_and_device(ranks, rank, gpu=resource == "GPU")
                launch = {
                    "rank": rank,
                    "world_size": world,
                    "local_rank": local,
                    "master_addr": addr,
                    "master_port": port,
                    "device": device,
                    "init_timeout_s": init_timeout,
                    "program": program,
                }
                refs[slot.actor.run.remote(request, launch)] = rank
            reports, error, clean = watch_gang(refs, ranks, request, init_timeout)
        finally:
            if not clean:
                kill_actors(gang)
            if error is not None:  # every rank may have "returned": both died with their node
                lost = lost_nodes(rank_nodes)
            if lost:  # its bundle on the dead node would be re-placed on the survivors: free it all
                POOL.discard(gang)
            else:
                POOL.release(gang)
        if error is not None and lost:
            error = node_lost_error(error, rank_nodes, lost)
        ordered = [reports[r] for r in sorted(reports)] if error is None else []
        return GangRun(reports=ordered, error=error, hosts=hosts, wall_s=time.monotonic() - t0,
                       rank_nodes=rank_nodes)

    # The watchdog's verdict (workers/_watchdog.py), still reachable on a backend: tests drive it with
    # fake ranks as ``RayBackend()._stalled(...)``.
    _stalled = staticmethod(stalled_verdict)


def local_rank_and_device(ranks: list[Slot], rank: int, *, gpu: bool) -> tuple[int, str]:
    """(LOCAL_RANK, torch device) of ``rank``. GPU: every rank of a node sees the same
    CUDA_VISIBLE_DEVICES (the node's trial GPUs, ``_gangs.ensure_actors``) and uses the one Ray gave
    it, whose index in that list is also its LOCAL_RANK (torchrun's ``cuda:LOCAL_RANK`` convention,
    so code that reads LOCAL_RANK picks the same device). Ray hands out GPU ids in no particular
    order, so the slot order on the node cannot be used. CPU: the slot's order on its node."""
    slot = ranks[rank]
    if gpu:
        local = slot.info["visible"].index(slot.info["gpu_ids"][0])
        return local, f"cuda:{local}"
    return sum(1 for s in ranks[:rank] if s.info["node_id"] == slot.info["node_id"]), "cpu"
