"""Reusable rank processes for the Ray backend: the ``RankWorker`` actor and the gang pool.

A *gang* is one placement group with one bundle per node of a trial's placement ({"GPU": n} or
{"CPU": n}) and one ``RankWorker`` actor per rank in its node's bundle (STRICT_SPREAD; STRICT_PACK
on a single-node Ray, ``strategy_for``). Its key is its shape (resource, ranks per node): every
trial of that shape reuses the same processes with a fresh process group. One pool per driver
process, shared by every ``RayBackend``; a gang serves one trial at a time; stuck or dead ranks are
killed and replaced (``drop_dead``), a gang on a lost node is destroyed (``discard``). The pool's
rules: docs/workers.md, "Gangs".
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from workers._contract import BackendUnavailable, TrialRequest

GangKey = tuple[str, tuple[int, ...]]  # (Ray resource "GPU"/"CPU", ranks per node)
HEALTH_TIMEOUT_S = 30.0  # a live actor answers its control group in milliseconds; this is for a loaded machine


class RankWorker:
    """One reusable rank process. ``run`` executes trials; ``snapshot`` answers the watchdog from a
    separate concurrency group, so it is served while ``run`` is busy (or hung)."""

    def __init__(self) -> None:
        import gc

        import workers.train  # noqa: F401 - torch and the rank program, imported once per process
        from workers._launch import Progress

        self.progress = Progress()
        # Every trial collects garbage twice (clean-up, and before its peak-memory reset); with
        # torch's ~10^5 module-level objects frozen out of the collector that costs ~ms, not ~0.2 s.
        gc.collect()
        gc.freeze()

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
        # NCCL can use peer-to-peer links (Ray sets CUDA_VISIBLE_DEVICES to an actor's own GPUs only;
        # Ray Train shares the node's union for the same reason: ray/train/_internal/
        # backend_executor.py ``_share_cuda_visible_devices``). CUDA reads the variable
        # once, at initialisation: a change after it would be ignored and the rank would pick a
        # device index that does not exist or is another rank's, so refuse it loudly.
        import torch

        value = ",".join(gpu_ids)
        if torch.cuda.is_initialized() and os.environ.get("CUDA_VISIBLE_DEVICES") != value:
            raise RuntimeError(
                f"CUDA is already initialised with CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}; cannot switch to {value!r}"
            )
        os.environ["CUDA_VISIBLE_DEVICES"] = value

    def run(self, request: TrialRequest, launch: dict[str, Any]) -> dict[str, Any]:
        from workers._launch import run_rank

        return run_rank(request, progress=self.progress, **launch)

    @ray.method(concurrency_group="control")
    def snapshot(self, with_stack: bool = False) -> dict[str, Any]:
        return self.progress.snapshot(with_stack=with_stack)

    @ray.method(concurrency_group="control")
    def threads(self) -> dict[str, int]:
        from workers._launch import threads_by_name

        return threads_by_name()  # between trials: no gloo thread of a past trial (tests/workers/test_actor_threads.py)


RankActor = ray.remote(concurrency_groups={"control": 1})(RankWorker)


@dataclass
class Slot:
    actor: Any = None
    info: dict[str, Any] | None = None


@dataclass
class Gang:
    key: GangKey
    strategy: str = "STRICT_SPREAD"
    pgs: list[PlacementGroup] = field(default_factory=list)  # one group; bundle k = node k of the placement
    slots: list[list[Slot]] = field(default_factory=list)  # [node of the placement][rank on it]
    busy: bool = True
    last_used: float = field(default_factory=time.monotonic)
    trial_id: str | None = None  # the trial it runs now (GangPool.cancel finds it by this)

    @property
    def ranks(self) -> list[Slot]:
        """Slots in rank order: node-major, as the tuner's Placement numbers ranks."""
        return [s for group in self.slots for s in group]


# Nodes ``lost_nodes`` found gone (node id -> when): Ray's GCS keeps them "Alive" for tens of seconds
# after they die, and the devices left must not count them meanwhile. Forgotten after LOST_MEMORY_S,
# by when the GCS has long declared them dead (or, a false alarm, they answer again).
LOST_MEMORY_S = 300.0
_LOST: dict[str, float] = {}


def alive_nodes(resource: str) -> dict[str, float]:
    """Ray node id -> how much of ``resource`` it has, for every alive node that has some (a node
    seen lost is not alive, whatever the GCS still says)."""
    now = time.monotonic()
    for node_id in [k for k, at in _LOST.items() if now - at > LOST_MEMORY_S]:
        _LOST.pop(node_id, None)
    out = {}
    for n in ray.nodes():
        amount = n.get("Resources", {}).get(resource, 0)
        if n.get("Alive") and amount > 0 and n["NodeID"] not in _LOST:
            out[n["NodeID"]] = amount
    return out


