"""Exception handlers: every user error becomes 401/403/404/409/422 with a message naming the field
and the value; nothing a client sends produces a 500 (a 500 is left for genuine bugs).

Every answer these handlers give (HTTPException's too) passes through ``api.redact.redact``: no
error answer carries a URL's secret or a configured token, whatever the route or validator echoed.

A ``SpecError`` raised by the tuner inside ``SweepSpec``'s model validator reaches FastAPI as a
pydantic error located at the body root; its message starts with the dotted field path
("model.heads=3 does not divide ..."), which is recovered here so the client sees the field.
"""

from __future__ import annotations

import math
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.utils import is_body_allowed_for_status_code
from sqlalchemy import exc as sa_exc
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.auth import ForbiddenError
from api.redact import redact
from api.store import StoreUnavailableError, safe_url
from tuner import BackendError, ConflictError, MeshtuneError, NotFoundError, SpecError

# "model.heads=3 ...", "training.global_batch must ...", "cluster.foo is not ...", "layout.tp ...".
_FIELD_PREFIX = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*|\[\d+\])*)(?==|\s|:)")
_SECTIONS = {"body", "query", "path", "header", "cookie"}
_MISSING = object()


def _lookup(data: Any, path: list[str | int]) -> Any:
    for part in path:
        in_dict = isinstance(data, dict) and part in data
        in_list = isinstance(data, list) and isinstance(part, int) and -len(data) <= part < len(data)
        if in_dict or in_list:
            data = data[part]
        else:
            return _MISSING
    return data


def _clip(value: Any, limit: int = 200) -> Any:
    """Echo a rejected value back, but not a megabyte of it (its secrets are masked with the whole
    answer, ``answer``)."""
    if isinstance(value, str):  # a lone surrogate cannot be encoded into the response: shown escaped
        value = value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, float) and not math.isfinite(value):  # nor can Infinity or NaN (RFC 8259 section 6)
        return str(value)
    if isinstance(value, (str, bytes)) and len(value) > limit:
        return f"{value[:limit]!s}... ({len(value)} characters)"
    if isinstance(value, (dict, list)) and len(repr(value)) > 4 * limit:
        return f"<{type(value).__name__} of {len(value)} items>"
    return value


def _message(err: dict[str, Any]) -> str:
    msg = str(err.get("msg", "invalid value"))
    return msg.removeprefix("Value error, ")


def field_errors(exc: RequestValidationError, body: Any) -> list[dict[str, Any]]:
    out = []
    for err in exc.errors():
        loc = [p for p in err.get("loc", ()) if not isinstance(p, str) or not p.startswith("function-")]
        message = _message(err)
        path = loc[1:] if loc and loc[0] in _SECTIONS else loc
        field = ".".join(str(p) for p in path)
        value = err.get("input", _MISSING)
        kind = str(err.get("type", "value_error"))
        if loc == ["body"] and kind == "value_error":  # raised by SweepSpec's model validator
            match = _FIELD_PREFIX.match(message)
            if match:  # a tuner SpecError: its message names the field inside the spec
                named = match.group(1)
                field = f"{field}.{named}" if field else named
                path = [*path, *(int(p) if p.isdigit() else p for p in re.split(r"[.\[\]]+", named) if p)]
                value = _lookup(body, path)
                kind = "spec"
        if kind == "value_unstorable" and "path" in (err.get("ctx") or {}):  # api.spec.RequestModel
            inner = list(err["ctx"]["path"])
            path = [*path, *inner]
            field = ".".join(str(p) for p in path) or "body"
            loc = [*loc, *inner]
            value = _lookup(body, path)
        if kind == "missing":
            value = _MISSING
        if kind == "json_invalid":  # loc is ('body', character position)
            reason = (err.get("ctx") or {}).get("error", "")
            field, value = "body", _MISSING
            message = f"the body is not valid JSON ({reason} at character {loc[-1]})"
        item: dict[str, Any] = {
            "field": field or (str(loc[0]) if loc else "body"),
            "message": message,
            "type": kind,
            "loc": loc,
        }
        if value is not _MISSING:
            item["value"] = _clip(value)
        out.append(item)
    return out


def detail_line(item: dict[str, Any]) -> str:
    """One field error (an item of ``field_errors``) as the one-line ``detail`` of a 422 response:
    the field, the value and the message. The dashboard's submit form shows the same line."""
    scalar = "value" in item and not isinstance(item["value"], (dict, list))
    if item["message"].startswith(item["field"]):  # a tuner message names the field (and mostly the value)
        if scalar and repr(item["value"]) not in item["message"]:
            return f"{item['message']} (value {item['value']!r})"
        return item["message"]
    if scalar:
        return f"{item['field']}={item['value']!r}: {item['message']}"
    return f"{item['field']}: {item['message']}"


def answer(status_code: int, content: dict[str, Any], headers: dict[str, str] | None = None) -> JSONResponse:
    """An error answer: every one is built here, its text masked (api.redact)."""
    return JSONResponse(status_code=status_code, content=redact(jsonable_encoder(content)), headers=headers)


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = field_errors(exc, exc.body)
    detail = detail_line(errors[0]) if errors else "invalid request"
    return answer(422, {"detail": detail, "errors": errors})


def _plain(status_code: int):
    async def handler(request: Request, exc: Exception) -> JSONResponse:
        return answer(status_code, {"detail": str(exc)})

    return handler


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """FastAPI's own answer to an HTTPException (401, 403, 429, ...), masked like the others."""
    if not is_body_allowed_for_status_code(exc.status_code):
        return Response(status_code=exc.status_code, headers=getattr(exc, "headers", None))  # type: ignore[return-value]
    return answer(exc.status_code, {"detail": exc.detail}, headers=getattr(exc, "headers", None))


async def value_error(request: Request, exc: ValueError) -> JSONResponse:
    """A SpecError (or other ValueError) raised by a service or a tuner builder: 422 naming the field."""
    message = str(exc)
    match = _FIELD_PREFIX.match(message)
    item = {"field": match.group(1) if match else "request", "message": message, "type": "spec", "loc": []}
    return answer(422, {"detail": message, "errors": [item]})


async def database_unavailable(request: Request, exc: sa_exc.DBAPIError) -> JSONResponse:
    """The database went away or is locked: 503 naming the URL (password hidden), retry later."""
    url = request.app.state.engine.url
    reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
    if url.password:
        reason = reason.replace(str(url.password), "***")
    detail = f"the database at {safe_url(url)} is unavailable: {reason}"
    return answer(503, {"detail": detail}, headers={"Retry-After": "5"})


def install(app: FastAPI) -> None:
    """Register the handlers; the most specific class wins (Starlette walks the MRO)."""
    app.add_exception_handler(RequestValidationError, validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(NotFoundError, _plain(404))
    app.add_exception_handler(ConflictError, _plain(409))
    app.add_exception_handler(ForbiddenError, _plain(403))  # a role's limit (api/auth.py)
    app.add_exception_handler(StoreUnavailableError, _plain(503))
    app.add_exception_handler(sa_exc.OperationalError, database_unavailable)  # type: ignore[arg-type]
    app.add_exception_handler(sa_exc.InterfaceError, database_unavailable)  # type: ignore[arg-type]
    app.add_exception_handler(BackendError, _plain(503))
    app.add_exception_handler(SpecError, value_error)  # type: ignore[arg-type]  # before MeshtuneError in the MRO
    app.add_exception_handler(ValueError, value_error)  # type: ignore[arg-type]
    app.add_exception_handler(MeshtuneError, _plain(400))
