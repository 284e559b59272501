"""The dashboard's reads: sweep-service calls turned into the plain dicts ``views`` and the templates use.

Only services are called here (routes never build queries): ``api.sweeps.service`` for sweeps and
trials, ``api.reshard.service`` for the sweep's migration (reshard) checks. One page load reads the
sweep's trials once (``list_trials``), the ranking and the Pareto points; a 2,000-trial sweep is a
few hundred kB of rows.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from typing import Any

from sqlalchemy.orm import Session

from api import format as fmt
from api.dashboard import views
from api.engine._calibrate import describe
from api.reshard import service as reshard_service
from api.routes._cache import sweep_version
from api.spec import SweepSpec
from api.sweeps import service
from tuner import Layout, LayoutError, TrainingSpec, microbatches
from tuner._stats import TIED, pareto_front, relative_error

GiB = views.GiB
LIVE_STATUSES = ("queued", "running")
layout_from_key = fmt.layout_from_key  # kept here too: the dashboard's tests and pages read keys back


def budget_of(spec: dict[str, Any] | None) -> int | None:
    """Trials the sweep may run: ``max_trials`` search trials plus the re-measurements of the top-k
    layouts (``remeasure_top_k * (repeats - 1)``), which the engine runs on top of them."""
    search = (spec or {}).get("search") or {}
    if not isinstance(search.get("max_trials"), int):
        return None
    extra = int(search.get("remeasure_top_k", 3) or 0) * max(int(search.get("repeats", 3) or 1) - 1, 0)
    return search["max_trials"] + extra


def problem(sweep: Any) -> dict[str, Any]:
    """What the pages need from the sweep's spec: labels, device memory, budget, training spec."""
    spec = sweep.spec or {}
    out: dict[str, Any] = {
        "model_label": spec.get("model") if isinstance(spec.get("model"), str) else "custom model",
        "cluster_label": spec.get("cluster") if isinstance(spec.get("cluster"), str) else "custom cluster",
        "device_memory": None, "training": None, "global_batch": "?",
        "budget": budget_of(spec),
    }
    try:  # a spec stored by an older version may no longer validate: show what we can
        model, cluster, training = SweepSpec.model_validate(spec).to_problem()
    except ValueError:
        return out
    out.update(
        model_label=model.name,
        cluster_label=fmt.cluster_label(cluster),
        device_memory=cluster.device_memory, training=training, global_batch=training.global_batch,
    )
    return out


def _m(layout: dict[str, Any], training: TrainingSpec | None) -> int | None:
    if training is None:
        return None
    try:
        return microbatches(Layout(**layout), training)
    except (LayoutError, TypeError):
        return None


def trial_row(t: Any, *, training: TrainingSpec | None = None, device_memory: int | None = None) -> dict[str, Any]:
    """A stored trial (ORM row) as the flat dict ``views`` documents."""
    peak = t.peak_memory_bytes
    return {
        "id": t.id, "number": t.number, "attempt": t.attempt, "phase": t.phase, "source": t.source,
        "repeat": t.repeat, "status": t.status, "layout": dict(t.layout), "key": t.layout_key,
        "label": views.layout_label(t.layout), "tokens": t.tokens_per_s_per_device, "step_time": t.step_time_s,
        "world_size": t.world_size, "microbatches": _m(t.layout, training), "cause": t.cause, "error": t.error,
        "tokens_per_s_per_device": t.tokens_per_s_per_device, "tokens_per_s": t.tokens_per_s,
        "useful_tokens_per_s": t.useful_tokens_per_s, "mfu": t.mfu,
        "peak_memory_bytes": peak, "peak_gib": peak / GiB if peak else None,
        "peak_reserved_gib": t.peak_reserved_bytes / GiB if t.peak_reserved_bytes else None,
        "capacity_gib": device_memory / GiB if device_memory else None,
        "memory_fraction": min(peak / device_memory, 1.0) if peak and device_memory else None,
        "memory_measure": t.memory_measure,
        "predicted_memory_bytes": t.predicted_memory_bytes,
        "predicted_gib": t.predicted_memory_bytes / GiB if t.predicted_memory_bytes else None,
        "predicted_step_time_s": t.predicted_step_time_s,
        "memory_error": relative_error(t.predicted_memory_bytes, peak),
        "time_error": relative_error(t.predicted_step_time_s, t.step_time_s),
        "step_time_s": t.step_time_s, "step_times_s": t.step_times_s or [], "losses": t.losses or [],
        "stage_times_s": t.stage_times_s or [], "stage_imbalance": t.stage_imbalance,
        "env": t.env or {}, "env_fingerprint": t.env_fingerprint, "backend": t.backend,
        "simulated": bool(t.simulated), "wall_s": t.wall_s, "device_seconds": t.device_seconds,
        "created_at": t.created_at,
        "started_at": t.started_at, "finished_at": t.finished_at or (t.created_at if t.status == "pruned" else None),
        "reference": t.source == "reference",
        "nodes": _nodes(t.env),
        # rank -> node map, one row per node (a trial row from elsewhere may not have the column)
        "rank_nodes": getattr(t, "rank_nodes", None) or [], "node_rows": views.rank_nodes(getattr(t, "rank_nodes", None)),
    }


