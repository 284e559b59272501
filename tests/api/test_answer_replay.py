"""api/_answers.py: unchanged read answers are replayed before the framework runs, never stale, never
to a caller the app would refuse; concurrent callers share one version read. Unit tests on a small
Starlette app (the route counts its calls), then the coordinator's ranking and sweep page."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from fastapi.testclient import TestClient
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from api import store
from api._answers import AnswerReplay, remember
from tests.helpers.dashboard_seed import add_running_trial, seed_sweep


class Versioned:
    """A resource whose answer is ``body-<version>``; the probe can be held (``hold``) once it has read."""

    def __init__(self) -> None:
        self.version, self.calls, self.probes = 1, 0, 0
        self.hold: threading.Event | None = None
        self.probing = threading.Event()
        self.fail = False

    def probe(self) -> int:
        self.probes += 1
        if self.fail:
            raise LookupError("gone")
        seen = self.version
        self.probing.set()
        if self.hold is not None:
            self.hold.wait(30)
        return seen

    async def route(self, request: Request) -> Response:
        self.calls += 1
        if request.headers.get("authorization") == "Bearer bad":
            remember(request, probe_key="r", probe=self.probe, version=self.version)  # marked, but refused
            return Response(b"no", status_code=403)
        remember(request, probe_key="r", probe=self.probe, version=self.version)
        return Response(f"body-{self.version}".encode(), headers={"ETag": f'"v{self.version}"', "Vary": "Accept"})


def _replay_of(app) -> AnswerReplay:  # noqa: ANN001
    """The AnswerReplay in a built app's middleware stack (its answers say which routes remembered)."""
    layer = app.middleware_stack
    while not isinstance(layer, AnswerReplay):
        layer = layer.app
    return layer


def _client(res: Versioned) -> httpx.AsyncClient:
    app = AnswerReplay(Starlette(routes=[Route("/r", res.route)]))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")


def test_replays_until_the_version_changes_and_answers_304():
    res = Versioned()

    async def run() -> None:
        async with _client(res) as c:
            first = await c.get("/r")
            again = await c.get("/r")
            assert first.text == again.text == "body-1" and res.calls == 1  # the second never reached the app
            assert again.headers["etag"] == '"v1"' and again.headers["vary"] == "Accept"
            cached = await c.get("/r", headers={"If-None-Match": 'W/"v1"'})
            assert cached.status_code == 304 and cached.content == b"" and cached.headers["etag"] == '"v1"'
            assert res.calls == 1
            res.version = 2  # a result landed
            fresh = await c.get("/r")
            assert fresh.text == "body-2" and res.calls == 2
            assert (await c.get("/r", headers={"If-None-Match": '"v1"'})).status_code == 200  # old tag: full answer
            assert (await c.get("/r?x=1")).text == "body-2" and res.calls == 3  # another query: the app's

    asyncio.run(run())


def test_never_replays_to_another_caller_or_a_refused_answer():
    res = Versioned()

    async def run() -> None:
        async with _client(res) as c:
            assert (await c.get("/r", headers={"Authorization": "Bearer good"})).status_code == 200
            assert (await c.get("/r")).status_code == 200 and res.calls == 2  # no header: the app decides
            for _ in range(2):  # a 403 is never kept
                assert (await c.get("/r", headers={"Authorization": "Bearer bad"})).status_code == 403
            assert res.calls == 4
            assert (await c.get("/r", headers={"Authorization": "Bearer good"})).text == "body-1" and res.calls == 4
            res.fail = True  # e.g. the sweep was deleted: the app answers (its 404)
            assert (await c.get("/r", headers={"Authorization": "Bearer good"})).status_code == 200
            assert res.calls == 5

    asyncio.run(run())


def test_callers_share_a_probe_that_started_after_they_arrived():
    """A probe reads version 1 and is held; the version then moves to 2 and 20 callers arrive. The
    first caller (there before the change) may be answered from version 1; the 20 must not be: they
    wait for the next probe, one for all of them, which sees version 2."""
    res = Versioned()

    async def run() -> None:
        async with _client(res) as c:
            await c.get("/r")  # kept under version 1
            res.hold, res.probes = threading.Event(), 0
            res.probing.clear()
            early = asyncio.create_task(c.get("/r"))
            await asyncio.to_thread(res.probing.wait, 30)  # probe 1 has read version 1
            res.version = 2
            late = [asyncio.create_task(c.get("/r")) for _ in range(20)]
            await asyncio.sleep(0)  # let them all arrive and queue behind probe 1
            res.hold.set()
            assert (await early).text == "body-1"
            bodies = {(await t).text for t in late}
            assert bodies == {"body-2"}
            assert res.probes == 2, res.probes  # 21 callers, two reads

    asyncio.run(run())


@pytest.mark.parametrize("db", ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def test_coordinator_ranking_and_page_are_replayed_but_never_stale(tmp_path, db, request):
    from api.main import create_app
    from api.settings import Settings

    url = f"sqlite:///{tmp_path / 'a.db'}" if db == "sqlite" else request.getfixturevalue("fresh_pg_url")
    engine, sessions = store.open_store(url)
    sid = seed_sweep(sessions, n_trials=12, name="replay")
    settings = Settings(database_url=url, api_tokens="alice:ta,viewer:tv", api_roles="viewer:read-only",
                        read_requires_auth=True, scheduler_enabled=False)
    app = create_app(settings, run_engine=False)
    alice = {"Authorization": "Bearer ta"}
    try:
        with TestClient(app) as client:
            top = f"/api/sweeps/{sid}/ranking?limit=3"
            first = client.get(top, headers=alice)
            assert first.status_code == 200
            assert client.get(top, headers=alice).content == first.content
            assert client.get(top).status_code == 401  # the kept answer is alice's, not anyone's
            assert client.get(top, headers={"Authorization": "Bearer nope"}).status_code == 403
            etag = first.headers["etag"]
            assert client.get(top, headers=alice | {"If-None-Match": etag}).status_code == 304
            page = client.get(f"/sweeps/{sid}", headers=alice)
            assert page.status_code == 200 and client.get(f"/sweeps/{sid}", headers=alice).content == page.content
            kept = {key[1] for key in _replay_of(app)._answers}  # what the coordinator's replay holds
            assert {f"/api/sweeps/{sid}/ranking", f"/sweeps/{sid}"} <= kept
            anonymous = client.get(f"/sweeps/{sid}")  # the sign-in page, not alice's kept page
            assert anonymous.content != page.content and "login" in anonymous.text.lower()

            add_running_trial(sessions, sweep_id=sid, tokens=1e9, peak=2**30)  # another writer's result
            fresh = client.get(top, headers=alice | {"If-None-Match": etag})
            assert fresh.status_code == 200 and fresh.json()["rows"][0]["tokens_per_s_per_device"] == 1e9
            assert fresh.json()["total"] == first.json()["total"] + 1
            assert client.get(f"/sweeps/{sid}", headers=alice).content != page.content
    finally:
        engine.dispose()
