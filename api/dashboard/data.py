"""The dashboard's reads: sweep-service calls turned into the plain dicts ``views`` and the templates use.

Only services are called here (routes never build queries): ``api.sweeps.service`` for sweeps and
trials, ``api.reshard.service`` for the sweep's migration (reshard) checks. One page load reads the
sweep's trials once (``list_trials``), the ranking and the Pareto points; a 2,000-trial sweep is a
few hundred kB of rows. A running sweep's state is kept and refreshed with what changed
(api/dashboard/live.py, which reads the trials table itself: the row cache is the dashboard's);
``state.assemble`` builds the state from the rows either way.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy.orm import Session

from api import format as fmt
from api._gc import settle
from api._lru import LRU
from api.dashboard import live, views
from api.dashboard.state import LIVE_STATUSES, assemble, microbatches_of
from api.engine._calibrate import describe
from api.paging import MAX_PAGE
from api.probes import display
from api.probes.service import hardware, probe_line
from api.ranking import service as rankings
from api.reshard import service as reshard_service
from api.routes._cache import sweep_version
from api.spec import SweepSpec
from api.sweeps import service
from tuner import ProbedFigures, TrainingSpec, relative_error

GiB = views.GiB


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
        problem = SweepSpec.model_validate(spec).to_problem()
        model, cluster, training = problem.model, problem.cluster, problem.training
    except ValueError:
        return out
    out.update(
        model_label=model.name,
        cluster_label=fmt.cluster_label(cluster),
        device_memory=cluster.device_memory, training=training, global_batch=training.global_batch,
    )
    return out


def trial_row(t: Any, *, training: TrainingSpec | None = None, device_memory: int | None = None) -> dict[str, Any]:
    """A stored trial (ORM row) as the flat dict ``views`` documents."""
    peak = t.peak_memory_bytes
    return {
        "id": t.id, "number": t.number, "attempt": t.attempt, "phase": t.phase, "source": t.source,
        "repeat": t.repeat, "status": t.status, "layout": dict(t.layout), "key": t.layout_key,
        "label": views.layout_label(t.layout), "tokens": t.tokens_per_s_per_device, "step_time": t.step_time_s,
        "world_size": t.world_size, "microbatches": microbatches_of(t.layout, training), "cause": t.cause,
        "error": t.error,
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
    rows = rankings.ranking(session, sweep_id=sweep.id, limit=1).rows
    return rows[0] if rows else None


def sweep_list_row(s: Any, best: Any | None = None, confirm_runs: int = 0) -> dict[str, Any]:
    """A row of the sweeps list; ``best``: the sweep's ``ranked_best`` row; ``confirm_runs``: its finished
    confirm runs, counted apart from the budgeted short runs as on the sweep's page."""
    simulated = s.backend == "simulate"
    return {
        "id": s.id, "name": s.name, "status": s.status, "owner": s.owner, "backend": s.backend,
        "best": best.median if best else None, "best_label": views.layout_label(best.layout) if best else None,
        "best_key": best.layout_key if best else None,
        "done": s.n_completed + s.n_pruned + s.n_failed - confirm_runs, "confirm_runs": confirm_runs, "budget": budget_of(s.spec),
        "device_seconds": s.device_seconds, "simulated": simulated, "started": s.started_at or s.created_at,
        "priority": s.priority, "queue_position": s.queue_position, "running_trials": s.running_trials,
    }


