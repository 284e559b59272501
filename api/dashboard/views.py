"""View-model: stored trials (plain dicts) -> compact chart and table data for the dashboard.

Every function here is pure and takes the dashboard's *trial row*, a flat dict made by
``api.dashboard.data.trial_row`` from whatever the sweep service returns:

    id, number, status, layout (Layout fields), key, microbatches, tokens_per_s_per_device, mfu,
    peak_memory_bytes, predicted_memory_bytes, predicted_step_time_s, step_time_s, losses,
    stage_times_s, stage_imbalance, started_at, finished_at (datetime or None), device_seconds,
    simulated, error, nodes (optional: node count the trial used)

Charts are sent as Plotly trace dicts with columns as lists (no per-point objects) and floats rounded
to 4 significant digits, so a sweep of thousands of trials stays a few hundred kB.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from api import format as fmt

GiB = 2**30

# Outcomes in the order the legend lists them; "pruned" = rejected by the memory model, no device time.
OUTCOMES = ("completed", "pruned", "oom", "timeout", "crash", "nan", "running", "interrupted")
FAILURES = ("oom", "timeout", "crash", "nan")
FINISHED = ("completed", "pruned", *FAILURES)
OUTCOME_COLOURS = {
    "completed": "#2e7d32",
    "pruned": "#9e9e9e",
    "oom": "#8e24aa",
    "timeout": "#ef6c00",
    "crash": "#c62828",
    "nan": "#6d4c41",
    "running": "#1565c0",
    "interrupted": "#546e7a",
}
OUTCOME_LABELS = {"pruned": "pruned by the model", "oom": "OOM", "nan": "NaN"}
TP_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")
PP_SYMBOLS = ("circle", "square", "diamond", "triangle-up", "cross", "star", "hexagon", "triangle-down")


def sig(x: float | None, digits: int = 4) -> float | None:
    """``x`` rounded to ``digits`` significant digits (None and non-finite values become None)."""
    if x is None or not math.isfinite(x):
        return None
    if x == 0:
        return 0.0
    return round(x, digits - 1 - int(math.floor(math.log10(abs(x)))))


def completed(trials: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The measured short runs: a confirm run (``phase="confirm"``, many more steps) is not compared
    with them, as the ranking does not (it has its own card)."""
    return [t for t in trials if t["status"] == "completed" and t.get("tokens_per_s_per_device")
            and t.get("phase") != "confirm"]


def layout_label(layout: dict[str, Any]) -> str:
    """Short human label of a layout (``api.format.layout_text``: ``tp2 dp2 pp2 z1 1f1b``)."""
    return fmt.layout_text(layout)


def lost_and_rerun(trials: Sequence[dict[str, Any]]) -> set[Any]:
    """Ids of the rows a node died under whose layout ran again as a later live row of the same phase
    and repeat: listed, but counted once, as their re-run (the store's counts follow the same rule,
    ``api.store._sweeps._lost_and_rerun``; the engine re-queues a lost trial once, api/engine/_lost.py)."""
    last: dict[tuple, int] = {}
    for t in trials:
        if t["status"] != "interrupted":
            slot = (t["key"], t.get("phase"), t.get("repeat"))
            last[slot] = max(last.get(slot, t["number"]), t["number"])
    return {t["id"] for t in trials if ((t.get("error") or {}).get("infra") == "node_lost"
                                        and last[(t["key"], t.get("phase"), t.get("repeat"))] > t["number"])}