def _nodes(env: dict[str, Any] | None) -> int | None:
    """Hosts the trial's ranks ran on (the workers record their sorted host names)."""
    hosts = (env or {}).get("hosts")
    return len(hosts) if isinstance(hosts, list) and hosts else None


def ranked_best(session: Session, sweep: Any) -> Any | None:
    """The ranking's first row (best median over its measurements), or None before any measurement.
    The sweep row's cached ``best_*`` is the single fastest trial, which a lucky run of a noisy
    layout can hold while the ranking puts another first: wherever a sweep's "best" is shown it is
    this row, so that the list, the sweep page and ``meshtune sweeps`` name the same layout. It is
    the stored ranking's first row (api/store/_ranking.py): one row read, not the whole ranking."""
    if not sweep.n_completed:
        return None
    rows = service.ranking(session, sweep_id=sweep.id, limit=1).rows
    return rows[0] if rows else None


def sweep_list_row(s: Any, best: Any | None = None) -> dict[str, Any]:
    """A row of the sweeps list; ``best``: the sweep's ``ranked_best`` row."""
    simulated = s.backend == "simulate"
    return {
        "id": s.id, "name": s.name, "status": s.status, "owner": s.owner, "backend": s.backend,
        "best": best.median if best else None, "best_label": views.layout_label(best.layout) if best else None,
        "best_key": best.layout_key if best else None,
        "done": s.n_completed + s.n_pruned + s.n_failed, "budget": budget_of(s.spec),
        "device_seconds": s.device_seconds, "simulated": simulated, "started": s.started_at or s.created_at,
        "priority": s.priority, "queue_position": s.queue_position, "running_trials": s.running_trials,
    }


