"""Plan: enumerate the layouts, place them, drop what does not fit, rank the rest by predicted speed.

The field's procedure, memory first and efficiency second: a layout whose predicted peak exceeds
device memory is reported as infeasible before any device time is spent on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tuner._errors import SpecError
from tuner._layout import AXES, Layout, check_layout
from tuner._memory import MemoryEstimate, MeshMemory, estimate_memory, mesh_memory, usable_memory
from tuner._placement import Placement, _place, check_order, place
from tuner._realise import Capabilities
from tuner._space import R_TP_NODES, Enumeration, SearchSpace, _schedules, divisors, enumerate_layouts
from tuner._specs import ClusterSpec, ModelSpec, TrainingSpec, to_dict
from tuner._timing import CalibrationFactors, MeshTime, TimeEstimate, estimate_time, mesh_time

R_MEMORY = "memory exceeds device"


class PlannedLayout:
    """One layout with its micro-batch count, placement, memory and time estimates. Inside ``plan``
    the two estimates are kept as the prepared models' raw numbers and wrapped on first access."""

    __slots__ = ("layout", "microbatches", "placement", "_mem", "_time", "_memory", "_time_est")

    def __init__(self, *, layout: Layout, microbatches: int, placement: Placement, memory: MemoryEstimate,
                 time: TimeEstimate) -> None:
        self.layout, self.microbatches, self.placement = layout, microbatches, placement
        self._memory, self._time_est = memory, time

    @property
    def memory(self) -> MemoryEstimate:
        try:
            return self._memory
        except AttributeError:
            mm, raw = self._mem
            self._memory = mm.wrap(raw)
            return self._memory

    @property
    def time(self) -> TimeEstimate:
        try:
            return self._time_est
        except AttributeError:
            mt, raw, ac = self._time
            self._time_est = mt.wrap(raw, ac)
            return self._time_est

    def __repr__(self) -> str:
        return f"PlannedLayout({self.layout.key}, m={self.microbatches}, {self.placement.summary})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.layout.key,
            "layout": to_dict(self.layout),
            "microbatches": self.microbatches,
            "placement": {
                "summary": self.placement.summary,
                "order": list(self.placement.order),
                "mesh_dim_names": list(self.placement.mesh_dim_names),
                "mesh_shape": list(self.placement.mesh_shape),
            },
            "memory": self.memory.to_dict(),
            "time": self.time.to_dict(),
        }


@dataclass
class Plan:
    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    entries: list[PlannedLayout] = field(default_factory=list)  # feasible, best first
    infeasible: list[PlannedLayout] = field(default_factory=list)  # memory does not fit
    rejected: dict[str, int] = field(default_factory=dict)
    # Space combinations that run the same program as a counted layout (see tuner._space): every
    # entry is a distinct program, so ``len(entries)`` is the number of distinct runs.
    twins: int = 0

    @property
    def best(self) -> PlannedLayout | None:
        return self.entries[0] if self.entries else None

    def to_dict(self, top: int | None = None) -> dict[str, Any]:
        entries = self.entries if top is None else self.entries[:top]
        return {
            "model": to_dict(self.model),
            "cluster": to_dict(self.cluster),
            "training": to_dict(self.training),
            "feasible": len(self.entries),
            "infeasible": len(self.infeasible),
            "rejected": dict(sorted(self.rejected.items(), key=lambda kv: (-kv[1], kv[0]))),
            "twins": self.twins,
            "entries": [self._with_budget(e.to_dict()) for e in entries],
        }

    def _with_budget(self, entry: dict[str, Any]) -> dict[str, Any]:
        """An entry's time and cost to train ``training.train_tokens`` at its predicted tokens/s."""
        from tuner._scaling import training_budget  # _scaling plans through this module

        entry["budget"] = training_budget(
            entry["time"]["tokens_per_s"], devices=self.cluster.devices, train_tokens=self.training.train_tokens,
            price_per_device_hour=self.cluster.price_per_device_hour).to_dict()
        return entry