def lost_nodes(node_ids: list[str], *, connect_timeout_s: float = 2.0) -> set[str]:
    """The nodes among ``node_ids`` that are gone: dead for Ray's GCS, or alive for it but with a
    raylet that no longer accepts connections. A node killed a moment ago is only declared dead once
    the GCS's health checks have failed several times (tens of seconds); its rank processes' calls
    fail at once (``ActorUnavailableError``: connection reset), and so does a connection to its
    raylet, which tells a lost node from one rank process that died on a live node."""
    info = {n["NodeID"]: n for n in ray.nodes()}
    out = set()
    for node_id in set(node_ids):
        node = info.get(node_id)
        if node is None or not node.get("Alive"):
            out.add(node_id)
            continue
        try:
            with socket.create_connection((node["NodeManagerAddress"], int(node["NodeManagerPort"])),
                                          timeout=connect_timeout_s):
                pass
        except OSError:
            out.add(node_id)
    _LOST.update(dict.fromkeys(out, time.monotonic()))
    return out


def strategy_for(groups: tuple[int, ...], nodes: dict[str, float]) -> str | None:
    """How a gang of ``groups`` (ranks per placement node) is laid on Ray ``nodes`` (id -> devices):
    STRICT_SPREAD (one Ray node per placement node) when the cluster has enough nodes large enough,
    STRICT_PACK when a single-node Ray stands in for the whole cluster and holds every rank, None when
    neither fits (the caller names the numbers)."""
    sizes = sorted(nodes.values(), reverse=True)
    need = sorted(groups, reverse=True)
    if len(sizes) >= len(need) and all(have >= n for have, n in zip(sizes, need, strict=False)):
        return "STRICT_SPREAD"
    if len(sizes) == 1 and sizes[0] >= sum(groups):
        return "STRICT_PACK"
    return None


class GangPool:
    def __init__(self) -> None:
        self._gangs: list[Gang] = []
        self._cond = threading.Condition()
        self._job: str | None = None

    def _check_session(self) -> None:
        job = ray.get_runtime_context().get_job_id()
        if job != self._job:  # Ray restarted: the old gangs' actors and groups are gone with it
            self._gangs, self._job = [], job

    def acquire(self, key: GangKey, *, timeout_s: float, strategy: str = "STRICT_SPREAD") -> Gang:
        """A gang of shape ``key`` for one trial: an idle one, or a new one with its group reserved
        (one bundle per placement node, laid out by ``strategy``: see ``strategy_for``)."""
        resource, groups = key
        need = sum(groups)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._check_session()
            while True:
                for gang in self._gangs:
                    if gang.key == key and gang.strategy == strategy and not gang.busy:
                        gang.busy = True
                        return gang
                if ray.available_resources().get(resource, 0) >= need:
                    break
                idle = sorted((g for g in self._gangs if not g.busy), key=lambda g: g.last_used)
                if idle:  # make room: the least recently used idle gang goes
                    self._gangs.remove(idle[0])
                    destroy(idle[0])
                    continue
                if not any(g.busy for g in self._gangs):
                    break  # nothing of ours to wait for: the placement group waits below
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BackendUnavailable(f"no room for {need} {resource} bundles within {timeout_s:g} s")
                self._cond.wait(timeout=min(left, 1.0))
            gang = Gang(key=key, strategy=strategy)
            self._gangs.append(gang)
        try:
            bundles = [{resource: n} for n in groups]
            gang.pgs = [placement_group(bundles, strategy=strategy)]
            gang.slots = [[Slot() for _ in range(n)] for n in groups]
            left = max(1.0, deadline - time.monotonic())
            ready, _ = ray.wait([pg.ready() for pg in gang.pgs], num_returns=len(gang.pgs), timeout=left)
            if len(ready) < len(gang.pgs):
                raise BackendUnavailable(
                    f"Ray could not reserve a {strategy} placement group of {bundles} within {left:.0f} s"
                    f" (available now: {ray.available_resources().get(resource, 0):g} {resource})"
                )
        except BaseException:
            with self._cond:
                self._gangs.remove(gang)
            destroy(gang)
            raise
        return gang

    def release(self, gang: Gang) -> None:
        with self._cond:
            gang.busy = False
            gang.trial_id = None
            gang.last_used = time.monotonic()
            self._cond.notify_all()

    def discard(self, gang: Gang) -> None:
        """Destroy ``gang`` (its actors and its placement group) and forget it: a gang one of whose
        nodes died (its bundle would be rescheduled onto the surviving nodes and hold them)."""
        with self._cond:
            if gang in self._gangs:
                self._gangs.remove(gang)
            self._cond.notify_all()
        destroy(gang)

    def cancel(self, trial_id: str) -> bool:
        """Destroy the gang running ``trial_id`` (its actors killed, its placement groups removed)
        and forget it: its devices are free at once, its ranks die and the trial ends as a failure.
        False when no gang runs that trial (not started yet, or already ended)."""
        with self._cond:
            gang = next((g for g in self._gangs if g.busy and g.trial_id == trial_id), None)
            if gang is None:
                return False
            self._gangs.remove(gang)
            self._cond.notify_all()
        destroy(gang)
        return True

    def close_idle(self) -> bool:
        """Destroy every idle gang; True when nothing is left in use."""
        with self._cond:
            if not ray.is_initialized():
                self._gangs = []
                return True
            self._check_session()
            idle = [g for g in self._gangs if not g.busy]
            self._gangs = [g for g in self._gangs if g.busy]
            busy = bool(self._gangs)
        for gang in idle:
            destroy(gang)
        return not busy


