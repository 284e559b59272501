"""The Ray backend: every rank of a trial is a reused Ray actor inside a placement group.

Actor reuse — the *gang pool*
  A gang is a set of placement groups plus one ``RankActor`` per bundle, for one shape:
  (device kind, ranks per node). A single-node cluster has one STRICT_PACK group of ``world``
  bundles ({"GPU": 1} each on a CUDA cluster, {"CPU": 1} on a CPU one); a multi-node cluster has
  one STRICT_PACK group per node of the tuner's ``Placement``, so ranks that the placement puts on
  one node (the innermost, chattiest axis first) really share a node. Gangs are kept after a
  trial: the next trial of the same shape — any layout of the same world size — reuses the same
  processes (torch and the rank program imported once) with a fresh process group on a fresh port.
  A trial of another shape evicts idle gangs (least recently used first) when Ray lacks room.
  A gang is held by one trial at a time; trials of different gangs run side by side.

Failures
  - Validation happens before any process starts: ``check_layout`` (world size vs the cluster's
    devices, divisibility) and the Ray resources (total and per node) -> LayoutError/BackendError
    naming the numbers.
  - A rank's exception comes back as a classified ``TrialError`` (workers/failures.py).
  - Watchdog: the driver polls each rank's ``Progress`` (beaten by every optimizer step) on a
    separate concurrency group of the actor; a rank idle longer than ``step_timeout_s`` (or than
    ``init_timeout_s + step_timeout_s`` before its first step) ends the trial as ``timeout``.
  - Whenever a trial does not end with every rank returning (timeout, a dead process, peers stuck
    after one rank failed), *that gang's* actors are killed — never another gang's — and respawned
    in the same placement groups on next use. One failing trial never breaks the pool or the caller.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

import tuner
from tuner import BackendError, check_layout
from workers._contract import TrialError, TrialRequest, TrialResult
from workers.aggregate import aggregate
from workers.failures import died_error, timeout_error

ERROR_GRACE_S = 2.0  # after one rank fails, how long its peers get to return before they are killed


class RankWorker:
    """One reusable rank process. ``run`` executes trials; ``snapshot`` answers the watchdog."""

    def __init__(self) -> None:
        import workers.train  # noqa: F401 - torch and the rank program, imported once per process
        from workers._launch import Progress

        self.progress = Progress()

    def info(self) -> dict[str, Any]:
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "pid": os.getpid(),
            "host": socket.gethostname(),
        }

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    def set_visible_devices(self, gpu_ids: list[str]) -> None:
        # Before any CUDA call in this process: every rank on a node sees the node's trial GPUs, so
        # NCCL can use peer-to-peer links (FIELD-NOTES, Ray launch pattern).
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)

    def run(self, request: TrialRequest, launch: dict[str, Any]) -> dict[str, Any]:
        from workers._launch import run_rank

        return run_rank(request, progress=self.progress, **launch)

    @ray.method(concurrency_group="control")
    def snapshot(self, with_stack: bool = False) -> dict[str, Any]:
        return self.progress.snapshot(with_stack=with_stack)


RankActor = ray.remote(concurrency_groups={"control": 1})(RankWorker)


@dataclass
class _Slot:
    actor: Any = None
    info: dict[str, Any] | None = None


@dataclass
class _Gang:
    key: tuple[str, tuple[int, ...]]
    pgs: list[PlacementGroup] = field(default_factory=list)
    slots: list[list[_Slot]] = field(default_factory=list)  # [node group][bundle]
    busy: bool = True
    last_used: float = field(default_factory=time.monotonic)

    @property
    def size(self) -> int:
        return sum(self.key[1])


def _reachable(address: str, timeout_s: float = 3.0) -> None:
    """Raise BackendError unless something listens at ``address`` (host:port, optional ray://)."""
    if address in ("auto", "local"):
        return
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise BackendError(f"RAY_ADDRESS={address!r} is not host:port")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise BackendError(f"Ray is not reachable at RAY_ADDRESS={address!r}: {exc}") from None


class RayBackend:
    """``Backend`` running real trials on a local Ray or the Ray cluster at ``address``."""

    name = "ray"

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
            _reachable(self.address)  # fail fast, naming the address, before Ray's long retries
        self.num_cpus = num_cpus
        self.init_timeout_s = init_timeout_s
        self.placement_timeout_s = placement_timeout_s
        self.actor_start_timeout_s = actor_start_timeout_s
        self._started_ray = False
        self._gangs: list[_Gang] = []
        self._cond = threading.Condition()
        self._init_lock = threading.Lock()

    # --- Ray connection ---------------------------------------------------------------------------

    def _ensure_ray(self, min_cpus: int = 0) -> None:
        with self._init_lock:
            if ray.is_initialized():
                return
            try:
                if self.address:
                    ray.init(address=self.address, log_to_driver=False)
                else:
                    cpus = max(os.cpu_count() or 1, self.num_cpus or 0, min_cpus)
                    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
                    self._started_ray = True
            except (ConnectionError, RayError, RuntimeError, ValueError) as exc:
                where = f"RAY_ADDRESS={self.address!r}" if self.address else "a local Ray"
                raise BackendError(f"cannot start or join {where}: {exc}") from exc

    def capacity(self) -> int:
        self._ensure_ray()
        res = ray.cluster_resources()
        return int(res.get("GPU", 0)) or int(res.get("CPU", 0))

    def close(self) -> None:
        with self._cond:
            gangs, self._gangs = self._gangs, []
        for gang in gangs:
            self._destroy(gang)
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False

    # --- validation -----------------------------------------------------------------------------

    @staticmethod
    def _node_groups(request: TrialRequest) -> tuple[int, ...]:
        """Ranks per node, in node order, as the tuner's placement lays them out (node-major)."""
        place = getattr(tuner, "place", None)
        if place is not None:
            rank_devices = place(request.layout, request.cluster).rank_devices
        else:  # the placement convention itself: rank r on node r // devices_per_node
            d = request.cluster.devices_per_node
            rank_devices = tuple(divmod(r, d) for r in range(request.layout.world_size))
        per_node = Counter(node for node, _ in rank_devices)
        return tuple(per_node[n] for n in sorted(per_node))

    def _validate(self, request: TrialRequest) -> tuple[str, tuple[int, ...]]:
        """Everything that can be known before a process starts; returns (resource, node groups)."""
        layout, cluster = request.layout, request.cluster
        check_layout(layout, model=request.model, cluster=cluster, training=request.training)
        groups = self._node_groups(request)
        resource = "GPU" if cluster.device_kind == "cuda" else "CPU"
        self._ensure_ray(min_cpus=layout.world_size if resource == "CPU" else 0)
        total = ray.cluster_resources().get(resource, 0)
        if total < layout.world_size:
            raise BackendError(
                f"layout {layout.key} needs world size {layout.world_size} = {layout.world_size} {resource}"
                f" bundles, but the Ray cluster has {total:g} {resource}"
            )
        biggest = max((n.get("Resources", {}).get(resource, 0) for n in ray.nodes() if n.get("Alive")), default=0)
        if max(groups) > biggest:
            raise BackendError(
                f"layout {layout.key} needs {max(groups)} {resource} on one node (cluster"
                f" {cluster.name!r}: {cluster.devices_per_node} per node), but the largest Ray node has {biggest:g}"
            )
        return resource, groups

    # --- the gang pool --------------------------------------------------------------------------

    def _acquire(self, key: tuple[str, tuple[int, ...]]) -> _Gang:
        resource, groups = key
        need = sum(groups)
        deadline = time.monotonic() + self.placement_timeout_s
        with self._cond:
            while True:
                for gang in self._gangs:
                    if gang.key == key and not gang.busy:
                        gang.busy = True
                        return gang
                if ray.available_resources().get(resource, 0) >= need:
                    break
                idle = sorted((g for g in self._gangs if not g.busy), key=lambda g: g.last_used)
                if idle:  # make room: the least recently used idle gang goes
                    self._gangs.remove(idle[0])
                    self._destroy(idle[0])
                    continue
                if not any(g.busy for g in self._gangs):
                    break  # nothing of ours to wait for: let the placement group wait below
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BackendError(f"no room for {need} {resource} bundles within {self.placement_timeout_s:g} s")
                self._cond.wait(timeout=min(left, 1.0))
            gang = _Gang(key=key)
            self._gangs.append(gang)
        try:
            bundle = {resource: 1}
            gang.pgs = [placement_group([bundle] * n, strategy="STRICT_PACK") for n in groups]
            gang.slots = [[_Slot() for _ in range(n)] for n in groups]
            left = max(1.0, deadline - time.monotonic())
            ready, _ = ray.wait([pg.ready() for pg in gang.pgs], num_returns=len(gang.pgs), timeout=left)
            if len(ready) < len(gang.pgs):
                raise BackendError(
                    f"Ray could not reserve placement groups of {list(groups)} x {bundle} within {left:.0f} s"
                    f" (available now: {ray.available_resources().get(resource, 0):g} {resource})"
                )
        except BaseException:
            with self._cond:
                self._gangs.remove(gang)
            self._destroy(gang)
            raise
        return gang

    def _release(self, gang: _Gang) -> None:
        with self._cond:
            gang.busy = False
            gang.last_used = time.monotonic()
            self._cond.notify_all()

    def _kill_actors(self, gang: _Gang) -> None:
        """Kill this gang's rank processes (only these); the placement groups stay for respawns."""
        for slot in (s for group in gang.slots for s in group):
            if slot.actor is not None:
                with contextlib.suppress(Exception):
                    ray.kill(slot.actor, no_restart=True)
            slot.actor, slot.info = None, None

    def _destroy(self, gang: _Gang) -> None:
        self._kill_actors(gang)
        for pg in gang.pgs:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
        gang.pgs = []

    def _ensure_actors(self, gang: _Gang) -> None:
        """Start the gang's missing rank processes and wait until each has imported torch."""
        gpu = gang.key[0] == "GPU"
        new: list[_Slot] = []
        for pg, slots in zip(gang.pgs, gang.slots):
            for index, slot in enumerate(slots):
                if slot.actor is None:
                    strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)
                    slot.actor = RankActor.options(
                        num_cpus=0 if gpu else 1, num_gpus=1 if gpu else 0, scheduling_strategy=strategy
                    ).remote()
                    new.append(slot)
        if not new:
            return
        try:
            infos = ray.get([s.actor.info.remote() for s in new], timeout=self.actor_start_timeout_s)
        except (GetTimeoutError, RayError) as exc:
            self._kill_actors(gang)
            raise BackendError(f"rank processes did not start within {self.actor_start_timeout_s:g} s: {exc}") from exc
        for slot, info in zip(new, infos):
            slot.info = info
        if gpu:  # every rank on a node sees the union of the gang's GPUs on that node
            slots = [s for group in gang.slots for s in group]
            union: dict[str, list[str]] = {}
            for s in slots:
                union.setdefault(s.info["node_id"], []).extend(s.info["gpu_ids"])
            for ids in union.values():
                ids.sort(key=lambda g: (len(g), g))
            ray.get([s.actor.set_visible_devices.remote(union[s.info["node_id"]]) for s in new])
            for s in slots:
                s.info["visible"] = union[s.info["node_id"]]

    # --- one trial --------------------------------------------------------------------------------

    def run(self, request: TrialRequest) -> TrialResult:
        t0 = time.monotonic()
        resource, groups = self._validate(request)
        world = request.layout.world_size
        init_timeout = float(request.options.get("init_timeout_s", self.init_timeout_s))
        gang = self._acquire((resource, groups))
        clean = False
        try:
            self._ensure_actors(gang)
            ranks = [s for group in gang.slots for s in group]  # node-major: rank r = r-th slot
            port = ray.get(ranks[0].actor.free_port.remote())
            addr = ranks[0].info["ip"]
            refs = {}
            for rank, slot in enumerate(ranks):
                local = sum(1 for s in ranks[:rank] if s.info["node_id"] == slot.info["node_id"])
                device = "cpu"
                if resource == "GPU":
                    device = f"cuda:{slot.info['visible'].index(slot.info['gpu_ids'][0])}"
                launch = {
                    "rank": rank,
                    "world_size": world,
                    "local_rank": local,
                    "master_addr": addr,
                    "master_port": port,
                    "device": device,
                    "init_timeout_s": init_timeout,
                }
                refs[slot.actor.run.remote(request, launch)] = rank
            reports, error, clean = self._watch(refs, ranks, request, init_timeout)
        finally:
            if not clean:
                self._kill_actors(gang)
            self._release(gang)
        wall = time.monotonic() - t0
        if error is None:
            return aggregate([reports[r] for r in sorted(reports)], request, backend=self.name, wall_s=wall)
        hosts = sorted({s.info["host"] for s in ranks if s.info})
        return TrialResult(
            status=error.kind,
            backend=self.name,
            error=error,
            env={"hosts": hosts, "world_size": world},
            wall_s=wall,
            device_seconds=wall * world,
        )

    def _watch(
        self, refs: dict[Any, int], ranks: list[_Slot], request: TrialRequest, init_timeout: float
    ) -> tuple[dict[int, dict[str, Any]], TrialError | None, bool]:
        """Wait for every rank, watching progress. Returns (reports, the trial's error, all returned)."""
        pending = dict(refs)
        reports: dict[int, dict[str, Any]] = {}
        errors: list[TrialError] = []
        start = time.monotonic()
        first_error_at: float | None = None
        poll = min(1.0, max(0.05, request.step_timeout_s / 10))
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=poll)
            for ref in done:
                rank = pending.pop(ref)
                try:
                    out = ray.get(ref)
                except RayActorError as exc:  # the process died (os._exit, signal, OOM killer)
                    errors.append(died_error(rank=rank, exc=exc))
                    continue
                if "report" in out:
                    reports[rank] = out["report"]
                else:
                    errors.append(TrialError(**out["error"]))
            if not pending:
                break
            if errors:
                first_error_at = first_error_at or time.monotonic()
                if time.monotonic() - first_error_at > ERROR_GRACE_S:
                    break  # peers are stuck in collectives with a dead partner: kill them
                continue
            verdict = self._stalled(pending, ranks, request, init_timeout, start)
            if verdict is not None:
                return reports, verdict, False
        if errors:
            return reports, _primary(errors), not pending
        return reports, None, True

    def _stalled(
        self, pending: dict[Any, int], ranks: list[_Slot], request: TrialRequest, init_timeout: float, start: float
    ) -> TrialError | None:
        """A timeout verdict if a pending rank made no progress for too long, else None."""
        waiting = sorted(pending.values())
        try:
            snaps = ray.get([ranks[r].actor.snapshot.remote() for r in waiting], timeout=5.0)
        except (GetTimeoutError, RayError):
            return None  # no answer this round; a dead actor surfaces through its run() ref
        since_start = time.monotonic() - start
        stalled = []
        for rank, snap in zip(waiting, snaps):
            if snap["phase"] == "steps":
                idle, limit, what = snap["idle_s"], request.step_timeout_s, "a training step"
            elif snap["phase"] == "init":
                idle, limit, what = snap["idle_s"], init_timeout + request.step_timeout_s, "start-up and first step"
            else:  # this trial has not started on the rank yet
                idle, limit, what = since_start, init_timeout + request.step_timeout_s, "waiting to start"
            if idle > limit:
                stalled.append((rank, snap, idle, what))
        if not stalled:
            return None
        with contextlib.suppress(GetTimeoutError, RayError):
            snaps = ray.get([ranks[r].actor.snapshot.remote(with_stack=True) for r in waiting], timeout=5.0)
        steps = {r: s["steps"] for r, s in zip(waiting, snaps)}
        fewest = min(steps.values())
        laggards = [r for r, n in steps.items() if n == fewest]
        rank, _, idle, what = stalled[0]
        error = timeout_error(
            rank=laggards[0] if len(laggards) == 1 else None, seconds=idle, what=what, steps_done=fewest
        )
        error.message += f"; optimizer steps per rank: {steps}"
        stacks = [f"rank {r}:\n{s.get('stack', '(no stack)')}" for r, s in zip(waiting, snaps)]
        error.traceback_tail = "\n".join(stacks)[-4000:]
        return error


def _primary(errors: list[TrialError]) -> TrialError:
    """The error that explains the trial: a rank's own failure before its peers' consequences."""

    def rank_of(e: TrialError) -> int:
        if e.kind in ("oom", "nan"):
            return 0
        etype = e.exception_type or ""
        if etype.startswith("torch.distributed") or "DistBackendError" in etype or "DistNetworkError" in etype:
            return 3  # a peer's collective failing because someone else died
        if etype.startswith("ray."):
            return 2
        return 1

    return min(enumerate(errors), key=lambda ie: (rank_of(ie[1]), ie[0]))[1]