def plan(
    *,
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    space: SearchSpace | None = None,
    factors: CalibrationFactors | None = None,
    allow_tp_across_nodes: bool = False,
    order: tuple[str, ...] = AXES,
    enumeration: Enumeration | None = None,
    capabilities: Capabilities | None = None,
) -> Plan:
    """Every valid layout placed and estimated; feasible ones sorted by tokens/s per device.
    ``capabilities``: the workload's (None: the built-in model), as ``enumerate_layouts`` takes them;
    unused when ``enumeration`` is given (it was enumerated under them)."""
    order = check_order(order)
    f = factors or CalibrationFactors()
    enum = enumeration or enumerate_layouts(model=model, cluster=cluster, training=training, space=space,
                                            allow_tp_across_nodes=allow_tp_across_nodes, order=order,
                                            capabilities=capabilities)
    result = Plan(model=model, cluster=cluster, training=training, rejected=dict(enum.rejected), twins=enum.twins)
    rejected = result.rejected
    per_node = cluster.devices_per_node
    meshes: dict[tuple[int, ...], tuple[Placement, MeshMemory, MeshTime] | None] = {}
    feasible: list[PlannedLayout] = []
    tight: list[PlannedLayout] = []  # fit, but leave less than the headroom free: ranked after the others
    infeasible = result.infeasible
    new = object.__new__
    valid, ms = enum.valid, enum.microbatches
    for start, stop in enum.groups:
        first = valid[start]
        tp, cp, ep, dp, pp, vpp = first.tp, first.cp, first.ep, first.dp, first.pp, first.vpp
        key = (tp, cp, ep, dp, pp, vpp)
        if key not in meshes:
            placement = _place((tp, cp, ep, dp, pp), order, per_node, cluster.domain_devices)
            if not allow_tp_across_nodes and not placement.axes["tp"].in_domain:
                meshes[key] = None
            else:
                meshes[key] = (placement, mesh_memory(model, cluster, training, *key),
                               mesh_time(model, cluster, training, f, *key, order))
        prepared = meshes[key]
        if prepared is None:
            rejected[R_TP_NODES] = rejected.get(R_TP_NODES, 0) + (stop - start)
            continue
        placement, mm, mt = prepared
        m, mbs, schedule = ms[start], first.mbs, first.schedule
        inflight = mm.inflight(schedule, m)
        acts: dict[tuple[str, bool], list[float]] = {}  # per (ac, sp), shared by the zero stages
        budget = mm.device_memory - mm.overhead
        roomy = usable_memory(mm.device_memory) - mm.overhead  # MemoryEstimate.tight beyond it
        for i in range(start, stop):
            layout = valid[i]
            zero, ac, sp = layout.zero, layout.ac, layout.sp
            row = acts.get((ac, sp))
            if row is None:
                row = acts[ac, sp] = mm.activations(ac, sp, mbs, schedule, m, inflight)
            mem = mm.peak(zero, row)
            entry = new(PlannedLayout)
            entry.layout, entry.microbatches, entry.placement = layout, m, placement
            entry._mem, entry._time = (mm, mem), (mt, mt.estimate(zero, mbs, ac, sp, m), ac)
            # Compare exactly what MemoryEstimate.fits and .tight will (whole bytes per part).
            whole = mm.whole_bytes(mem)
            (feasible if whole <= roomy else tight if whole <= budget else infeasible).append(entry)
    if infeasible:
        rejected[R_MEMORY] = rejected.get(R_MEMORY, 0) + len(infeasible)
    # Best first: every layout with room before the tight ones (tuner._memory.MEMORY_HEADROOM), then
    # the shortest step (= most tokens/s per device: same batch and devices), then least memory; the
    # sort is stable, so ties keep the enumeration order.
    feasible.sort(key=lambda e: (e._time[1][0], e._mem[1][4]))
    tight.sort(key=lambda e: (e._time[1][0], e._mem[1][4]))
    result.entries = feasible + tight
    return result


def plan_one(
    layout: Layout,
    *,
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    factors: CalibrationFactors | None = None,
    allow_tp_across_nodes: bool = False,
) -> PlannedLayout:
    """Check, place and estimate a single layout as given (raises LayoutError if it is invalid); the
    caller canonicalises (``canonical_layout``) where twins must be one entry."""
    m = check_layout(layout, model=model, cluster=cluster, training=training, allow_tp_across_nodes=allow_tp_across_nodes)
    placement = place(layout, cluster, allow_tp_across_nodes=allow_tp_across_nodes)
    mem = estimate_memory(layout, model=model, cluster=cluster, training=training)
    t = estimate_time(layout, model=model, cluster=cluster, training=training, factors=factors, placement=placement)
    return PlannedLayout(layout=layout, microbatches=m, placement=placement, memory=mem, time=t)


def candidate_layouts(*, model: ModelSpec, cluster: ClusterSpec, space: SearchSpace | None = None) -> int:
    """An upper bound on the layouts ``enumerate_layouts`` walks (valid and rejected), computed from the
    divisors of the device count without enumerating anything: the (tp, cp, ep, pp) tuples whose
    product divides the devices (dp takes the rest), times the knob combinations of one mesh.

    The number of such tuples is the number of ordered factorisations of the device count, which
    for n = p1^a1 ... pk^ak is prod C(ai + 3, 3) (stars and bars per prime): a divisor-rich count
    such as 720,720 gives 89,600 meshes and ~3 x 10^7 candidates where 2^16 gives 969 and ~4 x 10^5.
    """
    space = space or SearchSpace()
    world = cluster.devices
    world_divisors = divisors(world)
    ways = {world: 1}  # devices left for the remaining axes -> number of degree tuples leaving it
    for name in ("tp", "cp", "ep", "pp"):
        given = getattr(space, name)
        if given is None and name == "ep" and not model.is_moe:
            given = (1,)  # a dense model has no expert axis (iter_meshes does the same)
        step: dict[int, int] = {}
        for left, n in ways.items():
            for d in given if given is not None else world_divisors:
                if left % d == 0:
                    step[left // d] = step.get(left // d, 0) + n
        ways = step
    meshes = sum(ways.values())
    n_sp = len(space.sp)
    n_schedules = max(1, len(_schedules(2, space)))  # pp > 1 has the most (schedule, vpp) variants
    return meshes * len(space.zero) * len(space.mbs) * len(space.ac) * n_sp * n_schedules


def check_planning_work(
    *, model: ModelSpec, cluster: ClusterSpec, space: SearchSpace | None = None, limit: int, where: str = "request",
    remedy: str = "restrict space.tp/space.cp/space.pp or use a device count with fewer divisors",
) -> int:
    """The candidate count (``candidate_layouts``), or SpecError naming the cluster when it is above
    ``limit``: enumeration time grows with it (tens of seconds for 3 x 10^7), so a request is refused
    before any of that work is done."""
    n = candidate_layouts(model=model, cluster=cluster, space=space)
    if n > limit:
        raise SpecError(
            f"cluster.nodes={cluster.nodes} x cluster.devices_per_node={cluster.devices_per_node} = "
            f"{cluster.devices:,} devices gives up to {n:,} candidate layouts to plan, above the limit of "
            f"{limit:,} per {where} (the count grows with the divisors of the device count): {remedy}"
        )
    return n
