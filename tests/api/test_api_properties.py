"""Property-based test of the whole HTTP API: schemathesis generates requests from the app's own
OpenAPI document (valid ones and invalid ones, with and without a bearer token), sends them in
process (ASGI transport, no server) and checks every answer: never a 5xx, a documented status code
and content type, and a body that matches the documented schema. Once on SQLite and once on
PostgreSQL (whose text types refuse NUL and whose ids are 32-bit). Every
paged operation is also called with its ``limit`` and ``offset`` at each bound the document states and
one past it (``_paging_at_bounds``): in bounds 200, beyond 422 naming the parameter, on both stores
(an offset of 2^31 - 1 beside a limit was a 500 on PostgreSQL).

The sweep engine does not run (``run_engine=False``): generated sweeps stay queued, and reshard
checks go to a stub runner, so a generated request can never start real work. Generation is
derandomised (the same cases every run, so CI is reproducible); raise ``EXAMPLES`` locally to search
further.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from api import store
from api.main import create_app
from api.settings import Settings
from tests.helpers.dashboard_seed import StubReshardRunner, seed_sweep

TOKEN = "tok-prop-3f9a1c"
EXAMPLES = 600  # generated requests per store (the issue asks for >= 500)


def _app(url: str, home: Path):
    app = create_app(Settings(home=home, database_url=url, api_tokens={"prop": TOKEN}, read_requires_auth=False,
                              ray_address=None), run_engine=False)
    app.state.reshard_runner = StubReshardRunner()
    return app


def _anchored(schema, *, sweep_id: int, schedule_id: int) -> list:
    """Cases with some parameters pinned to things that exist (the seeded sweep and schedule, real
    presets), the rest generated: random ids and names mostly reach a 404 or 422, these reach the
    code behind them (rankings of a real sweep, plans, schedule changes)."""
    pinned = {"sweep_id": sweep_id, "schedule_id": schedule_id}
    out = []
    for result in schema.get_all_operations():
        operation = result.ok()
        names = {p.name for p in operation.path_parameters}
        if names:
            out.append(operation.as_strategy(path_parameters={k: v for k, v in pinned.items() if k in names}))
        elif operation.path == "/api/plan":
            out.append(operation.as_strategy(query={"model": "tiny", "cluster": "cpu-local", "global_batch": 16}))
        elif operation.path == "/api/trends":
            out.append(operation.as_strategy(query={"schedule_id": schedule_id}))
    return out


SPEC = {"model": "tiny", "cluster": "cpu-local", "training": {"global_batch": 16}, "backend": "simulate",
        "search": {"max_trials": 2}}
# Text as a careless or hostile client sends it: any code point, NUL much more often than by chance.
TEXT = st.text(st.one_of(st.characters(), st.just("\x00")), min_size=1, max_size=12)


def _stored_text(schema, *, sweep_id: int) -> list:
    """Cases whose generated text reaches the store: the names of otherwise valid sweeps and
    schedules, and the text filters of the list routes (PostgreSQL refuses NUL in text)."""
    def op(method: str, path: str):
        return schema[path][method]

    schedule = {"cron": "0 3 * * *", "remeasure": {"sweep_id": sweep_id, "top_k": 1, "repeats": 2}}
    return [
        TEXT.flatmap(lambda n: op("POST", "/api/sweeps").as_strategy(body={**SPEC, "name": n})),
        TEXT.flatmap(lambda n: op("POST", "/api/schedules").as_strategy(body={**schedule, "name": n})),
        TEXT.flatmap(lambda n: op("GET", "/api/sweeps").as_strategy(query={"owner": n})),
        TEXT.flatmap(lambda n: op("GET", "/api/alerts").as_strategy(query={"layout": n})),
        TEXT.flatmap(lambda n: op("GET", "/api/trends").as_strategy(query={"schedule_id": 1, "layout": n})),
    ]


def _bounds(document: dict, path: str, method: str) -> dict[str, tuple[int, int]]:
    """The documented (minimum, maximum) of an operation's ``limit`` and ``offset`` query parameters."""
    out = {}
    for param in document["paths"][path][method.lower()].get("parameters", []):
        if param["in"] == "query" and param["name"] in ("limit", "offset"):
            schema = param["schema"]
            schema = next((s for s in schema.get("anyOf", [schema]) if s.get("type") == "integer"), schema)
            out[param["name"]] = (schema["minimum"], schema["maximum"])
    return out