def sweeps_page(session: Session, *, status: str | None, page: int, per_page: int = 50) -> dict[str, Any]:
    result = service.list_sweeps(session, status=status, limit=per_page, offset=(page - 1) * per_page)
    return {
        "sweeps": [sweep_list_row(s, ranked_best(session, s)) for s in result.items],
        "total": result.total,
        "pages": max(1, -(-result.total // per_page)),
    }


def live_sweeps(session: Session) -> int:
    """Sweeps queued or running anywhere (the list keeps refreshing while there are any)."""
    return sum(service.list_sweeps(session, status=s, limit=1).total for s in LIVE_STATUSES)


def all_trials(session: Session, *, sweep_id: int) -> list[Any]:
    """Every trial of the sweep, read a service page (1,000 rows) at a time."""
    rows: list[Any] = []
    while True:
        page = service.list_trials(session, sweep_id=sweep_id, limit=service.MAX_PAGE, offset=len(rows))
        rows.extend(page.items)
        if not page.items or len(rows) >= page.total:
            return rows


def sweep_header(sweep: Any, prob: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": sweep.id, "name": sweep.name, "status": sweep.status, "owner": sweep.owner,
        "backend": sweep.backend, "sampler": sweep.sampler, "error": sweep.error,
        "started": sweep.started_at or sweep.created_at, "budget": prob["budget"] or "?",
        "model_label": prob["model_label"], "cluster_label": prob["cluster_label"],
        "global_batch": prob["global_batch"], "simulated": sweep.backend == "simulate",
        "migration_refusal": reshard_service.refusal(sweep),
        # the calibration's held-out Spearman vs the prior, the memory error, the earlier sweeps it
        # learned from and the host's noise: the lines `meshtune show` prints (api.engine._calibrate)
        "calibration_lines": describe(sweep.calibration),
        "priority": sweep.priority, "queue_position": sweep.queue_position, "running_trials": sweep.running_trials,
    }


# A finished sweep no longer changes: its state is kept (a few MB for 2,000 trials) so that page
# reloads, table pages and the importance fetch do not read every trial again. Keyed on the
# sweep's counters too, so a re-opened or re-measured sweep is read afresh. A running sweep's state
# is shared for LIVE_TTL_S, so that any number of open pages polling it cost one read per period.
_finished: OrderedDict[tuple[Any, ...], dict[str, Any]] = OrderedDict()
_finished_lock = threading.Lock()
_FINISHED_KEEP = 8
LIVE_TTL_S = 2.0
_live: dict[int, tuple[float, dict[str, Any]]] = {}
_versions = itertools.count(1)  # each state read gets its own: the router's rendered pages key on it


def sweep_state(session: Session, *, sweep_id: int) -> dict[str, Any]:
    """Sweep header, trial rows, ranking rows and chart bundle of one sweep (raises NotFoundError)."""
    # A finished sweep's repeat loads are one primary-key read: its queue position and running
    # trials (two more queries) are only read with its state, on a miss.
    sweep = service.get_sweep(session, sweep_id=sweep_id)
    if sweep.status in LIVE_STATUSES:
        sweep = service.describe_sweep(session, sweep_id=sweep_id)
        now = time.monotonic()
        with _finished_lock:
            hit = _live.get(sweep.id)
            if hit is not None and now - hit[0] < LIVE_TTL_S and hit[1]["sweep"]["status"] == sweep.status:
                return hit[1]
        state = _read_state(session, sweep)
        with _finished_lock:
            for sid in [k for k, (t, _) in _live.items() if now - t >= LIVE_TTL_S]:
                del _live[sid]
            _live[sweep.id] = (now, state)
        return state
    # sweep_version: the counters every recorded result refreshes, and the calibration (a refit
    # changes the ranking's order and errors)
    key = (sweep.id, sweep.finished_at, *sweep_version(sweep))
    with _finished_lock:
        if key in _finished:
            _finished.move_to_end(key)
            return _finished[key]
    state = _read_state(session, service.describe_sweep(session, sweep_id=sweep_id))
    with _finished_lock:
        _finished[key] = state
        while len(_finished) > _FINISHED_KEEP:
            _finished.popitem(last=False)
    return state


def _read_state(session: Session, sweep: Any) -> dict[str, Any]:
    sweep_id = sweep.id
    prob = problem(sweep)
    cap = prob["device_memory"]
    trials = [trial_row(t, training=prob["training"], device_memory=cap) for t in all_trials(session, sweep_id=sweep_id)]
    first_id, nodes = {}, {}
    for t in trials:  # the first measurement of each layout is the one a ranking row links to
        if t["status"] == "completed":
            first_id.setdefault(t["key"], t["id"])
            nodes.setdefault(t["key"], t["nodes"])
    by_key_mfu: dict[str, list[float]] = {}
    for t in trials:
        if t["status"] == "completed" and t["mfu"] is not None:
            by_key_mfu.setdefault(t["key"], []).append(t["mfu"])
    ranking = service.ranking(session, sweep_id=sweep_id)
    rows = []
    best_known = bool(ranking.rows) and fmt.interval_known(ranking.rows[0])
    for i, (r, versus) in enumerate(zip(ranking.rows, fmt.versus_rows(ranking.rows), strict=True)):
        d = dict(vars(r))  # shallow: asdict() deep-copies every layout (0.7 s for 2,000 rows)
        mfus = sorted(by_key_mfu.get(r.layout_key, []))
        above = ranking.rows[i - 1] if i else None
        d.update(
            id=first_id.get(r.layout_key), tokens=r.median, lo=r.low, hi=r.high, status="completed",
            versus=versus, versus_text=fmt.versus_text(versus, row_known=fmt.interval_known(r), best_known=best_known),
            # "≈ the row above": both intervals known and in one tie group (a single run joins any
            # group, tuner._stats.rank, which says nothing about it being close)
            tied=bool(above and fmt.interval_known(r) and fmt.interval_known(above)
                      and above.tie_group == r.tie_group),
            mfu=mfus[len(mfus) // 2] if mfus else None, microbatches=_m(r.layout, prob["training"]),
            peak_gib=r.peak_memory_bytes / GiB if r.peak_memory_bytes else None,
            capacity_gib=cap / GiB if cap else None,
            memory_fraction=min(r.peak_memory_bytes / cap, 1.0) if r.peak_memory_bytes and cap else None,
            memory_error=r.memory_prediction_error, time_error=r.prediction_error,
            # time and cost to train training.train_tokens at its measured tokens/s (api.sweeps.budget)
            budget_cells=fmt.budget_cells(r.budget, simulated=bool(r.budget and r.budget.get("simulated"))),
        )
        rows.append(d)
    # The Pareto points are the ranking's layouts (medians), on the front by the same function that
    # service.pareto uses; this saves reading every measurement a second time.
    measured = [r for r in ranking.rows if r.peak_memory_bytes is not None]
    front = set(pareto_front([(r.layout_key, r.tokens_per_s_per_device, r.peak_memory_bytes) for r in measured]))
    points = [
        {"layout_key": r.layout_key, "layout": r.layout, "tokens_per_s_per_device": r.tokens_per_s_per_device,
         "peak_memory_bytes": r.peak_memory_bytes, "on_front": r.layout_key in front,
         "trial_id": first_id.get(r.layout_key), "nodes": nodes.get(r.layout_key)}
        for r in measured
    ]
    bundle = views.chart_bundle(trials, points=points, device_memory=cap)
    tied = sum(r["versus"] == TIED for r in rows)  # the best is not tied with itself
    if ranking.rows:  # the headline is the ranking's winner (median over its measurements)
        top = ranking.rows[0]
        bundle["summary"].update(best_tokens_per_s_per_device=views.sig(top.median),
                                 best_label=views.layout_label(top.layout), best_trial_id=rows[0]["id"])
    bundle["status"] = sweep.status
    bundle["live"] = sweep.status in LIVE_STATUSES
    header = sweep_header(sweep, prob)
    header["tied_sentence"] = fmt.tied_sentence(tied, best_known=best_known or not rows)
    header["simulated"] = header["simulated"] or ranking.simulated or any(t["simulated"] for t in trials)
    results = [t for t in trials if t["status"] not in ("pruned", "running", "interrupted")]
    header["all_simulated"] = bool(results) and all(t["simulated"] for t in results)
    spend = ranking.budget or {}  # the token budget, the price and what the search spent
    header["priced"] = spend.get("train_tokens") is not None or spend.get("price_per_device_hour") is not None
    header["train_tokens"] = fmt.tokens_text(spend.get("train_tokens"))
    header["search_spent"] = fmt.search_spent(sweep.device_seconds or 0.0, simulated=sweep.backend == "simulate",
                                              price_per_device_hour=spend.get("price_per_device_hour"))
    bundle["summary"]["search_spent"] = header["search_spent"]  # refreshed on a live page (data-fact)
    return {"sweep": header, "trials": trials, "ranking": rows, "bundle": bundle, "problem": prob,
            "version": next(_versions)}


# --- migration (reshard) checks, issue 8 ------------------------------------------------------------

MIGRATION_TARGETS = 50  # the select of a "check migration" control offers the top of the ranking
LISTED_MISMATCHES = 5


def migration_targets(ranking: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The layouts a run may be moved to: the top of the ranking (rank, label, key, layout)."""
    return [{"rank": r["rank"], "label": views.layout_label(r["layout"]), "key": r["layout_key"],
             "layout": r["layout"]} for r in ranking[:MIGRATION_TARGETS]]


def check_row(c: Any) -> dict[str, Any]:
    """A stored reshard check (ORM row) as a row of the "migration checks" table."""
    return {
        "id": c.id, "verdict": c.verdict, "owner": c.owner, "created_at": c.created_at,
        "from_label": views.layout_label(c.from_layout), "to_label": views.layout_label(c.to_layout),
        "from_key": c.from_key, "to_key": c.to_key, "steps_before": c.steps_before, "steps_after": c.steps_after,
        "tensors_checked": c.tensors_checked, "mismatch_count": c.mismatch_count,
        "mismatches": list(c.mismatches or [])[:LISTED_MISMATCHES], "max_abs_diff": c.max_abs_diff,
        "max_rel_loss_diff": c.max_rel_loss_diff, "tolerance": c.tolerance, "corrupt": c.corrupt,
        "backend": c.backend, "error": c.error, "save_s": c.save_s, "load_s": c.load_s, "wall_s": c.wall_s,
    }


def migration_checks(session: Session, *, sweep_id: int) -> list[dict[str, Any]]:
    """The sweep's reshard checks, newest first."""
    return [check_row(c) for c in reversed(reshard_service.list_checks(session, sweep_id=sweep_id))]
