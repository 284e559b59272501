"""The sweep page's confirm card and its action.

    POST /sweeps/{id}/confirm      form: top_k, steps (and token when tokens are configured): ask a
                                   confirm round (api.confirm.service, as POST /api/sweeps/{id}/confirm
                                   does), then back to the sweep page (303); a refusal is one line
                                   naming the field and value, with the API's status code

``card`` is what the tables fragment (templates/_confirm.html) shows: the latest round's report, and
whether (and with which defaults) the form is offered. Only the sweep's owner or an admin may ask
(the service's owner rule); a read-only viewer is not shown the form (``can_write``).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from starlette.concurrency import run_in_threadpool

from api import format as fmt
from api import store
from api.auth import ANONYMOUS, ForbiddenError, Principal, match_token
from api.confirm import service
from api.dashboard.router import COOKIE, templates
from api.deps import SessionDep, SettingsDep, SweepId
from api.engine._confirm import default_steps
from api.settings import Settings
from tuner import ConflictError, NotFoundError, SpecError

router = APIRouter(include_in_schema=False)
DEFAULT_TOP = 5


class _NoToken(Exception):
    """No token with the form nor signed in, where tokens are configured (401)."""


def card(session: Any, *, sweep: dict[str, Any]) -> dict[str, Any]:
    """The confirm card's context (``sweep``: the page's header): the report (None before any round),
    its rows formatted, and the form's offer (only on a completed sweep with ranked layouts)."""
    sweep_id = sweep["id"]
    row = store.get_sweep(session, sweep_id=sweep_id)
    spec = row.spec if row is not None else None
    report = service.confirm_report(session, sweep_id=sweep_id)
    state = store.ranking_state(session, sweep_id=sweep_id)
    ranked = int((((state.summary if state else None) or {}).get("tokens_per_s_per_device") or {}).get("total", 0))
    measure = int(((spec or {}).get("trial") or {}).get("measure_steps") or 3)
    rows = []
    for r in report.rows if report else []:
        d = r.drift or {}
        rows.append({
            "row": r, "label": fmt.layout_text(r.layout),
            "drift_text": "—" if not d else (
                f"{fmt.signed_pct(d['change'])}" + ("" if d.get("low") is None else
                                                    f" [{fmt.signed_pct(d['low'])}, {fmt.signed_pct(d['high'])}]")),
            "drifted": bool(d.get("drifted")),
        })
    return {"report": report, "rows": rows, "ranked": ranked,
            "can_request": sweep["status"] == "completed" and ranked > 0,
            "default_top": max(1, min(DEFAULT_TOP, ranked)), "default_steps": default_steps(measure)}


def _refused(request: Request, sweep_id: int, message: str, status_code: int) -> HTMLResponse:
    return templates.TemplateResponse(request, "refused.html", {"message": message, "sweep_id": sweep_id},
                                      status_code=status_code)


def _whole(name: str, raw: str | None) -> int | None:
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw.strip())
    except ValueError:
        raise SpecError(f"{name}={raw!r} must be a whole number") from None


@router.post("/sweeps/{sweep_id}/confirm", name="dashboard_confirm")
async def confirm(request: Request, sweep_id: SweepId, session: SessionDep, settings: SettingsDep) -> Response:
    raw = {k: str(v) for k, v in (await request.form()).items()}
    return await run_in_threadpool(_confirm, request, sweep_id, session, settings, raw)


def _actor(request: Request, settings: Settings, raw: dict[str, str]) -> Principal:
    """Who asks: the form's token, else the signed-in cookie's (the API's rule: a valid token, its
    name and role; no tokens configured: the one user, an admin)."""
    if not settings.api_tokens:
        return Principal(ANONYMOUS, authenticated=False, role="admin")
    token = raw.get("token") or request.cookies.get(COOKIE) or ""
    if not token:
        raise _NoToken("token: missing — this coordinator needs a token to confirm")
    name = match_token(token, settings.api_tokens)
    if name is None:
        raise ForbiddenError("token: not a valid token")
    return Principal(name, authenticated=True, role=settings.role_of(name))


def _confirm(request: Request, sweep_id: int, session: Any, settings: Settings, raw: dict[str, str]) -> Response:
    try:
        actor = _actor(request, settings, raw)
        top_k = _whole("top_k", raw.get("top_k"))
        steps = _whole("steps", raw.get("steps"))
        service.request_confirm(session, sweep_id=sweep_id, top_k=DEFAULT_TOP if top_k is None else top_k,
                                steps=steps, actor=actor)
    except _NoToken as exc:
        return _refused(request, sweep_id, str(exc), 401)
    except ForbiddenError as exc:
        return _refused(request, sweep_id, str(exc), 403)
    except NotFoundError as exc:
        return _refused(request, sweep_id, str(exc), 404)
    except ConflictError as exc:
        return _refused(request, sweep_id, str(exc), 409)
    except ValueError as exc:  # SpecError: the field and the value
        return _refused(request, sweep_id, str(exc), 422)
    return RedirectResponse(request.url_for("dashboard_sweep", sweep_id=sweep_id).path + "#confirm-card",
                            status_code=303)
