"""Find a cluster's probe or run one, and store it.

A probe is looked up by its ``key`` (what it measures: the cluster's hardware, the model's shapes,
the compute dtype, the backend and workload) and the ``env_fingerprint`` of the ranks that would use
it, which the backend's own rank processes report (``environment``: one empty program on the
trials' gang, which the trials then reuse). No row of that key, fingerprint and probe version: the
probe runs (``measure``: workers/probe.py on the same gang, its figures read by tuner/_probe.py) and
is stored in one transaction at its end (``save``), so an interrupted or failed probe leaves nothing
that a later sweep could use. A failure is ``ProbeError``: one line naming the cause.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Iterable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

import tuner
from api.engine._learned import fingerprint
from api.probes.models import ClusterProbe
from tuner import (
    PROBE_VERSION,
    BackendError,
    ClusterSpec,
    Layout,
    ModelSpec,
    ProbedFigures,
    TrainingSpec,
    derive,
    summary,
)

__all__ = ["ProbeError", "ProbeOutcome", "compute_dtype", "ensure", "environment", "latest", "measure",
           "probe_key", "record_of", "save", "targets_of"]


class ProbeError(BackendError):
    """The probe could not run or finish (its gang did not start, a rank failed, it timed out)."""


@dataclasses.dataclass
class ProbeOutcome:
    """The probe a sweep or command uses, and whether it was found (``reused``) or just run."""

    row: ClusterProbe
    reused: bool


def hardware(cluster: ClusterSpec) -> ClusterSpec:
    """The cluster as hardware: no price, no figures of an earlier probe."""
    return dataclasses.replace(cluster, price_per_device_hour=None, probed=None)


def compute_dtype(cluster: ClusterSpec, training: TrainingSpec, options: dict[str, Any] | None = None) -> str:
    """The dtype the ranks compute in (workers/rank_model.py ``_precision``): bf16 only on CUDA or
    with ``cpu_bf16``, fp32 otherwise."""
    bf16 = training.precision == "bf16" and (cluster.device_kind == "cuda" or bool((options or {}).get("cpu_bf16")))
    return "bfloat16" if bf16 else "float32"


def probe_key(*, cluster: ClusterSpec, model: ModelSpec, training: TrainingSpec, backend: str,
              workload: str = "builtin", options: dict[str, Any] | None = None) -> str:
    """What a probe measures, as a short hash: the hardware (nodes, devices, links, memory), the
    model's shapes (its name left out), the compute dtype, the backend and the workload."""
    shape = {k: v for k, v in tuner.to_dict(model).items() if k != "name"}
    ident = {"cluster": _jsonable(tuner.to_dict(hardware(cluster))), "model": shape,
             "dtype": compute_dtype(cluster, training, options), "backend": backend, "workload": workload}
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k not in ("name", "probed")}


def targets_of(layouts: Iterable[Layout]) -> tuple[list[tuple[int, bool]], int]:
    """The (tp, sp) configurations and the largest micro-batch of ``layouts``: what the probe's
    layer measurements cover."""
    layouts = list(layouts)
    tp_sp = sorted({(lay.tp, bool(lay.sp) and lay.tp > 1) for lay in layouts}) or [(1, False)]
    return tp_sp, max((lay.mbs for lay in layouts), default=1)


def latest(session: Session, *, key: str, env_fingerprint: str | None = None) -> ClusterProbe | None:
    """The newest probe of ``key`` (and of ``env_fingerprint`` when given) by this probe version."""
    q = sa.select(ClusterProbe).where(ClusterProbe.key == key, ClusterProbe.version == PROBE_VERSION)
    if env_fingerprint is not None:
        q = q.where(ClusterProbe.env_fingerprint == env_fingerprint)
    return session.scalars(q.order_by(ClusterProbe.id.desc()).limit(1)).first()


def get(session: Session, probe_id: int) -> ClusterProbe | None:
    return session.get(ClusterProbe, probe_id)


def newest(session: Session, *, limit: int = 100) -> list[ClusterProbe]:
    return list(session.scalars(sa.select(ClusterProbe).order_by(ClusterProbe.id.desc()).limit(limit)))


def _request(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, *, workload: str,
             layouts: Iterable[Layout], budget_s: float | None, trial_id: str | None,
             target_s: float | None = None, layer_reps: int | None = None) -> Any:
    from workers.probe import DEFAULT_BUDGET_S, LAYER_REPS, TARGET_S, probe_request

    layouts = list(layouts)
    tp_sp, max_mbs = targets_of(layouts)
    recompute = tuple(sorted({lay.ac for lay in layouts} - {"none"}))
    return probe_request(model, cluster, training, tp_sp=tp_sp, max_mbs=max_mbs, recompute=recompute, workload=workload,
                         budget_s=budget_s or DEFAULT_BUDGET_S, target_s=target_s or TARGET_S, trial_id=trial_id,
                         layer_reps=layer_reps or LAYER_REPS)


