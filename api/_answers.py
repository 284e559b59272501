"""Replaying read answers that have not changed, before the framework runs.

A read route whose answer is a pure function of a stored version calls :func:`remember` with that
version and a probe that reads it again; :class:`AnswerReplay`, an ASGI middleware, then answers a
later request with the same key from the kept bytes (or 304) while a probe started after the request
arrived finds the version unchanged: never stale, probes coalesced, only 200 answers kept.

The design (why, the invariants, the numbers): docs/api.md#answers-replay.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.routes._cache import etag_matches

STATE_KEY = "meshtune.answer"  # where remember() leaves (probe key, probe, version) in the request's state
KEY_HEADERS = (b"authorization", b"cookie", b"accept", b"accept-encoding")  # what can change an answer
REVALIDATION_HEADERS = (b"etag", b"cache-control", b"vary")  # a 304 carries these (RFC 9110 section 15.4.5)
MAX_BYTES = 256 << 20  # kept answers in all (the whole 10,000-trial ranking is 2.6 MB)


def remember(request: Any, *, probe_key: Hashable, probe: Callable[[], Hashable], version: Hashable) -> None:
    """Mark this request's answer as replayable while ``probe()`` returns ``version``. ``probe_key``
    names the probe (answers sharing it share its reads: the ranking's pages, CSV and JSON)."""
    request.scope.setdefault("state", {})[STATE_KEY] = (probe_key, probe, version)


@dataclass(frozen=True)
class _Answer:
    probe_key: Hashable
    version: Hashable
    start: Message
    body: bytes
    etag: str | None
    revalidation: list[tuple[bytes, bytes]]


class _Probe:
    """The current version behind ``probe_key``, read by a probe that starts after each caller arrived;
    callers arriving while a read runs share the next read."""

    def __init__(self, probe: Callable[[], Hashable]) -> None:
        self.probe = probe
        self._next: asyncio.Future[Hashable] | None = None
        self._running = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None

    async def current(self) -> Hashable:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # an app served by a new loop (a test's second client): start afresh
            self._loop, self._next, self._running = loop, None, False
        if self._next is None:
            self._next = loop.create_future()
        waiting = self._next
        if not self._running:
            self._running = True
            self._task = loop.create_task(self._drain())  # held: the loop keeps only weak references to tasks
        return await asyncio.shield(waiting)

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._next is not None:
                waiting, self._next = self._next, None  # later callers wait for a read starting after this one
                try:
                    version = await loop.run_in_executor(None, self.probe)
                except Exception as exc:  # noqa: BLE001 - the app answers (and reports) for itself
                    waiting.set_exception(exc)
                    waiting.exception()  # retrieved: no "never retrieved" warning when all callers left
                else:
                    waiting.set_result(version)
        finally:
            self._running = False


class AnswerReplay:
    def __init__(self, app: ASGIApp, max_bytes: int = MAX_BYTES) -> None:
        self.app, self.max_bytes = app, max_bytes
        self._answers: OrderedDict[tuple, _Answer] = OrderedDict()
        self._probes: dict[Hashable, _Probe] = {}
        self._bytes = 0  # all three are touched on the event loop only: no lock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "GET":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        key = (scope.get("root_path", ""), scope["path"], scope["query_string"],
               *(b"\n".join(v for k, v in headers if k == name) for name in KEY_HEADERS))
        answer = self._answers.get(key)
        if answer is not None and await self._still(answer):
            if key in self._answers:  # still kept (a concurrent answer may have replaced or dropped it)
                self._answers.move_to_end(key)
            await self._replay(answer, headers, send)
            return
        await self._answer_and_keep(key, scope, receive, send)

    async def _still(self, answer: _Answer) -> bool:
        probe = self._probes.get(answer.probe_key)
        if probe is None:
            return False
        try:
            return await probe.current() == answer.version
        except Exception:  # noqa: BLE001 - e.g. the sweep was deleted: the app says 404
            return False

    async def _replay(self, answer: _Answer, headers: list[tuple[bytes, bytes]], send: Send) -> None:
        if answer.etag is not None:
            if_none_match = b", ".join(v for k, v in headers if k == b"if-none-match").decode("latin-1")
            if etag_matches(if_none_match, answer.etag.removeprefix("W/")):
                await send({"type": "http.response.start", "status": 304, "headers": answer.revalidation})
                await send({"type": "http.response.body", "body": b""})
                return
        await send(answer.start)
        await send({"type": "http.response.body", "body": answer.body})

    async def _answer_and_keep(self, key: tuple, scope: Scope, receive: Receive, send: Send) -> None:
        start: Message | None = None
        chunks: list[bytes] = []
        complete = False

        async def capture(message: Message) -> None:
            nonlocal start, complete
            if message["type"] == "http.response.start":
                start = message
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                complete = not message.get("more_body", False)
            await send(message)

        await self.app(scope, receive, capture)
        marked = scope.get("state", {}).get(STATE_KEY)
        if marked is None or start is None or start["status"] != 200 or not complete:
            return
        probe_key, probe, version = marked
        body = b"".join(chunks)
        if len(body) > self.max_bytes // 8:
            return
        fields = dict(start.get("headers", []))
        etag = fields.get(b"etag", b"").decode("latin-1") or None
        revalidation = [(k, v) for k, v in start.get("headers", []) if k in REVALIDATION_HEADERS]
        answer = _Answer(probe_key, version, start, body, etag, revalidation)
        self._probes.setdefault(probe_key, _Probe(probe))
        old = self._answers.pop(key, None)
        self._bytes += len(body) - (len(old.body) if old else 0)
        self._answers[key] = answer
        while self._bytes > self.max_bytes:
            _, dropped = self._answers.popitem(last=False)
            self._bytes -= len(dropped.body)
        live = {a.probe_key for a in self._answers.values()}  # drop the probes no kept answer uses
        for gone in [k for k in self._probes if k not in live]:
            del self._probes[gone]