def sweeps_page(session: Session, *, status: str | None, page: int, per_page: int = 50) -> dict[str, Any]:
    result = service.list_sweeps(session, status=status, limit=per_page, offset=(page - 1) * per_page)
    confirm = service.confirm_runs(session, sweep_ids=[s.id for s in result.items])
    return {
        "sweeps": [sweep_list_row(s, ranked_best(session, s), confirm.get(s.id, 0)) for s in result.items],
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
        page = service.list_trials(session, sweep_id=sweep_id, limit=MAX_PAGE, offset=len(rows))
        rows.extend(page.items)
        if not page.items or len(rows) >= page.total:
            return rows


def probe_panel(sweep: Any) -> dict[str, Any] | None:
    """The cluster figures the sweep modelled with (api/probes): its line, and each figure probed vs
    datasheet with the ratio; from the calibration's record of the probe (no query)."""
    line = probe_line(sweep.calibration, sweep.backend)
    if line is None:
        return None
    figures = ((sweep.calibration or {}).get("probe") or {}).get("figures")
    rows: list[dict[str, str]] = []
    if figures:
        try:
            cluster = SweepSpec.model_validate(sweep.spec).to_problem().cluster
            rows = display.rows(hardware(cluster), ProbedFigures.from_dict(figures))
        except ValueError:  # a spec (or probe) this version no longer reads: the line alone
            rows = []
    return {"line": line, "rows": rows, "probed": bool(figures)}


def sweep_header(sweep: Any, prob: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": sweep.id, "name": sweep.name, "status": sweep.status, "owner": sweep.owner,
        "backend": sweep.backend, "sampler": sweep.sampler, "error": sweep.error,
        "stop_reason": sweep.stop_reason,
        "started": sweep.started_at or sweep.created_at, "budget": prob["budget"] or "?",
        "model_label": prob["model_label"], "cluster_label": prob["cluster_label"],
        "global_batch": prob["global_batch"], "simulated": sweep.backend == "simulate",
        "migration_refusal": reshard_service.refusal(sweep),
        # the calibration's held-out Spearman vs the prior, the memory error, the earlier sweeps it
        # learned from and the host's noise: the lines `meshtune show` prints (api.engine._calibrate)
        "calibration_lines": describe(sweep.calibration),
        "probe": probe_panel(sweep),
        "priority": sweep.priority, "queue_position": sweep.queue_position, "running_trials": sweep.running_trials,
    }


# A finished sweep no longer changes: its state is kept (a few MB for 2,000 trials) so that page
# reloads, table pages and the importance fetch do not read every trial again. Keyed on the
# sweep's counters too, so a re-opened or re-measured sweep is read afresh. A running sweep's state
# is shared for LIVE_TTL_S, so that any number of open pages polling it cost one read per period,
# and that read is incremental (api/dashboard/live.py): its trial rows stay formatted.
_finished: LRU[dict[str, Any]] = LRU(max_entries=8)
LIVE_TTL_S = 2.0


def sweep_state(session: Session, *, sweep_id: int) -> dict[str, Any]:
    """Sweep header, trial rows, ranking rows and chart bundle of one sweep (raises NotFoundError)."""
    # A finished sweep's repeat loads are one primary-key read: its queue position and running
    # trials (two more queries) are only read with its state, on a miss.
    sweep = service.get_sweep(session, sweep_id=sweep_id)
    if sweep.status in LIVE_STATUSES:
        sweep = service.describe_sweep(session, sweep_id=sweep_id)
        now = time.monotonic()
        entry = live.kept(sweep, lambda: _kept(sweep))
        with entry.lock:
            state = entry.state
            if state is None or now - entry.read_at >= LIVE_TTL_S or state["sweep"]["status"] != sweep.status:
                first = state is None
                state, entry.read_at = entry.refresh(session, sweep, sweep_header(sweep, entry.prob)), now
                if first:
                    settle()  # every trial row now kept: out of later full collections (api/_gc.py)
            return state
    # sweep_version: the counters every recorded result refreshes, and the calibration (a refit
    # changes the ranking's order and errors)
    key = (sweep.id, sweep.finished_at, *sweep_version(sweep))
    kept = _finished.get(key)
    if kept is not None:
        return kept
    sweep = service.describe_sweep(session, sweep_id=sweep_id)
    entry = live.take(sweep)  # just finished: its kept rows need only what changed since
    if entry is not None:
        with entry.lock:
            state = entry.refresh(session, sweep, sweep_header(sweep, entry.prob))
    else:
        state = _read_state(session, sweep)
    _finished.put(key, state)
    settle()  # kept until evicted: out of later full collections (api/_gc.py)
    return state


def _kept(sweep: Any) -> live.Kept:
    prob = problem(sweep)
    return live.Kept(sweep, prob, lambda t: trial_row(t, training=prob["training"], device_memory=prob["device_memory"]))


def _read_state(session: Session, sweep: Any) -> dict[str, Any]:
    """The sweep's state read from scratch: every trial formatted, the ranking read."""
    prob = problem(sweep)
    cap = prob["device_memory"]
    trials = [trial_row(t, training=prob["training"], device_memory=cap) for t in all_trials(session, sweep_id=sweep.id)]
    return assemble(sweep, prob, trials, rankings.ranking(session, sweep_id=sweep.id), header=sweep_header(sweep, prob))


# --- migration (reshard) checks ---------------------------------------------------------------------

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
