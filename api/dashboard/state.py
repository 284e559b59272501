"""A sweep's dashboard state assembled from its formatted trial rows and its ranking: the ranking
rows the tables show, the Pareto points and the chart bundle (api/dashboard/data.py reads the rows,
from scratch or kept between a running sweep's reads, and calls ``assemble``)."""

from __future__ import annotations

import itertools
from typing import Any

from api import format as fmt
from api.dashboard import views
from tuner import TIED, Layout, LayoutError, TrainingSpec, microbatches, pareto_front

GiB = views.GiB
LIVE_STATUSES = ("queued", "running")
_versions = itertools.count(1)  # each new state gets its own: the router's rendered pages key on it


def microbatches_of(layout: dict[str, Any], training: TrainingSpec | None) -> int | None:
    """The layout's microbatches per step (None: no training spec, or a layout it cannot read)."""
    if training is None:
        return None
    try:
        return microbatches(Layout(**layout), training)
    except (LayoutError, TypeError):
        return None


def _links(trials: list[dict[str, Any]]) -> tuple[dict[str, int], dict[str, int | None], dict[str, list[float]]]:
    """What the ranking rows read from the trials, by layout key: the first measurement's id (the
    one a ranking row links to) and hosts, and the measured MFUs."""
    first_id: dict[str, int] = {}
    nodes: dict[str, int | None] = {}
    by_key_mfu: dict[str, list[float]] = {}
    for t in trials:
        if t["status"] == "completed":
            first_id.setdefault(t["key"], t["id"])
            nodes.setdefault(t["key"], t["nodes"])
            if t["mfu"] is not None:
                by_key_mfu.setdefault(t["key"], []).append(t["mfu"])
    return first_id, nodes, by_key_mfu


def _ranking_rows(ranking: Any, links: tuple[dict[str, Any], ...], prob: dict[str, Any], *,
                  memo: dict[str, int | None]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The ranking's rows as the tables show them, and its measured layouts as Pareto points
    (``memo``: layout key -> microbatches, kept by a live sweep between states)."""
    first_id, nodes, by_key_mfu = links
    cap = prob["device_memory"]
    rows = []
    best_known = bool(ranking.rows) and fmt.interval_known(ranking.rows[0])
    for i, (r, versus) in enumerate(zip(ranking.rows, fmt.versus_rows(ranking.rows), strict=True)):
        d = dict(vars(r))  # shallow: asdict() deep-copies every layout (0.7 s for 2,000 rows)
        mfus = sorted(by_key_mfu.get(r.layout_key, []))
        above = ranking.rows[i - 1] if i else None
        if r.layout_key not in memo:  # microbatches read only fields the key names (tuner.Layout.key)
            memo[r.layout_key] = microbatches_of(r.layout, prob["training"])
        d.update(
            id=first_id.get(r.layout_key), tokens=r.median, lo=r.low, hi=r.high, status="completed",
            versus=versus, versus_text=fmt.versus_text(versus, row_known=fmt.interval_known(r), best_known=best_known),
            # "≈ the row above": both intervals known and in one tie group (a single run joins any
            # group, tuner._stats.rank, which says nothing about it being close)
            tied=bool(above and fmt.interval_known(r) and fmt.interval_known(above)
                      and above.tie_group == r.tie_group),
            mfu=mfus[len(mfus) // 2] if mfus else None, microbatches=memo[r.layout_key],
            peak_gib=r.peak_memory_bytes / GiB if r.peak_memory_bytes else None,
            capacity_gib=cap / GiB if cap else None,
            memory_fraction=min(r.peak_memory_bytes / cap, 1.0) if r.peak_memory_bytes and cap else None,
            memory_error=r.memory_prediction_error, time_error=r.prediction_error,
            # time and cost to train training.train_tokens at its measured tokens/s (api.ranking.budget)
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
    return rows, points


def assemble(sweep: Any, prob: dict[str, Any], trials: list[dict[str, Any]], ranking: Any, *,
              header: dict[str, Any], kept: dict[str, Any] | None = None) -> dict[str, Any]:
    """The state from the formatted trial rows and the ranking (``header``: sweep_header's, filled in
    here). ``kept``: a live sweep's parts of its last state — the ranking rows, Pareto points and the
    charts drawn from them are reused while the ranking and the trials' links are the same."""
    cap = prob["device_memory"]
    links = _links(trials)
    if kept is not None and kept.get("ranking") is ranking and kept.get("links") == links:
        rows, points, charts = kept["rows"], kept["points"], kept["charts"]
    else:
        rows, points = _ranking_rows(ranking, links, prob, memo={} if kept is None else kept.setdefault("m", {}))
        charts = None
    if kept is None:
        bundle = views.chart_bundle(trials, points=points, device_memory=cap)
    else:  # views.chart_bundle's parts, those of the points kept (tests compare it with chart_bundle)
        if charts is None:
            charts = {"pareto": views.pareto_chart(points, device_memory=cap), "heatmaps": views.heatmaps(points)}
        bundle = {"summary": views.summary(trials), **charts, "timeline": views.timeline(trials),
                  "stages": views.stage_bars(trials), "losses": views.loss_curves(trials)}
        kept.update(ranking=ranking, links=links, rows=rows, points=points, charts=charts)
    best_known = bool(ranking.rows) and fmt.interval_known(ranking.rows[0])
    tied = sum(r["versus"] == TIED for r in rows)  # the best is not tied with itself
    if ranking.rows:  # the headline is the ranking's winner (median over its measurements)
        top = ranking.rows[0]
        bundle["summary"].update(best_tokens_per_s_per_device=views.sig(top.median),
                                 best_label=views.layout_label(top.layout), best_trial_id=rows[0]["id"])
    bundle["status"] = sweep.status
    bundle["stop_reason"] = sweep.stop_reason  # why it ended (a live page shows it when it does)
    bundle["live"] = sweep.status in LIVE_STATUSES
    header["tied_sentence"] = fmt.tied_sentence(tied, best_known=best_known or not rows)
    header["simulated"] = header["simulated"] or ranking.simulated or any(t["simulated"] for t in trials)
    results = [t for t in trials if t["status"] not in ("pruned", "running", "interrupted")]
    header["all_simulated"] = sweep.simulated or (bool(results) and all(t["simulated"] for t in results))
    spend = ranking.budget or {}  # the token budget, the price and what the search spent
    header["priced"] = spend.get("train_tokens") is not None or spend.get("price_per_device_hour") is not None
    header["train_tokens"] = fmt.tokens_text(spend.get("train_tokens"))
    header["search_spent"] = fmt.search_spent(sweep.device_seconds or 0.0, simulated=sweep.backend == "simulate",
                                              price_per_device_hour=spend.get("price_per_device_hour"))
    bundle["summary"]["search_spent"] = header["search_spent"]  # refreshed on a live page (data-fact)
    return {"sweep": header, "trials": trials, "ranking": rows, "bundle": bundle, "problem": prob,
            "version": next(_versions)}
