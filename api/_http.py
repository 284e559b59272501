"""HTTP plumbing shared by every route: what a request may cost before any route code runs.

* ``BodyLimit``: a body over ``MAX_BODY_BYTES`` is refused with 413 before it is buffered.
* ``GuardedRoute``: authenticates from the headers before the body is parsed, decodes the JSON body
  itself (422 naming ``body``), validates body models in a worker thread, never on the event loop.
* ``storable_params``: query and path values the stores cannot hold are a 422 naming the parameter.
* ``client_address``: who a request is from, through the proxies in ``MESHTUNE_TRUSTED_PROXIES``.
* ``AllowedMethods``: OPTIONS answers 204; a 405's ``Allow`` lists every method of the path.

The design: docs/api.md#http-plumbing.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.deps import bearer, reader, writer
from api.spec import text_problem

MAX_BODY_BYTES = 1 << 20  # a sweep spec listing 1,000 layouts is ~0.2 MB
MAX_JSON_DEPTH = 32  # the deepest real spec (search.layouts[i].tp) is 4 levels


def client_address(request: Request) -> str:
    """The client's address: the peer's, unless the peer is a trusted proxy; then ``X-Forwarded-For``
    read from the right (each proxy appends the address it was reached from), skipping the trusted
    proxies, up to the first address that is not one (what a client writes to its left is never
    believed). A header that is not a list of addresses is ignored: the peer is the client."""
    peer = request.client.host if request.client else "unknown"
    settings = request.app.state.settings
    if not settings.trusted_proxies or not settings.trusts_proxy(peer):
        return peer
    hops = [h.strip() for value in request.headers.getlist("x-forwarded-for") for h in value.split(",")]
    try:
        hops = [str(ipaddress.ip_address(h)) for h in hops if h]
    except ValueError:
        return peer
    for hop in reversed(hops):
        if not settings.trusts_proxy(hop):
            return hop
    return hops[0] if hops else peer


class BodyTooLarge(HTTPException):
    """413; an HTTPException so that FastAPI's body reader re-raises it instead of making it a 400."""

    def __init__(self, limit: int, size: int | None = None) -> None:
        got = f"of {size:,} bytes " if size is not None else ""
        super().__init__(413, f"body: the request body {got}exceeds the limit of {limit:,} bytes")


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            exc = BodyTooLarge(self.max_bytes, int(declared))
            await _json_response(send, 413, {"detail": exc.detail}, headers=[(b"connection", b"close")])
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # chunked, or a lying Content-Length
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, limited, send)


async def _json_response(send: Send, status: int, content: Any, headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(content).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


def _body_error(kind: str, message: str, loc: tuple[Any, ...] = ("body",), **ctx: Any) -> RequestValidationError:
    return RequestValidationError([{"type": kind, "loc": loc, "msg": message, "ctx": ctx}])


def _depth(data: Any) -> int:
    """Nesting depth of parsed JSON, iteratively (a deep body must not exhaust the stack here either)."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((sub, depth + 1) for sub in (item.values() if isinstance(item, dict) else item))
    return deepest


def parse_json_body(raw: bytes) -> Any:
    """The JSON value of a request body, or a RequestValidationError locating the problem in ``body``."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _body_error("body_not_utf8", f"the body is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset "
                          f"{exc.start}); JSON must be UTF-8 (RFC 8259 section 8.1)") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:  # as FastAPI reports it (api.errors formats the line)
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": exc.msg}}], body=text) from None
    except RecursionError:
        data = None
        depth = MAX_JSON_DEPTH + 1
    else:
        depth = _depth(data)
    if depth > MAX_JSON_DEPTH:
        raise _body_error("json_too_deep", f"the body nests deeper than the limit of {MAX_JSON_DEPTH} levels")
    return data