def _run(backend: Any, request: Any, program: Any, what: str) -> Any:
    run_program = getattr(backend, "run_program", None)
    if not callable(run_program):
        raise ProbeError(f"backend {getattr(backend, 'name', '?')!r} runs no probe (it has no run_program): "
                         "datasheet figures")
    try:
        out = run_program(request, program=program)
    except BackendError as exc:
        raise ProbeError(f"could not start the probe's rank processes ({what}): {exc}") from None
    if out.error is not None:
        err = out.error
        where = f" on rank {err.rank}" if err.rank is not None else ""
        kind = "timed out" if err.kind == "timeout" else f"failed ({err.kind})"
        raise ProbeError(f"the probe {kind}{where} ({what}): {err.message.splitlines()[0] if err.message else ''}")
    if not out.reports:
        raise ProbeError(f"the probe's ranks returned nothing ({what})")
    return out


def environment(backend: Any, *, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                workload: str = "builtin") -> dict[str, Any]:
    """The environment of the rank processes the trials run on (their rank 0's fingerprint,
    workers/env.py), from an empty program on the trials' gang."""
    from workers.probe import environment_rank

    request = _request(model, cluster, training, workload=workload, layouts=[], budget_s=None, trial_id=None)
    return dict(_run(backend, request, environment_rank, "asking the ranks their environment").reports[0]["env"])


def measure(backend: Any, *, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
            layouts: Iterable[Layout], workload: str = "builtin", budget_s: float | None = None,
            trial_id: str | None = None, target_s: float | None = None,
            layer_reps: int | None = None) -> dict[str, Any]:
    """Run the probe on ``backend`` and read its figures; the row's fields (nothing stored yet).
    ``target_s``, ``layer_reps``: seconds of repetitions per measurement, and the least repetitions
    of a real layer (workers/probe.py ``TARGET_S``, ``LAYER_REPS``; fewer: quicker and noisier)."""
    from workers.probe import probe_rank

    t0 = time.monotonic()
    request = _request(model, cluster, training, workload=workload, layouts=layouts, budget_s=budget_s,
                       trial_id=trial_id, target_s=target_s, layer_reps=layer_reps)
    raw = dict(_run(backend, request, probe_rank, "measuring").reports[0])
    env = dict(raw.pop("env", {}) or {})
    figures = derive(raw, model=model, cluster=hardware(cluster), training=training)
    name = getattr(backend, "name", "?")
    return {"key": probe_key(cluster=cluster, model=model, training=training, backend=name, workload=workload),
            "env_fingerprint": fingerprint(env, name) or "", "version": PROBE_VERSION, "backend": name,
            "cluster": tuner.to_dict(hardware(cluster)), "model": tuner.to_dict(model),
            "dtype": figures.dtype or compute_dtype(cluster, training), "figures": figures.to_dict(), "raw": raw,
            "env": env, "wall_s": time.monotonic() - t0}


def save(session: Session, fields: dict[str, Any]) -> ClusterProbe:
    """Store a finished probe (the caller's transaction commits it whole)."""
    row = ClusterProbe(**fields)
    session.add(row)
    session.flush()
    return row


def ensure(sessions: Any, backend: Any, *, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
           layouts: Iterable[Layout], workload: str = "builtin", force: bool = False,
           budget_s: float | None = None, trial_id: str | None = None) -> ProbeOutcome:
    """The probe of this cluster, model and environment: the stored one, else a new one (stored).
    ``force``: measure again even when one is stored (``meshtune probe``)."""
    from api import store

    name = getattr(backend, "name", "?")
    key = probe_key(cluster=cluster, model=model, training=training, backend=name, workload=workload)
    layouts = list(layouts)
    with sessions() as s:
        any_stored = latest(s, key=key) is not None
    if any_stored and not force:  # is one of them of the ranks' environment? (else nothing to ask)
        env = environment(backend, model=model, cluster=cluster, training=training, workload=workload)
        fp = fingerprint(env, name) or ""
        tp_sp, _ = targets_of(layouts)
        with sessions() as s:
            row = latest(s, key=key, env_fingerprint=fp)
            if row is not None and covers(row, tp_sp):
                s.expunge(row)
                return ProbeOutcome(row, reused=True)
    fields = measure(backend, model=model, cluster=cluster, training=training, layouts=layouts, workload=workload,
                     budget_s=budget_s, trial_id=trial_id)
    with store.session_scope(sessions) as s:
        row = save(s, fields)
        s.flush()
        s.expunge(row)
    return ProbeOutcome(row, reused=False)


