"""Plan: enumerate the layouts, place them, drop what does not fit, rank the rest by predicted speed.

The field's procedure, memory first and efficiency second: a layout whose predicted peak exceeds
device memory is reported as infeasible before any device time is spent on it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Any

import numpy as np

from tuner._budget import training_budget
from tuner._errors import SpecError
from tuner._layout import CHECKPOINTING, Layout, check_layout
from tuner._memory import (
    MemoryEstimate,
    MemoryParts,
    MeshMemory,
    estimate_memory,
    fits_device,
    mesh_memory,
    rank_activation_bytes,
    rank_peak_bytes,
    usable_memory,
)
from tuner._placement import AXES, Placement, _place, check_order, place
from tuner._problem import Problem
from tuner._space import (
    R_TP_NODES,
    Enumeration,
    LayoutGroup,
    SearchSpace,
    _schedules,
    divisors,
    enumerate_layouts,
)
from tuner._specs import ClusterSpec, ModelSpec, TrainingSpec, to_dict
from tuner._timing import (
    CalibrationFactors,
    MeshTime,
    StepTime,
    TimeEstimate,
    estimate_time,
    mesh_time,
    step_time,
)

R_MEMORY = "memory exceeds device"
AC_INDEX = {ac: i for i, ac in enumerate(CHECKPOINTING)}


class PlannedLayout:
    """One layout with its micro-batch count, placement, memory and time estimates. An entry of
    ``plan`` is one row of the plan's costs (``_Costs``): each of these is made from it on first use."""

    __slots__ = ("layout", "microbatches", "placement", "memory", "time", "_costs", "_row")

    def __init__(self, *, layout: Layout, microbatches: int, placement: Placement, memory: MemoryEstimate,
                 time: TimeEstimate) -> None:
        self.layout, self.microbatches, self.placement = layout, microbatches, placement
        self.memory, self.time = memory, time

    def __getattr__(self, name: str) -> Any:  # called only for a slot not yet set: a plan's entry
        if name not in _FROM_COSTS:
            raise AttributeError(name)
        value = getattr(self._costs, name)(self._row)
        setattr(self, name, value)
        return value

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


_FROM_COSTS = frozenset(("layout", "microbatches", "placement", "memory", "time"))


class _Costs:
    """Every costed layout of one plan as rows of arrays: its group, its place there, the memory parts
    of its costliest rank and its step time by part; each row read back as the public objects."""

    def __init__(self, groups: _Groups, group: np.ndarray, pos: np.ndarray, mesh: np.ndarray, ac: np.ndarray,
                 memory: MemoryParts, step: StepTime) -> None:
        self.groups, self.group, self.pos, self.mesh, self.ac = groups, group, pos, mesh, ac
        self.memory_rows, self.step_rows = memory, step

    def layout(self, i: int) -> Layout:
        return self.groups.groups[self.group[i]].layout(int(self.pos[i]))

    def microbatches(self, i: int) -> int:
        return self.groups.groups[self.group[i]].microbatches

    def placement(self, i: int) -> Placement:
        return self.groups.placements[self.mesh[i]]

    def memory(self, i: int) -> MemoryEstimate:
        p, g, o, a, top, stage, b = (float(x[i]) for x in self.memory_rows)
        return self.groups.mems[self.mesh[i]].wrap(MemoryParts(p, g, o, a, top, int(stage), b))

    def time(self, i: int) -> TimeEstimate:
        step = StepTime(*(float(x[i]) for x in self.step_rows))
        return self.groups.times[self.mesh[i]].wrap(step, CHECKPOINTING[self.ac[i]])