def summary(trials: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Counts by outcome of the short runs (what ``max_trials`` budgets; confirm runs are counted
    apart), best tokens/s per device, device time spent by every run (interrupted attempts are not
    results: they are re-run, so they are counted apart). Simulated trials' device-seconds are what
    the simulate backend says a real run would take: they are summed apart and never shown as real."""
    counts = dict.fromkeys(OUTCOMES, 0)
    confirm_finished = 0
    rerun = lost_and_rerun(trials)
    for t in trials:
        if t["id"] in rerun:
            continue
        if t.get("phase") == "confirm":
            confirm_finished += t["status"] in FINISHED
        else:
            counts[t["status"]] = counts.get(t["status"], 0) + 1
    done = completed(trials)
    best = max(done, key=lambda t: t["tokens_per_s_per_device"], default=None)
    real = sum(t.get("device_seconds") or 0.0 for t in trials if not t.get("simulated"))
    simulated = sum(t.get("device_seconds") or 0.0 for t in trials if t.get("simulated"))
    shown = fmt.device_time(real, simulated)
    return {
        "counts": counts,
        "finished": sum(counts[o] for o in FINISHED),
        "confirm_finished": confirm_finished,
        "failed": sum(counts[o] for o in FAILURES),
        "best_tokens_per_s_per_device": sig(best["tokens_per_s_per_device"]) if best else None,
        "best_trial_id": best["id"] if best else None,
        "best_label": layout_label(best["layout"]) if best else None,
        "device_seconds": real,
        "simulated_device_seconds": simulated,
        "device_time": shown["value"],
        "device_time_label": shown["label"],
        "device_time_simulated": shown["simulated"],
    }


def pareto_chart(points: Sequence[dict[str, Any]], *, device_memory: int | None) -> dict[str, Any]:
    """Throughput against peak memory, one point per measured layout (medians over its measurements):
    one trace per TP degree (colour), symbol by PP, and the Pareto front as a step line.

    ``points``: dicts with layout, tokens_per_s_per_device, peak_memory_bytes, on_front, trial_id.
    """
    tps = sorted({p["layout"].get("tp", 1) for p in points})
    pps = sorted({p["layout"].get("pp", 1) for p in points})
    symbol = {pp: PP_SYMBOLS[i % len(PP_SYMBOLS)] for i, pp in enumerate(pps)}
    traces: list[dict[str, Any]] = []
    for i, tp in enumerate(tps):
        group = [p for p in points if p["layout"].get("tp", 1) == tp]
        traces.append({
            # SVG up to a few thousand points; WebGL beyond (headless browsers without a GPU fall back to software GL).
            "type": "scattergl" if len(points) > 5000 else "scatter",
            "mode": "markers",
            "name": f"TP={tp}",
            "x": [sig(p["peak_memory_bytes"] / GiB) for p in group],
            "y": [sig(p["tokens_per_s_per_device"]) for p in group],
            "text": [layout_label(p["layout"]) for p in group],
            "customdata": [p.get("trial_id") for p in group],
            "marker": {
                "color": TP_COLOURS[i % len(TP_COLOURS)],
                "symbol": [symbol[p["layout"].get("pp", 1)] for p in group],
                "size": 9,
                "line": {"width": 0.5, "color": "#333"},
            },
            "hovertemplate": "%{text}<br>%{y:.4g} tok/s/dev<br>%{x:.3g} GiB<extra></extra>",
        })
    for pp in pps:  # legend entries for the PP symbols (no points of their own)
        traces.append({
            "type": "scatter", "mode": "markers", "name": f"PP={pp}", "x": [None], "y": [None],
            "marker": {"color": "#777", "symbol": symbol[pp], "size": 9}, "hoverinfo": "skip",
        })
    front = sorted((p for p in points if p.get("on_front")), key=lambda p: p["peak_memory_bytes"])
    traces.append({
        "type": "scatter", "mode": "lines", "name": "Pareto front", "line": {"shape": "hv", "color": "#000", "width": 2},
        "x": [sig(p["peak_memory_bytes"] / GiB) for p in front],
        "y": [sig(p["tokens_per_s_per_device"]) for p in front],
        "text": [layout_label(p["layout"]) for p in front],
        "hovertemplate": "front: %{text}<extra></extra>",
    })
    return {
        "traces": traces,
        "front_keys": [p["layout_key"] for p in front],
        "device_memory_gib": sig(device_memory / GiB) if device_memory else None,
        "points": len(points),
    }


def heatmaps(layouts: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Best tokens/s per device over TP (x) x PP (y) of the measured layouts (medians); one heatmap
    per node count (``nodes``: hosts the ranks ran on) when the layouts were measured on different
    numbers of nodes."""
    by_nodes: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for p in layouts:
        by_nodes[p.get("nodes")].append(p)
    out = []
    for nodes in sorted(by_nodes, key=lambda n: (n is None, n or 0)):
        group = by_nodes[nodes]
        tps = sorted({p["layout"].get("tp", 1) for p in group})
        pps = sorted({p["layout"].get("pp", 1) for p in group})
        best: dict[tuple[int, int], float] = {}
        for p in group:
            k = (p["layout"].get("tp", 1), p["layout"].get("pp", 1))
            best[k] = max(best.get(k, 0.0), p["tokens_per_s_per_device"])
        out.append({
            "title": "best tokens/s per device" + (f" — on {nodes} node(s)" if nodes is not None else ""),
            "x": [f"TP={tp}" for tp in tps],
            "y": [f"PP={pp}" for pp in pps],
            "z": [[sig(best.get((tp, pp))) for tp in tps] for pp in pps],
        })
    return out


def _iso(value: Any) -> str | None:
    if value is None:
        return None
    return value.isoformat(timespec="milliseconds") if isinstance(value, datetime) else str(value)


def timeline(trials: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Trials over wall-clock time, one bar per trial (y = trial number), coloured by outcome.

    Trials with no device time (pruned by the model, queued) are drawn as markers at the time they
    were recorded.
    """
    bar_traces, mark_traces = [], []
    small = len(trials) <= 300
    for rank, outcome in enumerate(OUTCOMES):
        group = [t for t in trials if t["status"] == outcome]
        bars = [t for t in group if t.get("started_at") and t.get("finished_at") and outcome != "running"]
        in_bars = {t["id"] for t in bars}
        marks = [t for t in group if t["id"] not in in_bars and (t.get("started_at") or t.get("finished_at"))]
        colour, label = OUTCOME_COLOURS[outcome], OUTCOME_LABELS.get(outcome, outcome)
        if bars:
            bar_traces.append({
                "type": "bar", "orientation": "h", "name": label, "legendgroup": outcome, "legendrank": rank,
                "base": [_iso(t["started_at"]) for t in bars],
                "x": [round((t["finished_at"] - t["started_at"]).total_seconds() * 1000) for t in bars],
                "y": [t["number"] for t in bars],
                "customdata": [t["id"] for t in bars],
                "marker": {"color": colour},
                "hovertemplate": f"trial %{{y}} — {label}<br>%{{x}} ms<extra></extra>",
            })
        if marks:
            mark_traces.append({
                "type": "scatter", "mode": "markers", "name": label, "legendgroup": outcome, "legendrank": rank,
                "showlegend": not bars,
                "x": [_iso(t.get("started_at") or t.get("finished_at")) for t in marks],
                "y": [t["number"] for t in marks],
                "customdata": [t["id"] for t in marks],
                "marker": {"color": colour, "symbol": "x-thin-open", "size": 10 if small else 5,
                           "line": {"width": 2 if small else 1, "color": colour}},
                "hovertemplate": f"trial %{{y}} — {label}<extra></extra>",
            })
    return {"traces": mark_traces + bar_traces}  # bars drawn over the markers


def _missing_note(done: Sequence[dict[str, Any]], *, what: str, of: str, none_yet: str) -> str:
    """Why a chart is empty, said truthfully: no ``of`` completed yet, or some did but recorded no
    ``what`` — always the case on the simulate backend, which answers from the analytical model and
    trains nothing (no per-stage times, no losses)."""
    if not done:
        return none_yet
    n = f"{len(done)} completed {of}"
    if all(t.get("simulated") for t in done):
        return f"no {what}: the simulate backend records none ({n}, all simulated)"
    return f"no {what} recorded by the {n}"


def stage_bars(trials: Sequence[dict[str, Any]], *, limit: int = 6) -> dict[str, Any]:
    """Measured per-stage step time of the fastest pipeline layouts (grouped bars show imbalance);
    ``note`` says why there are none when there are none."""
    done = [t for t in completed(trials) if t["layout"].get("pp", 1) > 1]
    piped = [t for t in done if t.get("stage_times_s")]
    piped.sort(key=lambda t: -t["tokens_per_s_per_device"])
    traces = []
    seen: set[str] = set()
    for t in piped:
        if t["key"] in seen:
            continue
        seen.add(t["key"])
        times = t["stage_times_s"]
        imbalance = t.get("stage_imbalance") or (max(times) / (sum(times) / len(times)))
        traces.append({
            "type": "bar", "name": f"{layout_label(t['layout'])} (max/mean {imbalance:.2f})",
            "x": [f"stage {i}" for i in range(len(times))],
            "y": [sig(s * 1000) for s in times],
            "customdata": [t["id"]] * len(times),
            "hovertemplate": "%{x}: %{y:.3g} ms<extra>%{fullData.name}</extra>",
        })
        if len(traces) >= limit:
            break
    note = None if traces else _missing_note(done, what="per-stage times", of="pipeline trials (pp > 1)",
                                             none_yet="no completed pipeline layout (pp > 1) yet")
    return {"traces": traces, "note": note}


def reference_trial(trials: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The numerics reference: a trial marked ``reference``, else the simplest completed layout
    (fewest model-parallel ranks, no ZeRO, no checkpointing), the one closest to single-device maths."""
    done = [t for t in completed(trials) if t.get("losses")]
    marked = [t for t in done if t.get("reference")]
    if marked:
        return marked[0]

    def simplicity(t: dict[str, Any]) -> tuple:
        lay = t["layout"]
        model_par = lay.get("tp", 1) * lay.get("pp", 1) * lay.get("cp", 1) * lay.get("ep", 1)
        return (model_par, lay.get("zero", 0), lay.get("ac", "none") != "none", t["number"])

    return min(done, key=simplicity, default=None)


def loss_curves(trials: Sequence[dict[str, Any]], *, limit: int = 8) -> dict[str, Any]:
    """Loss per step of the fastest layouts overlaid on the reference layout's (dashed black)."""
    ref = reference_trial(trials)
    if ref is None:
        note = _missing_note(completed(trials), what="losses", of="trials", none_yet="no completed trial yet")
        return {"traces": [], "reference_id": None, "note": note}
    others = [t for t in completed(trials) if t.get("losses") and t["id"] != ref["id"]]
    others.sort(key=lambda t: -t["tokens_per_s_per_device"])
    traces = [{
        "type": "scatter", "mode": "lines", "name": f"reference: {layout_label(ref['layout'])}",
        "x": list(range(len(ref["losses"]))), "y": [sig(v, 6) for v in ref["losses"]],
        "line": {"color": "#000", "width": 3, "dash": "dash"},
    }]
    seen = {ref["key"]}
    for t in others:
        if t["key"] in seen:
            continue
        seen.add(t["key"])
        n = min(len(t["losses"]), len(ref["losses"]))
        pairs = zip(t["losses"][:n], ref["losses"][:n], strict=True)
        dev = max((abs(a - b) for a, b in pairs if a is not None and b is not None), default=0.0)
        traces.append({
            "type": "scatter", "mode": "lines+markers", "name": f"{layout_label(t['layout'])} (max |Δ| {dev:.2g})",
            "x": list(range(len(t["losses"]))), "y": [sig(v, 6) for v in t["losses"]],
            "customdata": [t["id"]] * len(t["losses"]),
        })
        if len(traces) > limit:
            break
    return {"traces": traces, "reference_id": ref["id"], "note": None}


def chart_bundle(
    trials: Sequence[dict[str, Any]], *, points: Sequence[dict[str, Any]], device_memory: int | None
) -> dict[str, Any]:
    """Everything the sweep page's charts need, in one JSON-ready dict (``points``: measured layouts)."""
    return {
        "summary": summary(trials),
        "pareto": pareto_chart(points, device_memory=device_memory),
        "heatmaps": heatmaps(points),
        "timeline": timeline(trials),
        "stages": stage_bars(trials),
        "losses": loss_curves(trials),
    }


def rank_nodes(nodes: Sequence[str] | None) -> list[dict[str, Any]]:
    """The trial's rank -> node map as one row per node, in order of its first rank: node number,
    short id, its ranks as ranges ("0-1, 4") and their count (empty when none was recorded)."""
    rows: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes or ()):
        rows.setdefault(str(node), []).append(rank)
    out = []
    for i, (node, ranks) in enumerate(rows.items()):
        spans, start = [], ranks[0]
        for a, b in zip(ranks, [*ranks[1:], None], strict=True):
            if b != a + 1:
                spans.append(f"{start}" if start == a else f"{start}-{a}")
                start = b
        out.append({"node": i, "node_id": node[:12], "ranks": ", ".join(spans), "count": len(ranks)})
    return out