class _ParsedRequest(Request):
    """A Request whose ``json()`` returns the body parsed (and checked) by ``GuardedRoute``: the
    pattern FastAPI documents for custom request handling (a Request subclass built from the scope)."""

    async def json(self) -> Any:
        if hasattr(self, "parsed"):
            return self.parsed
        return await super().json()


def _is_json(request: Request) -> bool:
    """FastAPI's rule for parsing a body as JSON: application/json or application/*+json."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def _guard_of(dependant: Any) -> Callable[..., Any] | None:
    """``writer`` or ``reader`` when the route depends on it (directly or through a dependency)."""
    found = None
    stack = list(dependant.dependencies)
    while stack:
        dep = stack.pop()
        if dep.call is writer:
            return writer
        if dep.call is reader:
            found = reader
        stack.extend(dep.dependencies)
    return found


def _body_model(route: APIRoute) -> type[BaseModel] | None:
    """The pydantic model of a route's one, not embedded, body parameter (None otherwise)."""
    params = route.dependant.body_params
    if len(params) != 1 or getattr(params[0].field_info, "embed", False):
        return None
    model = params[0].field_info.annotation
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _validated(model: type[BaseModel], data: Any) -> Any:
    """``data`` as ``model`` (run in a worker thread); ``data`` itself when it is invalid: FastAPI then
    reports its errors beside the path's and query's, as without this (what was costly, a workload's
    import, stays done)."""
    try:
        return model.model_validate(data)
    except ValidationError:
        return data


class GuardedRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        guard = _guard_of(self.dependant)

        has_body = self.body_field is not None
        model = _body_model(self) if has_body else None

        async def guarded(request: Request) -> Response:
            request = _ParsedRequest(request.scope, request.receive)
            if guard is not None:  # raises 401/403 (the dependency runs again later; it is cheap)
                await guard(request.app.state.settings, await bearer(request))
            # Parsed here, outside FastAPI's body reader, which would turn these 422s into a bare 400.
            if has_body and _is_json(request) and (raw := await request.body()):
                request.parsed = parse_json_body(raw)
                if model is not None:  # FastAPI takes the model instance as it is (no second validation)
                    request.parsed = await run_in_threadpool(_validated, model, request.parsed)
            return await handler(request)

        return guarded


async def storable_params(request: Request) -> None:
    """App-wide dependency: a query or path value the stores cannot hold is a 422 naming it."""
    for section, items in (("path", request.path_params.items()), ("query", request.query_params.multi_items())):
        for name, value in items:
            if isinstance(value, str) and (why := text_problem(value)) is not None:
                raise RequestValidationError([{"type": "value_unstorable", "loc": (section, name),
                                               "msg": f"{name} {why}", "input": value}])


class AllowedMethods:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["method"] == "OPTIONS":
            allowed = _methods_of_path(scope)
            if allowed:
                await send({"type": "http.response.start", "status": 204, "headers": [(b"allow", allowed)]})
                await send({"type": "http.response.body", "body": b""})
                return

        async def send_allow(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 405:
                allowed = _methods_of_path(scope)
                if allowed:
                    headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"allow"]
                    message = {**message, "headers": [*headers, (b"allow", allowed)]}
            await send(message)

        await self.app(scope, receive, send_allow)


_METHODS = ("DELETE", "GET", "HEAD", "PATCH", "POST", "PUT")


def _methods_of_path(scope: Scope) -> bytes:
    """Every method some route serves on this path, and OPTIONS (answered here); b"" when no route
    has the path, or when it is a mount that takes every method (static files answer for themselves).
    Found by asking each route whether it would take the request under each method (the routing
    protocol, BaseRoute.matches), so nested routers are asked exactly as the router asks them."""
    routes = scope["app"].routes
    methods = {m for m in _METHODS
               if any(route.matches({**scope, "method": m})[0] is Match.FULL for route in routes)}
    if not methods or methods == set(_METHODS):
        return b""
    return ", ".join(sorted(methods | {"OPTIONS"})).encode()