class PlanEntries(Sequence[PlannedLayout]):
    """Entries of a plan in order, rows of its costs: each PlannedLayout is made the first time it is
    read (then kept), so a plan of 10^5 costed layouts makes objects only for the ones looked at. It
    reads as a list does: length, index, slices (lists), iteration, ``==`` and ``+`` with a list."""

    __slots__ = ("_costs", "_rows", "_made")

    def __init__(self, costs: _Costs, rows: np.ndarray) -> None:
        self._costs, self._rows = costs, rows
        self._made: list[PlannedLayout | None] = [None] * len(rows)

    def __len__(self) -> int:
        return len(self._made)

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self._made)))]
        entry = self._made[i]  # IndexError as a list's
        if entry is None:
            entry = object.__new__(PlannedLayout)
            entry._costs, entry._row = self._costs, int(self._rows[i])
            self._made[i] = entry
        return entry

    def __iter__(self) -> Iterator[PlannedLayout]:
        return (self[i] for i in range(len(self._made)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (PlanEntries, list, tuple)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __add__(self, other: Sequence[PlannedLayout]) -> list[PlannedLayout]:
        return [*self, *other]

    def __radd__(self, other: Sequence[PlannedLayout]) -> list[PlannedLayout]:
        return [*other, *self]

    def __repr__(self) -> str:
        return f"PlanEntries({len(self):,} entries)"


@dataclass
class Plan:
    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    entries: Sequence[PlannedLayout] = field(default_factory=list)  # feasible, best first
    infeasible: Sequence[PlannedLayout] = field(default_factory=list)  # memory does not fit
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
        entry["budget"] = training_budget(
            entry["time"]["tokens_per_s"], devices=self.cluster.devices, train_tokens=self.training.train_tokens,
            price_per_device_hour=self.cluster.price_per_device_hour).to_dict()
        return entry


def plan(
    *,
    problem: Problem,
    factors: CalibrationFactors | None = None,
    allow_tp_across_nodes: bool = False,
    order: tuple[str, ...] = AXES,
    enumeration: Enumeration | None = None,
) -> Plan:
    """Every valid layout of ``problem`` placed and estimated; feasible ones sorted by tokens/s per
    device. ``enumeration``: the problem's, when the caller has it already (``enumerate_layouts``).

    Work is done once at the level it depends on: placement and the prepared memory and time models
    per mesh, micro-batches in flight and model states per group of layouts (mesh, schedule, mbs),
    and the last step, each layout's peak memory and step time, for every layout at once on arrays
    through the same functions that cost one layout (``rank_activation_bytes``, ``step_time``)."""
    order = check_order(order)
    f = factors or CalibrationFactors()
    model, cluster, training = problem.model, problem.cluster, problem.training
    enum = enumeration or enumerate_layouts(problem=problem, allow_tp_across_nodes=allow_tp_across_nodes, order=order)
    result = Plan(model=model, cluster=cluster, training=training, rejected=dict(enum.rejected), twins=enum.twins)
    groups = _costed_groups(enum, model=model, cluster=cluster, training=training, factors=f, order=order,
                            allow_tp_across_nodes=allow_tp_across_nodes)
    if groups.crossing:
        result.rejected[R_TP_NODES] = result.rejected.get(R_TP_NODES, 0) + groups.crossing
    if not groups.groups:
        return result
    costs, fits, roomy = groups.cost()
    feasible = np.flatnonzero(fits)
    # Best first: every layout with room before the tight ones (tuner._memory.MEMORY_HEADROOM), then
    # the shortest step (= most tokens/s per device: same batch and devices), then least memory; the
    # sort is stable, so ties keep the enumeration order.
    ranked = feasible[np.lexsort((costs.memory_rows.total[feasible], costs.step_rows.step[feasible],
                                  ~roomy[feasible]))]
    infeasible = np.flatnonzero(~fits)
    result.entries, result.infeasible = PlanEntries(costs, ranked), PlanEntries(costs, infeasible)
    if len(infeasible):
        result.rejected[R_MEMORY] = result.rejected.get(R_MEMORY, 0) + len(infeasible)
    return result


class _Groups:
    """The enumeration's groups of layouts (mesh, schedule, vpp, mbs) that are costed, with what each
    one's layouts share in rows of tables; ``cost`` costs every layout of them at once."""

    def __init__(self) -> None:
        self.placements: list[Placement] = []
        self.mems: list[MeshMemory] = []
        self.times: list[MeshTime] = []
        self.crossing = 0  # layouts of meshes whose TP groups leave a node in this placement order
        # per group: the group, its mesh, its state row per zero slot, 2 * ac + sp per knob slot, and per
        # candidate rank its layer-micro-batches in flight and the micro-batches of logits it holds
        self.groups: list[LayoutGroup] = []
        self.mesh: list[int] = []
        self.state_rows: list[list[int]] = []
        self.knobs: list[list[int]] = []
        self.inflight: list[list[float]] = []
        self.logits: list[list[float]] = []
        self.rows: list[list[tuple[float, float, float, float]]] = []  # model states per candidate rank

    def cost(self) -> tuple[_Costs, np.ndarray, np.ndarray]:
        """The costs of every layout, whether each fits in device memory, and whether with room.

        Each term is computed on what it depends on: activations per (group, ac and sp, candidate
        rank), model states per (group, zero, candidate rank), then both for each layout, the cells
        (group, zero slot, knob slot) that hold one, taken in the enumeration's order (zero
        outermost, then ac, sp); ragged rows are padded (padded ranks are never the costliest)."""
        mesh = np.array(self.mesh)
        per_group = np.array([(grp.mbs, grp.microbatches, len(grp.zeros), len(grp.knobs), grp.count)
                              for grp in self.groups]).T
        mbs, m, n_zeros, n_knobs, count = per_group
        zero = _table([grp.zeros for grp in self.groups], 0)  # (group, zero slot)
        knob = _table(self.knobs, 0)  # (group, knob slot): 2 * ac + sp
        ac, sp = knob // 2, knob % 2
        width_z, width_k = zero.shape[1], knob.shape[1]
        z_slot, k_slot = np.arange(width_z)[:, None], np.arange(width_k)[None, :]
        nz, nk, nc = (x[:, None, None] for x in (n_zeros, n_knobs, count))
        g, zi, ki = np.nonzero((z_slot < nz) & (k_slot < nk) & (z_slot * nk + k_slot < nc))
        gz, gk, gm = g * width_z + zi, g * width_k + ki, mesh[g]  # rows of the (group, slot) tables

        # Memory: each candidate rank's activations and model states, then the costliest rank.
        tables = {id(mm.act): mm.act for mm in self.mems}  # meshes alike in (tp, cp, ep) share one
        table_of = {t: i for i, t in enumerate(tables)}
        act = np.array([[[t[a, s] for s in (False, True)] for a in CHECKPOINTING] for t in tables.values()])
        act = act[np.array([table_of[id(mm.act)] for mm in self.mems])[mesh][:, None], ac, sp]  # (group, knob, 3)
        layer, working, logits = (act[:, :, j, None] for j in range(3))
        layer_const, rope, n_cand, overhead, allocator, device_memory = np.array([
            (mm.layer_const, mm.rope, len(mm.ranks), mm.overhead, mm.allocator, mm.device_memory)
            for mm in self.mems]).T
        rank_of = _table([mm.ranks for mm in self.mems], 0)
        width_r = rank_of.shape[1]
        acts = rank_activation_bytes(layer, working, logits * _table(self.logits, 0)[:, None, :],
                                     mbs[:, None, None], _table(self.inflight, 0.0)[:, None, :],
                                     _table([[max(n, 1) for n in mm.layers] for mm in self.mems], 1)[mesh][:, None, :],
                                     layer_const[mesh][:, None, None], rope[mesh][:, None, None])
        acts = acts.reshape(-1, width_r)[gk]
        # model states: every row's ranks end to end; a padded slot reads its row's last rank
        first = np.cumsum([0] + [len(r) for r in self.rows])
        flat = np.array([ranks for row in self.rows for ranks in row])
        rows = _table(self.state_rows, 0).reshape(-1)[gz]
        slot = np.minimum(first[rows][:, None] + np.arange(width_r), first[rows + 1][:, None] - 1)
        p, gr, o, b = flat[slot].transpose(2, 0, 1)
        total = rank_peak_bytes(p, gr, o, b, acts)
        total[np.arange(width_r) >= n_cand[gm][:, None]] = -np.inf
        best = np.argmax(total, axis=1)  # the first of the costliest, as MeshMemory.peak
        at = np.arange(len(g)), best
        memory = MemoryParts(p[at], gr[at], o[at], acts[at], total[at], rank_of[gm, best], b[at])
        # Judge exactly what MemoryEstimate.fits and .tight will: its total of whole bytes per part,
        # overhead included; roomy = fits with the headroom (tuner._memory.MEMORY_HEADROOM) left free.
        whole = MeshMemory.whole_bytes(memory, allocator[gm]) + overhead[gm]
        fits = fits_device(whole, device_memory[gm])
        roomy = fits_device(whole, usable_memory(device_memory[gm]))

        # Time: the mesh's terms per micro-batch by ac and sp, pipeline sends by sp, data parallel by zero.
        per_mb = np.array([[[mt.per_mb[a, s] for s in (False, True)] for a in CHECKPOINTING]
                           for mt in self.times])  # (mesh, ac, sp, 4, 2)
        per_mb = per_mb[mesh[:, None], ac, sp].reshape(-1, 4, 2)[gk]
        p2p = np.array([[mt.p2p[s] for s in (False, True)] for mt in self.times])[mesh[:, None], sp]
        p2p = p2p.reshape(-1, 2)[gk]
        dp = np.array([[mt.dp[z] for z in range(4)] for mt in self.times])[mesh[:, None], zero].reshape(-1, 3)[gz]
        pp, vpp, overlap, sharing, step_fixed = np.array([(mt.pp, mt.vpp, mt.dp_overlap, mt.sharing, mt.step_fixed)
                                                          for mt in self.times])[gm].T
        step = step_time(tuple((per_mb[:, j, 0], per_mb[:, j, 1]) for j in range(4)), (p2p[:, 0], p2p[:, 1]),
                         (dp[:, 0], dp[:, 1], dp[:, 2]), mbs[g], m[g], pp, vpp, overlap, sharing, step_fixed)
        return _Costs(self, g, zi * n_knobs[g] + ki, gm, ac[g, ki], memory, step), fits, roomy


def _table(rows: list[Any], pad: Any) -> np.ndarray:
    """Ragged rows as one array, padded on the right."""
    return np.array(list(zip_longest(*rows, fillvalue=pad))).T


def _costed_groups(enum: Enumeration, *, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                   factors: CalibrationFactors, order: tuple[str, ...], allow_tp_across_nodes: bool) -> _Groups:
    """What each group of ``enum`` shares, worked out once: per mesh its placement and prepared
    memory and time models (None: its TP groups leave a node), per group the micro-batches in flight
    and the model states of each ZeRO level."""
    out = _Groups()
    per_node = cluster.devices_per_node
    meshes: dict[tuple[int, ...], int | None] = {}
    state_ids: dict[int, int] = {}  # id of a MeshMemory.states list -> its row in out.rows
    zero_rows: dict[tuple[int, int, tuple[int, ...]], list[int]] = {}  # (mesh, m, zeros) -> rows per zero slot
    knob_codes: dict[tuple[tuple[str, bool], ...], list[int]] = {}
    for grp in enum.groups:
        key = (grp.tp, grp.cp, grp.ep, grp.dp, grp.pp, grp.vpp)
        k = meshes.get(key, -1)
        if k == -1:
            placement = _place(key[:5], order, per_node, cluster.domain_devices)
            if not allow_tp_across_nodes and not placement.axes["tp"].in_domain:
                k = None
            else:
                k = len(out.mems)
                out.placements.append(placement)
                out.mems.append(mesh_memory(model, cluster, training, *key))
                out.times.append(mesh_time(model, cluster, training, factors, *key, order))
            meshes[key] = k
        if k is None:
            out.crossing += grp.count
            continue
        mm = out.mems[k]
        m, schedule = grp.microbatches, grp.schedule
        rows = zero_rows.get((k, m, grp.zeros))
        if rows is None:
            rows = zero_rows[k, m, grp.zeros] = []
            for zero in grp.zeros:
                states = mm.states(zero, m)
                r = state_ids.get(id(states))
                if r is None:
                    r = state_ids[id(states)] = len(out.rows)
                    out.rows.append(states)
                rows.append(r)
        codes = knob_codes.get(grp.knobs)
        if codes is None:
            codes = knob_codes[grp.knobs] = [2 * AC_INDEX[ac] + sp for ac, sp in grp.knobs]
        out.groups.append(grp)
        out.mesh.append(k)
        out.state_rows.append(rows)
        out.knobs.append(codes)
        out.inflight.append(mm.inflight(schedule, m))
        out.logits.append(mm.logits_held(schedule, m))
    return out


def plan_one(
    layout: Layout,
    *,
    problem: Problem,
    factors: CalibrationFactors | None = None,
    allow_tp_across_nodes: bool = False,
) -> PlannedLayout:
    """Check, place and estimate a single layout of ``problem`` as given (raises LayoutError if it is
    invalid); the caller canonicalises (``canonical_layout``) where twins must be one entry."""
    model, cluster, training = problem.model, problem.cluster, problem.training
    m = check_layout(layout, model=model, cluster=cluster, training=training, allow_tp_across_nodes=allow_tp_across_nodes)
    placement = place(layout, cluster, allow_tp_across_nodes=allow_tp_across_nodes)
    mem = estimate_memory(layout, model=model, cluster=cluster, training=training)
    t = estimate_time(layout, model=model, cluster=cluster, training=training, factors=factors, placement=placement)
    return PlannedLayout(layout=layout, microbatches=m, placement=placement, memory=mem, time=t)


def candidate_layouts(*, model: ModelSpec, cluster: ClusterSpec, space: SearchSpace | None = None,
                      training: TrainingSpec | None = None) -> int:
    """An upper bound on the layouts ``enumerate_layouts`` walks (valid and rejected), computed from the
    divisors of the device count without enumerating anything: the (tp, cp, ep, pp) tuples whose
    product divides the devices (dp takes the rest), times the knob combinations of one mesh.

    The number of such tuples is the number of ordered factorisations of the device count, which
    for n = p1^a1 ... pk^ak is prod C(ai + 3, 3) (stars and bars per prime): a divisor-rich count
    such as 720,720 gives 89,600 meshes and ~3 x 10^7 candidates where 2^16 gives 969 and ~4 x 10^5.
    """
    space = (space or SearchSpace()).for_stack(training)  # an unset vpp: the training stack's interleavings
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
    training: TrainingSpec | None = None,
) -> int:
    """The candidate count (``candidate_layouts``, for ``training``'s stack), or SpecError naming the
    cluster when it is above ``limit``: enumeration time grows with it (tens of seconds for 3 x 10^7),
    so a request is refused before any of that work is done."""
    n = candidate_layouts(model=model, cluster=cluster, space=space, training=training)
    if n > limit:
        raise SpecError(
            f"cluster.nodes={cluster.nodes} x cluster.devices_per_node={cluster.devices_per_node} = "
            f"{cluster.devices:,} devices gives up to {n:,} candidate layouts to plan, above the limit of "
            f"{limit:,} per {where} (the count grows with the divisors of the device count): {remedy}"
        )
    return n
