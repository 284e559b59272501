"""Plan services: what the plan routes, the dashboard's /plan page and ``meshtune plan`` call.
Keyword-only; bad input raises SpecError (tuner._errors) naming the field and the value.

The tuner's plan is a pure function of frozen specs, so answers are memoised per (model, cluster,
training): the first call for a 64-GPU 70B problem enumerates ~10^4 layouts, repeats are instant.
What one new answer may cost is bounded before any planning starts: the candidate layouts are
counted from the divisors of the device count (tuner._plan.candidate_layouts), a count above
``MAX_CANDIDATES`` is refused, and the count is passed to the caller's ``charge`` (the routes charge
an anonymous client's ``ClientBudget``); a cached answer is never charged. A plan is made on the
stored probe of its node count, else on the newest of its hardware at another (``plan_probe``), a
comparison on the newest of each type's hardware at any (``comparison_probe``); ``plan_figures`` and
``comparison_figures`` say what each takes from it (a tier of links the probe lacked stays datasheet).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from sqlalchemy.orm import Session

import tuner
from api._lru import LRU
from api.probes import service as probes
from api.probes.models import ClusterProbe
from tuner import (
    DEFAULT_STACK,
    TIER_NAMES,
    ClusterSpec,
    Enumeration,
    Layout,
    ModelSpec,
    Problem,
    SizePoint,
    SpecError,
    TrainingSpec,
    check_planning_work,
    cluster_spec,
    compare_devices,
    devices_figure,
    enumerate_layouts,
    model_spec,
    plan,
    plan_sizes,
    sizes_figure,
    stack_of,
    summary,
    to_dict,
    training_spec,
    unprobed_tiers,
)

MAX_DEVICES = 65_536  # bounds the divisor enumeration (16,384 devices plan in ~0.5 s; see benchmarks/bench_plan.py)
# ~1-3 s of one core at most (65,536 devices: 3.7 x 10^5 candidates, ~1 s; 24,576: 8.6 x 10^5, ~0.4 s).
MAX_CANDIDATES = 1_000_000

Charge = Callable[[int], None]  # takes the candidate layouts a new answer considers (raises to refuse)


class ClientBudget:
    """A token bucket of candidate layouts per client address: ``capacity`` at most (by default room
    for two of the largest plans allowed), refilled at ``rate`` per second (~6% of a core per client
    at ~3 us per candidate). ``clock`` is injectable so that a test can move time instead of waiting."""

    def __init__(self, *, capacity: int = 2 * MAX_CANDIDATES, rate: float = 20_000.0,
                 clock: Callable[[], float] = time.monotonic, max_clients: int = 10_000) -> None:
        self.capacity, self.rate, self.clock, self.max_clients = capacity, rate, clock, max_clients
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # client -> (tokens, at)
        self._lock = threading.Lock()

    def charge(self, client: str, cost: int) -> float:
        """Take ``cost`` from the client's bucket; 0.0 if it had enough, else the seconds to wait
        (nothing taken)."""
        now = self.clock()
        cost = min(cost, self.capacity)  # a plan dearer than a full bucket waits for a full bucket
        with self._lock:
            tokens, at = self._buckets.pop(client, (float(self.capacity), now))
            tokens = min(float(self.capacity), tokens + (now - at) * self.rate)
            wait = 0.0 if tokens >= cost else (cost - tokens) / self.rate
            self._buckets[client] = (tokens - cost if not wait else tokens, now)
            while len(self._buckets) > self.max_clients:  # the least recently seen client goes
                self._buckets.popitem(last=False)
        return wait


# Plans, size and device comparisons kept as (answer, seconds it took): a pure function of the problem.
_PLANS: LRU[tuple[Any, float]] = LRU(max_entries=32)
_SIZES: LRU[tuple[Any, float]] = LRU(max_entries=32)
_DEVICES: LRU[tuple[Any, float]] = LRU(max_entries=32)


def _timed(compute: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    return compute(), time.perf_counter() - started


def preset_problem(*, model: str, cluster: str, nodes: int | None, devices_per_node: int | None,
                   global_batch: int | None, global_batch_tokens: int | None, critical_batch_tokens: int | None,
                   precision: str, train_tokens: float | None, price_per_device_hour: float | None,
                   stack: str = "meshtune") -> Problem:
    """The problem named by presets and overrides (the GET routes' query parameters)."""
    overrides = {k: v for k, v in (("nodes", nodes), ("devices_per_node", devices_per_node),
                                   ("price_per_device_hour", price_per_device_hour)) if v is not None}
    if "," in cluster:
        raise SpecError(f"cluster={cluster}: several device types are compared by /api/plan/devices")
    c = cluster_spec({"preset": cluster, **overrides})
    check_devices(c)
    m, t = preset_model_training(model=model, global_batch=global_batch, global_batch_tokens=global_batch_tokens,
                                 critical_batch_tokens=critical_batch_tokens, precision=precision,
                                 train_tokens=train_tokens, stack=stack)
    return Problem(model=m, cluster=c, training=t)


def preset_model_training(*, model: str, global_batch: int | None, global_batch_tokens: int | None,
                          critical_batch_tokens: int | None, precision: str, train_tokens: float | None,
                          stack: str) -> tuple[ModelSpec, TrainingSpec]:
    """The model preset and the training section given by exactly one of the two batch sizes."""
    if (global_batch is None) == (global_batch_tokens is None):
        raise SpecError("global_batch: give exactly one of global_batch and global_batch_tokens")
    m = model_spec(model)
    training: dict[str, Any] = {"precision": precision, "stack": stack}
    if global_batch is not None:
        training["global_batch"] = global_batch
    else:
        training["global_batch_tokens"] = global_batch_tokens
    if critical_batch_tokens is not None:
        training["critical_batch_tokens"] = critical_batch_tokens
    if train_tokens is not None:
        training["train_tokens"] = train_tokens
    return m, training_spec(training, seq_len=m.seq_len)


def check_devices(c: ClusterSpec) -> None:
    """SpecError when the cluster has more devices than one HTTP plan may enumerate."""
    if c.devices > MAX_DEVICES:
        raise SpecError(
            f"cluster.nodes x cluster.devices_per_node = {c.devices} devices exceeds this endpoint's limit of "
            f"{MAX_DEVICES}; plan larger clusters with `meshtune plan`"
        )


def plan_answer(session: Session, *, problem: Problem, backend: str, top: int, charge: Charge) -> dict[str, Any]:
    """The plan of the problem on the stored probe ``plan_probe`` finds (``backend``'s, as ``meshtune
    plan`` does), cached, or a new one charged first: the fields of a PlanOut."""
    model, cluster, training = problem.model, problem.cluster, problem.training
    row, note = plan_probe(session, model=model, cluster=cluster, training=training, backend=backend)
    c = probed_cluster(row=row, cluster=cluster, training=training)
    answer = _PLANS.get((model, c, training))
    if answer is None:
        charge(check_planning_work(model=model, cluster=c, limit=MAX_CANDIDATES, where="plan request",
                                   remedy="plan it with `meshtune plan`, which has no such limit", training=training))
        probed = dataclasses.replace(problem, cluster=c)

        def compute() -> tuple[Any, list[Layout]]:
            enum = enumerate_layouts(problem=probed)
            return plan(problem=probed, enumeration=enum), _one_per_degree(enum)

        answer = _PLANS.put((model, c, training), _timed(compute))
    (result, layouts), seconds = answer
    _, figures = plan_figures(row=row, note=note, cluster=cluster, training=training, layouts=layouts)
    return {**result.to_dict(top=top), "seconds": round(seconds, 4), "figures": figures}


def _one_per_degree(enum: Enumeration) -> list[Layout]:
    """One valid layout of ``enum`` per (tp, sp) among them: all that ``plan_figures`` reads of a
    plan's valid layouts (which tensor-parallel degrees the probe covers), kept with the cached plan.
    A group's first ``len(knobs)`` layouts are its first ZeRO level under each (ac, sp)."""
    one: dict[tuple[int, bool], Layout] = {}
    for g in enum.groups:
        for i, (_, sp) in enumerate(g.knobs[:g.count]):
            if (g.tp, sp) not in one:
                one[g.tp, sp] = g.layout(i)
    return list(one.values())


def plan_probe(session: Session, *, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
               backend: str) -> tuple[ClusterProbe | None, str]:
    """The stored probe a plan of ``cluster`` uses (``backend``'s): the newest of exactly its node
    count, else the newest of its hardware at another (as a comparison's, ``comparison_probe``), and
    a note when none; none for another stack than meshtune's own (``plan_figures`` says why)."""
    if training.stack != DEFAULT_STACK:
        return None, ""
    return probes.stored_in(session, model=model, cluster=cluster, training=training, backend=backend,
                            any_nodes=True, exact_first=True)


def comparison_probe(session: Session, *, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                     backend: str) -> tuple[ClusterProbe | None, str]:
    """The stored probe a size comparison of ``cluster``'s hardware uses (the newest at any node
    count, ``backend``'s; api/probes/service.py ``stored_in``), and a note when none; none for
    another stack than meshtune's own (``comparison_figures`` says why)."""
    if training.stack != DEFAULT_STACK:
        return None, ""
    return probes.stored_in(session, model=model, cluster=cluster, training=training, backend=backend,
                            any_nodes=True)


def sizes_answer(session: Session, *, problem: Problem, counts: tuple[int, ...], scale_batch: bool, backend: str,
                 charge: Charge) -> dict[str, Any]:
    """The best predicted layout at each node count on the newest stored probe of the cluster's
    hardware (``comparison_probe``), and the comparison's figure: the fields of a PlanSizesOut
    (cached, or bounded and charged as a new plan is)."""
    m, c, t = problem.model, problem.cluster, problem.training
    row, note = comparison_probe(session, model=m, cluster=c, training=t, backend=backend)
    probed = probed_cluster(row=row, cluster=c, training=t)
    sizes = [cluster_spec({**to_dict(c), "nodes": n}) for n in counts]
    points, seconds = _bounded(_SIZES, (m, probed, t, counts, scale_batch), m, t, sizes, charge,
                               lambda: plan_sizes(problem=dataclasses.replace(problem, cluster=probed),
                                                  nodes=counts, scale_batch=scale_batch))
    title = f"{m.name} on {c.name}: best predicted layout per cluster size"
    return dict(model=to_dict(m), cluster=to_dict(probed), training=to_dict(t), scale_batch=scale_batch,
                sizes=[p.to_dict() for p in points], figure=sizes_figure(points, title=title),
                seconds=round(seconds, 4),
                figures=comparison_figures(row=row, note=note, cluster=c, training=t, counts=counts, points=points))


def devices_answer(session: Session, *, model: ModelSpec, clusters: list[ClusterSpec], training: TrainingSpec,
                   counts: tuple[int, ...] | None, scale_batch: bool, backend: str, charge: Charge) -> dict[str, Any]:
    """Every device type at every node count (each type's own nodes when ``counts`` is None), each
    type on the newest stored probe of its own hardware (``comparison_probe``): the fields of a
    PlanDevicesOut (cached, or bounded and charged as ``sizes_answer`` is)."""
    m, t = model, training
    found = [comparison_probe(session, model=m, cluster=c, training=t, backend=backend) for c in clusters]
    probed = [probed_cluster(row=row, cluster=c, training=t) for c, (row, _) in zip(clusters, found, strict=True)]
    sizes = [cluster_spec({**to_dict(c), "nodes": n}) for c in clusters for n in (counts or (c.nodes,))]
    points, seconds = _bounded(_DEVICES, (m, tuple(probed), t, counts, scale_batch), m, t, sizes, charge,
                               lambda: compare_devices(model=m, clusters=probed, training=t, nodes=counts,
                                                       scale_batch=scale_batch))
    title = f"{m.name}: best predicted layout per device type and size (stack {t.stack})"
    figures = [{"device": c.name, **comparison_figures(
        row=row, note=note, cluster=c, training=t, counts=counts or (c.nodes,),
        points=[p.size for p in points if p.device == c.name])} for c, (row, note) in zip(clusters, found, strict=True)]
    return dict(model=to_dict(m), clusters=[to_dict(c) for c in probed], training=to_dict(t),
                stack=stack_of(t).to_dict(), scale_batch=scale_batch, devices=[p.to_dict() for p in points],
                figure=devices_figure(points, title=title), seconds=round(seconds, 4), figures=figures)


def _bounded(cache: LRU[tuple[Any, float]], key: tuple[Any, ...], m: ModelSpec, t: TrainingSpec,
             sizes: list[ClusterSpec], charge: Charge, compute: Callable[[], Any]) -> tuple[Any, float]:
    """``compute()`` (and the seconds it took), cached under ``key``; a new answer is first bounded per
    cluster size (devices, candidate layouts) and charged."""
    answer = cache.get(key)
    if answer is not None:
        return answer
    cost = 0
    for size in sizes:
        check_devices(size)
        cost += check_planning_work(model=m, cluster=size, limit=MAX_CANDIDATES, where="plan request",
                                    remedy="plan it with `meshtune plan`, which has no such limit", training=t)
    charge(cost)
    return cache.put(key, _timed(compute))


def probed_cluster(*, row: ClusterProbe | None, cluster: ClusterSpec, training: TrainingSpec) -> ClusterSpec:
    """The cluster a plan is made on: with the stored probe's (``row``) figures for meshtune's own
    stack, else as it is (a probe times meshtune's workers, not another runtime)."""
    if row is None or training.stack != tuner.DEFAULT_STACK:
        return cluster
    return tuner.with_probe(cluster, probes.figures_of(row))


def plan_figures(*, row: ClusterProbe | None, note: str, cluster: ClusterSpec, training: TrainingSpec,
                 layouts: Iterable[Layout] = ()) -> tuple[ClusterSpec, dict[str, Any]]:
    """The cluster a plan is made on, and what the plan says of its figures: the stored probe's
    (``row``) for meshtune's own stack, else the datasheet's with the reason (``note`` when no probe).
    A probe of another node count (``plan_probe``) speaks for this one as in a comparison of this one
    size: its line is ``comparison_figures``'. ``layouts``: the plan's valid layouts, to say when some
    tensor-parallel degrees were not probed."""
    probed = probed_cluster(row=row, cluster=cluster, training=training)
    if row is not None and training.stack == tuner.DEFAULT_STACK and int(row.cluster["nodes"]) != cluster.nodes:
        return probed, _across_sizes(row=row, note=note, cluster=cluster, training=training, counts=(cluster.nodes,),
                                     layouts=layouts)
    nodes = None if row is None or training.stack != tuner.DEFAULT_STACK else cluster.nodes
    return probed, {**_figures(row=row, note=note, cluster=cluster, training=training, layouts=layouts),
                    "probe_nodes": nodes, "datasheet_links": []}


def comparison_figures(*, row: ClusterProbe | None, note: str, cluster: ClusterSpec, training: TrainingSpec,
                       counts: Iterable[int], points: Iterable[SizePoint] = ()) -> dict[str, Any]:
    """What a comparison of ``cluster`` at the node counts ``counts`` says of its figures, as
    ``plan_figures`` says a plan's, with the node count the probe ran on (``probe_nodes``) and the
    links each size keeps the datasheet's figures for (``datasheet_links``). ``points``: the best
    layout of each size, to say when some of their tensor-parallel degrees were not probed.

    A probe of N nodes speaks for M nodes of the same hardware wherever its figures are per device or
    per node: compute, the node's links, the overheads per layer, unit and step, the memory a process
    holds. A tier of links that M nodes reach and N did not (one node: no network; one fast domain:
    nothing beyond it) was not measured and keeps the datasheet's figures (``tuner.unprobed_tiers``);
    a tier it measured is used at every size (its fit is per link, the group size is the formula's)."""
    return _across_sizes(row=row, note=note, cluster=cluster, training=training, counts=tuple(counts),
                         layouts=[Layout(**p.layout) for p in points if p.layout is not None])


def _across_sizes(*, row: ClusterProbe | None, note: str, cluster: ClusterSpec, training: TrainingSpec,
                  counts: tuple[int, ...], layouts: Iterable[Layout]) -> dict[str, Any]:
    """``comparison_figures``, of the layouts ``layouts``."""
    if row is None or training.stack != tuner.DEFAULT_STACK:
        return {**_figures(row=row, note=note, cluster=cluster, training=training), "probe_nodes": None,
                "datasheet_links": []}
    nodes = int(row.cluster["nodes"])
    own = dataclasses.replace(cluster, nodes=nodes)  # the hardware as probed (the row's key is its)
    figures = probes.figures_of(row)
    lacking = set(unprobed_tiers(own, figures))  # tiers the probe's cluster has but did not time: its summary says
    datasheet: dict[str, list[int]] = {}
    for n in counts:
        for tier in unprobed_tiers(dataclasses.replace(cluster, nodes=n), figures):
            if tier not in lacking:
                datasheet.setdefault(tier, []).append(n)
    after = ""
    if datasheet:
        where = " and ".join(f"the {TIER_NAMES[tier]} at {_nodes_text(ns)}" for tier, ns in datasheet.items())
        after = f"; datasheet for {where} (none on the probe's {_nodes_text([nodes])})"
    out = _figures(row=row, note=note, cluster=own, training=training, layouts=layouts,
                   measured=f", measured on {_nodes_text([nodes])}", after=after)
    return {**out, "probe_nodes": nodes,
            "datasheet_links": [{"tier": tier, "nodes": ns} for tier, ns in datasheet.items()]}


def _nodes_text(counts: list[int]) -> str:
    """``1 node``, ``2 and 4 nodes``, ``2, 4 and 8 nodes``."""
    names = [str(n) for n in counts]
    text = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
    return f"{text} node{'s' * (len(counts) > 1 or counts[0] != 1)}"


def _figures(*, row: ClusterProbe | None, note: str, cluster: ClusterSpec, training: TrainingSpec,
             layouts: Iterable[Layout] = (), measured: str = "", after: str = "") -> dict[str, Any]:
    """The line (and its source) saying which figures model ``cluster``: the probe's (``row``, its
    summary on ``cluster``), or the datasheet's and why; ``measured``, ``after``: what a comparison
    adds before and after the summary."""
    from api.format import when

    if training.stack != tuner.DEFAULT_STACK:  # a probe times meshtune's own workers, not another runtime
        return {"source": "datasheet", "probe_id": None, "text": (
            f"cluster figures: datasheet (a probe measures meshtune's workers, not the {training.stack} stack)")}
    if row is None:
        return {"source": "datasheet", "probe_id": None,
                "text": f"cluster figures: datasheet ({note}; `meshtune probe` measures them)"}
    figures = probes.figures_of(row)
    tp_sp, _ = probes.targets_of(layouts)
    gaps = "" if probes.covers(row, tp_sp) else "; some tensor-parallel degrees here were not probed (nearest used)"
    text = (f"cluster figures: probe #{row.id} of {when(row.created_at)}{measured} "
            f"({summary(probes.hardware(cluster), figures)}{gaps}){after}")
    return {"source": "probed", "probe_id": row.id, "text": text}
