"""Dashboard pages for scheduled sweeps (server-rendered, Plotly served by the coordinator).

    GET /schedules                       schedules with their next fire and latest alerts
    GET /schedules/{id}/trends           best tokens/s per run per layout (regressions marked), the
                                         runs (missed/coalesced included) and the alerts
    GET /schedules/{id}/trends.json      the chart's data (api.schedules.service.trends)

Reads follow the dashboard's rule (``api.dashboard.router``: a token only when reads need one); the
templates, filters and login page are the dashboard's own.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import HTMLResponse, JSONResponse

from api import format as fmt
from api.dashboard.router import _can_read, _login, _not_found, templates
from api.deps import ScheduleId, SessionDep, SettingsDep
from api.schedules import service
from api.schedules.schemas import AlertOut, FireOut
from tuner import NotFoundError

router = APIRouter(include_in_schema=False)

MARKERS = {"regression": ("triangle-down", "#c62828"), "improvement": ("triangle-up", "#2e7d32")}


def chart(trend: dict[str, Any]) -> dict[str, Any]:
    """Plotly traces: one line per layout (best tokens/s per run), plus one marker trace per
    verdict kind at the runs where the layout was flagged."""
    traces: list[dict[str, Any]] = []
    for key in trend["layouts"]:
        pts = [p for p in trend["points"] if p["layout_key"] == key]
        traces.append({
            "type": "scatter", "mode": "lines+markers", "name": fmt.key_text(key),
            "x": [p["fire_time"].isoformat() for p in pts], "y": [p["best_tokens_per_s"] for p in pts],
            "customdata": [[p["median_tokens_per_s"], p["n"], p["verdict"] or "-"] for p in pts],
            "hovertemplate": "%{x}<br>best %{y:,.4g} tok/s<br>median %{customdata[0]:,.4g} (n=%{customdata[1]})"
                             "<br>%{customdata[2]}<extra>" + fmt.key_text(key) + "</extra>",
        })
    for verdict, (symbol, color) in MARKERS.items():
        pts = [p for p in trend["points"] if p["verdict"] == verdict]
        if pts:
            traces.append({
                "type": "scatter", "mode": "markers", "name": verdict,
                "x": [p["fire_time"].isoformat() for p in pts], "y": [p["best_tokens_per_s"] for p in pts],
                "text": [fmt.key_text(p["layout_key"]) for p in pts],
                "marker": {"symbol": symbol, "size": 16, "color": color, "line": {"width": 1, "color": "#000"}},
                "hovertemplate": verdict + ": %{text}<extra></extra>",
            })
    return {"traces": traces, "simulated": any(p["simulated"] for p in trend["points"])}


@router.get("/schedules", name="dashboard_schedules")
def schedules_page(request: Request, session: SessionDep, settings: SettingsDep) -> HTMLResponse:
    if not _can_read(request, settings):
        return _login(request)
    rows, total = service.list_schedules(session, limit=1000)
    alerts, _ = service.list_alerts(session, limit=20)
    ctx = {
        "schedules": [service.describe(r) for r in rows], "total": total,
        "alerts": [AlertOut.model_validate(a) for a in alerts],
    }
    return templates.TemplateResponse(request, "schedules.html", ctx)


@router.get("/schedules/{schedule_id}/trends", name="dashboard_trends")
def trends_page(request: Request, schedule_id: ScheduleId, session: SessionDep, settings: SettingsDep,
                runs: int = 30) -> HTMLResponse:
    if not _can_read(request, settings):
        return _login(request)
    runs = min(max(runs, 1), 1000)
    try:
        schedule = service.describe(service.get_schedule(session, schedule_id=schedule_id))
        trend = service.trends(session, schedule_id=schedule_id, runs=runs)
        fires, _ = service.list_fires(session, schedule_id=schedule_id, limit=50)
        alerts, _ = service.list_alerts(session, schedule_id=schedule_id, limit=100)
    except NotFoundError as exc:
        return _not_found(request, str(exc))
    ctx = {
        "schedule": schedule, "chart": jsonable_encoder(chart(trend)), "runs": runs,
        "n_points": len(trend["points"]), "layouts": trend["layouts"],
        "fires": [FireOut.model_validate(f) for f in fires],
        "alerts": [AlertOut.model_validate(a) for a in alerts],
    }
    return templates.TemplateResponse(request, "trends.html", ctx)


@router.get("/schedules/{schedule_id}/trends.json", name="dashboard_trends_data")
def trends_data(request: Request, schedule_id: ScheduleId, session: SessionDep, settings: SettingsDep,
                runs: int = 30) -> JSONResponse:
    if not _can_read(request, settings):
        return JSONResponse({"detail": "this coordinator needs a token to read"}, status_code=401)
    try:
        trend = service.trends(session, schedule_id=schedule_id, runs=min(max(runs, 1), 1000))
    except NotFoundError as exc:
        return JSONResponse({"detail": str(exc)}, status_code=404)
    return JSONResponse(jsonable_encoder(chart(trend)), headers={"Cache-Control": "no-store"})