def _paging_at_bounds(schema, document: dict, *, pinned: dict[str, int], headers: dict[str, str]) -> int:
    """Each paged operation with limit and offset at their bounds and one past them; returns the calls."""
    calls = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        bounds = _bounds(document, operation.path, operation.method)
        if not bounds:
            continue
        path_parameters = {p.name: pinned[p.name] for p in operation.path_parameters}
        for name, (low, high) in bounds.items():
            other = {k: v[0] for k, v in bounds.items() if k != name}  # the other parameter at its minimum
            for value, ok in ((low, True), (high, True), (low - 1, False), (high + 1, False)):
                case = operation.Case(query={**other, name: value}, path_parameters=path_parameters)
                response = case.call(headers=headers)
                where = f"{operation.method} {operation.path}?{name}={value}"
                assert response.status_code == (200 if ok else 422), (where, response.status_code, response.text[:300])
                if not ok:
                    assert response.json()["errors"][0]["field"] == name, where
                case.validate_response(response, checks=[not_a_server_error, status_code_conformance,
                                                         response_schema_conformance], headers=headers)
                calls += 1
        if {"limit", "offset"} <= bounds.keys():  # both at their maximum: the sum overflowed INTEGER
            case = operation.Case(query={"limit": bounds["limit"][1], "offset": bounds["offset"][1]},
                                  path_parameters=path_parameters)
            assert case.call(headers=headers).status_code == 200, operation.path
            calls += 1
    return calls


def _run(url: str, home: Path) -> int:
    store.upgrade(url)
    engine, sessions = store.open_store(url)
    try:
        sid = seed_sweep(sessions, n_trials=12, name="property sweep")  # something to read and rank
    finally:
        engine.dispose()
    app = _app(url, home)
    with TestClient(app) as client:  # the lifespan opens the store; schemathesis calls the same app
        schedule = {"name": "nightly", "cron": "0 2 * * *", "remeasure": {"sweep_id": sid, "top_k": 1, "repeats": 2}}
        assert client.post("/api/schedules", json=schedule, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 201
        schema = schemathesis.openapi.from_asgi("/openapi.json", app)
        schedule_id = client.get("/api/schedules").json()["items"][0]["id"]
        paged = _paging_at_bounds(schema, app.openapi(), pinned={"sweep_id": sid, "schedule_id": schedule_id},
                                  headers={"Authorization": f"Bearer {TOKEN}"})
        assert paged >= 6 * 4 * 2, paged  # sweeps, trials, ranking, schedules, fires, alerts: limit and offset
        cases = st.one_of(schema.as_strategy(GenerationMode.POSITIVE), schema.as_strategy(GenerationMode.NEGATIVE),
                          *_anchored(schema, sweep_id=sid, schedule_id=schedule_id),
                          *_stored_text(schema, sweep_id=sid))
        seen: list[tuple[str, str, int]] = []

        @given(case=cases, authenticated=st.booleans())
        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        def generated(case, authenticated: bool) -> None:
            headers = {"Authorization": f"Bearer {TOKEN}"} if authenticated else {}
            response = case.call(headers=headers)
            seen.append((case.method, case.path, response.status_code))
            case.validate_response(response, checks=[
                not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
            ], headers=headers)

        generated()
    assert all(code < 500 for *_, code in seen)
    operations = {(m, p) for m, p, _ in seen}
    assert len(operations) >= 15, sorted(operations)  # every part of the API was reached
    return len(seen)


def test_generated_requests_on_sqlite_get_no_5xx(tmp_path: Path) -> None:
    assert _run(f"sqlite:///{tmp_path / 'prop.db'}", tmp_path) >= 500


@pytest.mark.postgres
def test_generated_requests_on_postgresql_get_no_5xx(fresh_pg_url: str, tmp_path: Path) -> None:
    assert _run(fresh_pg_url, tmp_path) >= 500