def covers(row: ClusterProbe, tp_sp: Iterable[tuple[int, bool]]) -> bool:
    """Whether the probe was asked to measure a layer under every (tp, sp) of ``tp_sp`` (or measured no
    layer at all, as for a one-layer model): a layout of another tensor-parallel degree is probed
    again. One its budget skipped counts as asked (the nearest probed tp stands in, and its notes
    say so): probing again on a host as busy would skip it again."""
    asked = (row.raw or {}).get("requested_layers") or (row.figures or {}).get("layers", [])
    wanted = {(int(x["tp"]), bool(x["sp"])) if isinstance(x, dict) else (int(x[0]), bool(x[1])) for x in asked}
    return not (row.figures or {}).get("layers") or set(tp_sp) <= wanted


def figures_of(row: ClusterProbe) -> ProbedFigures:
    return ProbedFigures.from_dict(row.figures)


def record_of(outcome: ProbeOutcome, cluster: ClusterSpec) -> dict[str, Any]:
    """What a sweep's calibration keeps of the probe it used (``calibration["probe"]``): enough to
    re-predict under it without the store (api/engine/_prediction.py ``cluster_under``)."""
    row = outcome.row
    return {"id": row.id, "key": row.key, "env_fingerprint": row.env_fingerprint, "reused": outcome.reused,
            "created_at": row.created_at.isoformat() if row.created_at else None, "wall_s": row.wall_s,
            "figures": dict(row.figures), "summary": summary(hardware(cluster), figures_of(row))}


def probe_line(calibration: dict[str, Any] | None, backend: str | None = None) -> str | None:
    """What figures a sweep's model read: its probe (id, when, measured or reused, how many figures
    probed) or the datasheet and why; None on the simulate backend (its results are the datasheet
    model's, and say so everywhere)."""
    probe = (calibration or {}).get("probe")
    if probe is None:
        return None if backend == "simulate" else "cluster figures: datasheet (this sweep used no probe)"
    if not probe.get("figures"):
        return f"cluster figures: datasheet ({probe.get('note') or 'no probe'})"
    when = (probe.get("created_at") or "")[:16].replace("T", " ")
    how = "reused" if probe.get("reused") else f"measured in {probe.get('wall_s') or 0:.0f} s"
    return (f"cluster figures: probe #{probe.get('id')} of {when} ({how}): {probe.get('summary')} "
            f"(`meshtune probe --show` lists them)")


def stored(*, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, backend: str,
           workload: str = "builtin", any_nodes: bool = False,
           exact_first: bool = False) -> tuple[ClusterProbe | None, str]:
    """The newest stored probe of this cluster and model on ``backend`` (whatever environment it
    ran in: a command that starts no rank cannot tell), and a note when there is none. Creates no
    store: with none yet, or one that cannot be opened, there is no probe. ``any_nodes``,
    ``exact_first``: as ``stored_in``."""
    from api import store
    from api.settings import Settings

    settings = Settings()
    if not settings.database_url and not (settings.home / "meshtune.db").exists():
        return None, "no store yet"
    try:
        _, sessions = store.open_store(settings.resolved_database_url)
        with sessions() as s:
            row, note = stored_in(s, model=model, cluster=cluster, training=training, backend=backend,
                                  workload=workload, any_nodes=any_nodes, exact_first=exact_first)
            if row is not None:
                s.expunge(row)
    except store.StoreUnavailableError as exc:
        return None, f"store unavailable: {exc}"
    return row, note


def stored_in(session: Session, *, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, backend: str,
              workload: str = "builtin", any_nodes: bool = False,
              exact_first: bool = False) -> tuple[ClusterProbe | None, str]:
    """As ``stored``, in an open session (the API's). ``any_nodes``: the newest probe of the same
    hardware at whichever node count it ran (the cluster-size comparisons': what a probe of N nodes
    says of M nodes is api/plan/service.py ``comparison_figures``'s); with ``exact_first``, the
    newest probe of exactly ``cluster.nodes`` where there is one (a single plan's,
    api/plan/service.py ``plan_probe``)."""
    if not any_nodes or exact_first:
        row = latest(session, key=probe_key(cluster=cluster, model=model, training=training, backend=backend,
                                            workload=workload))
        if row is not None or not any_nodes:
            return row, "" if row is not None else "no probe of this cluster and model is stored"
    keys: dict[int, str] = {}  # node count -> what this hardware's probe of that many nodes is keyed by
    q = (sa.select(ClusterProbe.id, ClusterProbe.key, ClusterProbe.cluster)
         .where(ClusterProbe.version == PROBE_VERSION, ClusterProbe.backend == backend)
         .order_by(ClusterProbe.id.desc()))
    for probe_id, key, probed in session.execute(q):
        nodes = (probed or {}).get("nodes")
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            continue
        if nodes not in keys:
            keys[nodes] = probe_key(cluster=dataclasses.replace(cluster, nodes=nodes), model=model,
                                    training=training, backend=backend, workload=workload)
        if key == keys[nodes]:
            return session.get(ClusterProbe, probe_id), ""
    return None, "no probe of this cluster's hardware and model is stored, at any node count"
