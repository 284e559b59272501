"""The layout search space and the enumeration of every valid layout in it.

Enumeration applies the rules of ``check_layout`` (same reasons, same order) but checks each rule
once at the level it depends on, so a rejected mesh counts all of its knob combinations without
building them; every divisor of the device count is a candidate degree. Layouts are enumerated and
counted in canonical form (ZeRO twins folded, ``Enumeration.twins``). Valid means runnable by the
trial's workload: the space is cut to its capabilities (``within_capabilities``) and what
``check_supported`` still refuses counts as ``R_WORKLOAD``. Details: docs/tuner.md, "Search space".
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any, NamedTuple

from tuner._errors import LayoutError, SpecError
from tuner._layout import (
    CHECKPOINTING,
    R_BATCH,
    R_FEW_MICROBATCHES,
    R_INTERLEAVED,
    R_SP_SEQ,
    R_STAGES,
    R_TP_NODES,
    R_WORLD,
    SCHEDULES,
    Layout,
    canonical_zero,
    degree_violation,
)
from tuner._partition import max_stages
from tuner._placement import AXES, _place, check_order
from tuner._realise import Capabilities, builtin_capabilities, check_supported
from tuner._specs import ClusterSpec, ModelSpec, TrainingSpec
from tuner._stack import DEFAULT_STACK, STACKS, stack_of

if TYPE_CHECKING:  # a Problem holds a SearchSpace; enumeration reads the Problem
    from tuner._problem import Problem

R_MAX_LAYOUTS = "beyond space.max_layouts"
R_WORKLOAD = "not realised by the workload"


def divisors(n: int) -> tuple[int, ...]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return tuple(sorted(set(small + [n // d for d in small])))


def _int_tuple(name: str, value: Any, *, allow_none: bool, lo: int = 1) -> tuple[int, ...] | None:
    if value is None:
        if allow_none:
            return None
        raise SpecError(f"space.{name} must be a list of integers, got None")
    items = (value,) if isinstance(value, int) and not isinstance(value, bool) else value
    if isinstance(items, (str, bytes)) or not hasattr(items, "__iter__"):
        raise SpecError(f"space.{name} must be a list of integers, got {value!r}")
    out = tuple(items)
    if not out:
        raise SpecError(f"space.{name} must not be empty")
    for v in out:
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise SpecError(f"space.{name} values must be integers >= {lo}, got {v!r}")
    return tuple(sorted(set(out)))


def _choice_tuple(name: str, value: Any, allowed: tuple[Any, ...]) -> tuple[Any, ...]:
    items = (value,) if isinstance(value, (str, bool)) else value
    if not hasattr(items, "__iter__"):
        raise SpecError(f"space.{name} must be a list of {allowed}, got {value!r}")
    out = tuple(items)
    if not out:
        raise SpecError(f"space.{name} must not be empty")
    for v in out:
        if not any(v is a or (type(v) is type(a) and v == a) for a in allowed):
            raise SpecError(f"space.{name} values must be among {allowed}, got {v!r}")
    return tuple(a for a in allowed if a in out)


@dataclass(frozen=True)
class SearchSpace:
    """Which values enumeration considers. ``None`` degrees mean every divisor of the device count;
    ``vpp`` applies to the interleaved schedule only (gpipe/1F1B run one stage per rank), ``None``
    the training stack's interleavings (``Stack.interleavings``: 2 and 4, Megatron's 8 too)."""

    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    cp: tuple[int, ...] | None = None
    ep: tuple[int, ...] | None = None
    zero: tuple[int, ...] = (0, 1, 2, 3)
    mbs: tuple[int, ...] = (1, 2, 4, 8)
    ac: tuple[str, ...] = CHECKPOINTING
    sp: tuple[bool, ...] = (False, True)
    schedules: tuple[str, ...] = SCHEDULES
    vpp: tuple[int, ...] | None = None
    max_layouts: int | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        for name in ("tp", "pp", "cp", "ep"):
            set_(self, name, _int_tuple(name, getattr(self, name), allow_none=True))
        zero = _int_tuple("zero", self.zero, allow_none=False, lo=0)
        if zero and max(zero) > 3:
            raise SpecError(f"space.zero values must be among (0, 1, 2, 3), got {max(zero)}")
        set_(self, "zero", zero)
        set_(self, "mbs", _int_tuple("mbs", self.mbs, allow_none=False))
        set_(self, "vpp", _int_tuple("vpp", self.vpp, allow_none=True))
        set_(self, "ac", _choice_tuple("ac", self.ac, CHECKPOINTING))
        set_(self, "sp", _choice_tuple("sp", self.sp, (False, True)))
        set_(self, "schedules", _choice_tuple("schedules", self.schedules, SCHEDULES))
        if self.max_layouts is not None and (
            isinstance(self.max_layouts, bool) or not isinstance(self.max_layouts, int) or self.max_layouts < 1
        ):
            raise SpecError(f"space.max_layouts must be a positive integer, got {self.max_layouts!r}")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None) -> SearchSpace:
        """A space from user data (spec file ``space:`` section); errors name ``space.<field>``."""
        if data is None:
            return cls()
        if isinstance(data, SearchSpace):
            return data
        if not isinstance(data, Mapping):
            raise SpecError(f"space must be a mapping, got {data!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecError(f"space.{unknown[0]} is not a known field (known: {', '.join(sorted(known))})")
        return cls(**dict(data))

    def to_dict(self) -> dict[str, Any]:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v) for f in fields(self)}

    def for_stack(self, training: TrainingSpec | None) -> SearchSpace:
        """This space with ``vpp`` resolved: the one given, else the interleavings of ``training``'s
        stack (None: the default stack's)."""
        if self.vpp is not None:
            return self
        return replace(self, vpp=(STACKS[DEFAULT_STACK] if training is None else stack_of(training)).interleavings)


class LayoutGroup(NamedTuple):
    """Valid layouts alike in mesh, schedule, vpp and mbs (so in micro-batches per step too): every
    ZeRO level of ``zeros`` (outermost) with every (ac, sp) of ``knobs``, the first ``count`` of them."""

    tp: int
    cp: int
    ep: int
    dp: int
    pp: int
    schedule: str
    vpp: int
    mbs: int
    microbatches: int
    zeros: tuple[int, ...]
    knobs: tuple[tuple[str, bool], ...]
    count: int

    def layout(self, i: int) -> Layout:
        """The ``i``-th layout of the group."""
        zero, (ac, sp) = self.zeros[i // len(self.knobs)], self.knobs[i % len(self.knobs)]
        return _layout(self._base(), zero, ac, sp)

    def layouts(self) -> Iterator[Layout]:
        base, n = self._base(), 0
        for zero in self.zeros:
            for ac, sp in self.knobs:
                if n == self.count:
                    return
                yield _layout(base, zero, ac, sp)
                n += 1

    def _base(self) -> dict[str, Any]:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "cp": self.cp, "ep": self.ep, "mbs": self.mbs,
                "schedule": self.schedule, "vpp": self.vpp}


def _layout(base: dict[str, Any], zero: int, ac: str, sp: bool) -> Layout:
    # Every field was validated by the space: build the Layout without re-running __post_init__
    # (a 16k-device cluster has ~10^5 of them).
    layout = object.__new__(Layout)
    d = layout.__dict__
    d.update(base)
    d["zero"], d["ac"], d["sp"] = zero, ac, sp
    return layout


@dataclass
class Enumeration:
    """Valid layouts (with their micro-batch counts) and rejected ones counted by reason. The valid
    ones are held as ``groups`` (what ``plan`` costs); ``valid`` lists them as Layouts."""

    rejected: dict[str, int] = field(default_factory=dict)
    # Space combinations (valid or rejected) that are a twin of a counted layout and not counted again.
    twins: int = 0
    groups: list[LayoutGroup] = field(default_factory=list)
    # The first reason the workload gave for a layout counted as R_WORKLOAD (None: it refused none).
    refusal: str | None = None

    @cached_property
    def valid(self) -> list[Layout]:
        return [layout for g in self.groups for layout in g.layouts()]

    @cached_property
    def microbatches(self) -> list[int]:
        return [m for g in self.groups for m in [g.microbatches] * g.count]

    @property
    def count(self) -> int:
        """How many layouts are valid."""
        return sum(g.count for g in self.groups)

    @property
    def considered(self) -> int:
        return self.count + sum(self.rejected.values())


def _schedules(pp: int, space: SearchSpace) -> list[tuple[str, int]]:
    """(schedule, vpp) variants for a pp degree; one variant without pipelining (``space`` resolved
    for a stack: ``SearchSpace.for_stack``)."""
    assert space.vpp is not None, "a space's vpp is resolved for its stack before enumeration"
    if pp == 1:
        return [("1f1b", 1)]
    out = [(s, 1) for s in space.schedules if s != "interleaved"]
    if "interleaved" in space.schedules:
        out += [("interleaved", v) for v in space.vpp]
    return out


def _zeros(space: SearchSpace, data: int, pp: int, m: int | None) -> list[int]:
    """The distinct canonical ZeRO levels that ``space.zero`` gives on a mesh with ``data`` = dp*cp*ep
    data ranks, ``pp`` pipeline ranks and ``m`` micro-batches (None: the batch does not divide)."""
    out: list[int] = []
    for z in space.zero:
        c = canonical_zero(z, data=data, microbatches=m)
        if c not in out:
            out.append(c)
    return out


def _microbatches(gb: int, dp: int, ep: int, mbs: int) -> int | None:
    return gb // (dp * ep * mbs) if gb % (dp * ep * mbs) == 0 else None


def mesh_knobs(tp: int, cp: int, ep: int, dp: int, pp: int, *, space: SearchSpace, training: TrainingSpec,
               twins: list[int] | None = None) -> int:
    """Canonical layouts of one mesh over every knob of ``space`` (what a rejected mesh counts);
    ``twins[0]`` is increased by the space combinations folded into them."""
    n_sp = sum(1 for s in space.sp if not s or tp > 1)
    n_sched = len(_schedules(pp, space))
    n = 0
    for mbs in space.mbs:
        n += len(_zeros(space, dp * cp * ep, pp, _microbatches(training.global_batch, dp, ep, mbs)))
    n *= len(space.ac) * n_sp * n_sched
    if twins is not None:
        twins[0] += len(space.zero) * len(space.mbs) * len(space.ac) * n_sp * n_sched - n
    return n


def iter_meshes(
    *,
    model: ModelSpec,
    cluster: ClusterSpec,
    space: SearchSpace,
    rejected: dict[str, int],
    training: TrainingSpec,
    allow_tp_across_nodes: bool = False,
    order: tuple[str, ...] = AXES,
    twins: list[int] | None = None,
) -> Iterator[tuple[int, int, int, int, int]]:
    """Yield valid (tp, cp, ep, dp, pp); count every canonical knob combination of a rejected mesh.
    Unless allowed, a mesh whose TP groups would leave a node (placed in ``order``) is rejected.

    A degree left open (None) ranges over the divisors of what the degrees before it leave (ep only
    for MoE models), so it never causes a world-size mismatch; explicit values may, and are counted
    once per explicit combination (open degrees after them count as one).
    """
    world, per_node = cluster.devices, cluster.devices_per_node
    n_knobs = len(space.zero) * len(space.mbs) * len(space.ac)

    def knobs(tp: int, pp: int | None) -> int:
        n_sp = sum(1 for s in space.sp if not s or tp > 1)
        n_sched = len(_schedules(pp, space)) if pp is not None else 1
        return n_knobs * n_sp * n_sched

    def explicit_after(*names: str) -> int:
        n = 1
        for name in names:
            vals = getattr(space, name)
            n *= len(vals) if vals is not None else 1
        return n

    def mismatch(n: int) -> None:
        rejected[R_WORLD] = rejected.get(R_WORLD, 0) + n

    for tp in space.tp or divisors(world):
        if world % tp:
            mismatch(knobs(tp, None) * explicit_after("cp", "ep", "pp"))
            continue
        for cp in space.cp or divisors(world // tp):
            if (world // tp) % cp:
                mismatch(knobs(tp, None) * explicit_after("ep", "pp"))
                continue
            rest = world // (tp * cp)
            for ep in space.ep or (divisors(rest) if model.is_moe else (1,)):
                if rest % ep:
                    mismatch(knobs(tp, None) * explicit_after("pp"))
                    continue
                for pp in space.pp or divisors(rest // ep):
                    if (rest // ep) % pp:
                        mismatch(knobs(tp, pp))
                        continue
                    dp = rest // (ep * pp)
                    bad = degree_violation(tp, cp, ep, dp, pp, model=model, cluster=cluster)
                    if not bad and (tp > 1 and not allow_tp_across_nodes
                                    and not _place((tp, cp, ep, dp, pp), order, per_node,
                                                           cluster.domain_devices).axes["tp"].in_domain):
                        bad = (R_TP_NODES, "")
                    if bad:
                        n = mesh_knobs(tp, cp, ep, dp, pp, space=space, training=training, twins=twins)
                        rejected[bad[0]] = rejected.get(bad[0], 0) + n
                        continue
                    yield tp, cp, ep, dp, pp


def within_capabilities(space: SearchSpace, capabilities: Capabilities) -> SearchSpace:
    """``space`` cut to what ``capabilities`` realises (``Capabilities.space_limits``); SpecError
    naming the field when the space asks only for values the workload cannot run."""
    changes: dict[str, tuple] = {}
    for name, allowed in capabilities.space_limits().items():
        given = getattr(space, name)
        kept = allowed if given is None else tuple(v for v in given if v in allowed)
        if not kept:
            raise SpecError(f"space.{name}={list(given)}: workload {capabilities.workload!r} realises only "
                            f"{name} in {list(allowed)} for this model")
        changes[name] = kept
    return replace(space, **changes) if changes else space


def _refusal(tp: int, cp: int, ep: int, dp: int, pp: int, ac: str, sp: bool, *, model: ModelSpec,
             capabilities: Capabilities | None) -> str | None:
    """Why the workload cannot run this mesh with ``ac`` and ``sp``, or None: ``check_supported``
    itself (the rule a listed layout and the workers' ``parallelize_model`` apply), so valid means
    runnable. It reads only the degrees, sp and ac, so one probe stands for every other knob."""
    probe = _layout(dict(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, mbs=1, schedule="1f1b", vpp=1), 0, ac, sp)  # sp: tp > 1
    try:
        check_supported(probe, model, capabilities)
    except LayoutError as exc:
        return str(exc)
    return None


def enumerate_layouts(
    *,
    problem: Problem,
    allow_tp_across_nodes: bool = False,
    order: tuple[str, ...] = AXES,
) -> Enumeration:
    """Every valid layout of ``problem.space`` for its model, cluster and training, and the rejected
    ones counted. ``problem.capabilities``: what the trial's workload realises (None: the built-in
    model for this shape); the space is cut to it and what ``check_supported`` still refuses is
    counted as ``R_WORKLOAD``. TP groups stay inside a node (placed in ``order``) unless
    ``allow_tp_across_nodes``."""
    model, cluster, training, capabilities = problem.model, problem.cluster, problem.training, problem.capabilities
    space = problem.space.for_stack(training)
    # Only what the workload realises is enumerated (valid means runnable); None: the built-in model.
    space = within_capabilities(space, capabilities or builtin_capabilities(model))
    order = check_order(order)
    out = Enumeration()
    rejected = out.rejected
    groups = out.groups
    n_valid = 0
    limit = space.max_layouts if space.max_layouts is not None else float("inf")
    gb = training.global_batch
    n_ac = len(space.ac)
    n_raw_zero = len(space.zero)
    twins = [0]
    most_stages = max_stages(model, end_stages=stack_of(training).end_stages)

    def count(reason: str, n: int) -> None:
        if n:
            rejected[reason] = rejected.get(reason, 0) + n

    for tp, cp, ep, dp, pp in iter_meshes(model=model, cluster=cluster, space=space, rejected=rejected,
                                          training=training, allow_tp_across_nodes=allow_tp_across_nodes,
                                          order=order, twins=twins):
        scheds = _schedules(pp, space)
        # Per mbs: micro-batches and the distinct canonical ZeRO levels (twins folded).
        per_mbs = [(mbs, m := _microbatches(gb, dp, ep, mbs), _zeros(space, dp * cp * ep, pp, m)) for mbs in space.mbs]
        twins[0] += sum(n_raw_zero - len(z) for _, _, z in per_mbs) * n_ac * len(scheds) * sum(
            1 for s in space.sp if not s or tp > 1)
        sp_ok = [s for s in space.sp if not s or tp > 1]
        if True in sp_ok and model.seq_len % (tp * cp):
            sp_ok.remove(True)
            count(R_SP_SEQ, sum(len(z) for _, _, z in per_mbs) * n_ac * len(scheds))
        knobs, refused = [], 0
        for ac in space.ac:
            for sp in sp_ok:
                why = _refusal(tp, cp, ep, dp, pp, ac, sp, model=model, capabilities=capabilities)
                if why is None:
                    knobs.append((ac, sp))
                else:
                    refused += 1
                    out.refusal = out.refusal or why
        if refused:
            count(R_WORKLOAD, sum(len(z) for _, _, z in per_mbs) * refused * len(scheds))
        knobs_t = tuple(knobs)
        for schedule, vpp in scheds:
            if pp * vpp > most_stages:
                count(R_STAGES, sum(len(z) for _, _, z in per_mbs) * len(knobs))
                continue
            for mbs, m, zeros in per_mbs:
                n_per = len(zeros) * len(knobs)
                if m is None:
                    count(R_BATCH, n_per)
                    continue
                if pp > 1 and schedule != "gpipe" and m < pp:
                    count(R_FEW_MICROBATCHES, n_per)
                    continue
                if schedule == "interleaved" and m % pp:
                    count(R_INTERLEAVED, n_per)
                    continue
                if n_valid + n_per > limit:
                    keep = max(0, int(limit) - n_valid)
                    count(R_MAX_LAYOUTS, n_per - keep)
                else:
                    keep = n_per
                if not keep:
                    continue
                groups.append(LayoutGroup(tp, cp, ep, dp, pp, schedule, vpp, mbs, m, tuple(zeros), knobs_t, keep))
                n_valid += keep
    out.twins = twins[0]
    return out