POOL = GangPool()


def drop(slot: Slot) -> None:
    """Kill the slot's rank process (if it still runs) and forget its handle: the next
    ``ensure_actors`` starts a fresh one in the same bundle. A handle of a dead actor must never
    stay in a slot: every later call on it fails (``ActorDiedError``), so the next trial would."""
    if slot.actor is not None:
        with contextlib.suppress(Exception):
            ray.kill(slot.actor, no_restart=True)
    slot.actor, slot.info = None, None


def kill_actors(gang: Gang) -> None:
    """Kill this gang's rank processes (only these); its placement groups stay for respawns."""
    for slot in gang.ranks:
        drop(slot)


def drop_dead(gang: Gang, *, timeout_s: float = HEALTH_TIMEOUT_S) -> list[int]:
    """Health check before reuse: ask every live slot's actor for a snapshot (its "control"
    concurrency group answers at once even if ``run`` were busy) and drop the ones that died since
    their last trial (the OS's OOM killer, a signal, a lost node) or do not answer; returns their
    ranks. One Ray round trip for the gang."""
    live = [(rank, s) for rank, s in enumerate(gang.ranks) if s.actor is not None]
    if not live:
        return []
    refs = [s.actor.snapshot.remote() for _, s in live]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    answered = set(ready)
    dead = []
    for (rank, slot), ref in zip(live, refs, strict=True):
        try:
            if ref not in answered:
                raise GetTimeoutError(f"no answer within {timeout_s:g} s")
            ray.get(ref)
        except RayError:  # ActorDiedError, ActorUnavailableError, GetTimeoutError
            drop(slot)
            dead.append(rank)
    return dead


def destroy(gang: Gang) -> None:
    kill_actors(gang)
    for pg in gang.pgs:
        with contextlib.suppress(Exception):
            remove_placement_group(pg)
    gang.pgs = []


class NodeLost(BackendUnavailable):
    """Rank processes of an idle gang died with their node: destroy the gang (``GangPool.discard``)
    and take another, rather than respawn into a bundle Ray is re-placing (which may find no room
    while idle gangs hold the surviving nodes)."""


def ensure_actors(gang: Gang, *, timeout_s: float) -> None:
    """Replace the gang's dead rank processes (``drop_dead``), start its missing ones and wait until
    each has imported torch. Raises ``NodeLost`` when the dead ones went with their node."""
    nodes = [s.info["node_id"] if s.info else None for s in gang.ranks]
    dead = drop_dead(gang)
    gone = lost_nodes([nodes[r] for r in dead if nodes[r]]) if dead else set()
    if gone:
        raise NodeLost(f"node {sorted(gone)[0][:12]} of an idle gang died")
    gpu = gang.key[0] == "GPU"
    new: list[Slot] = []
    (pg,) = gang.pgs
    for node, slots in enumerate(gang.slots):
        for slot in slots:
            if slot.actor is None:  # into its placement node's bundle: Ray picks a device of that bundle
                strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=node)
                slot.actor = RankActor.options(
                    num_cpus=0 if gpu else 1, num_gpus=1 if gpu else 0, scheduling_strategy=strategy
                ).remote()
                new.append(slot)
    if not new:
        return
    try:
        infos = ray.get([s.actor.info.remote() for s in new], timeout=timeout_s)
    except (GetTimeoutError, RayError) as exc:
        kill_actors(gang)
        raise BackendUnavailable(f"rank processes did not start within {timeout_s:g} s: {exc}") from exc
    for slot, info in zip(new, infos, strict=True):
        slot.info = info
    if gpu:  # every rank on a node sees the union of the gang's GPUs on that node
        union: dict[str, list[str]] = {}
        for s in gang.ranks:
            union.setdefault(s.info["node_id"], []).extend(s.info["gpu_ids"])
        for ids in union.values():
            ids.sort(key=lambda g: (len(g), g))
        ray.get([s.actor.set_visible_devices.remote(union[s.info["node_id"]]) for s in new])
        # Surviving actors keep the set they were given (CUDA cannot change it). A respawned actor
        # gets its bundle's GPU again (a placement-group bundle keeps its GPU), so the union is the
        # same; if it ever is not, start the gang's ranks afresh rather than index the wrong device.
        fresh = {id(s) for s in new}
        stale = [s for s in gang.ranks
                 if id(s) not in fresh and s.info.get("visible") != union[s.info["node_id"]]]
        if stale:
            kill_actors(gang)
            return ensure_actors(gang, timeout_s=timeout_s)
        for s in gang.ranks:
            s.info["visible"] = union[s.info["node_id"]]
