"""Property-based test of the whole HTTP API: schemathesis generates requests from the app's own
OpenAPI document (valid ones and invalid ones, with and without a bearer token), sends them in
process (ASGI transport, no server) and checks every answer: never a 5xx, a documented status code
and content type, and a body that matches the documented schema. Once on SQLite and once on
PostgreSQL (whose text types refuse NUL and whose ids are 32-bit: issue 11 items 5 and 6).

The sweep engine does not run (``run_engine=False``): generated sweeps stay queued, and reshard
checks go to a stub runner, so a generated request can never start real work. Generation is
derandomised (the same cases every run, so CI is reproducible); raise ``EXAMPLES`` locally to search
further.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import schemathesis
from _dashboard_seed import StubReshardRunner, seed_sweep
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
        cases = st.one_of(schema.as_strategy(GenerationMode.POSITIVE), schema.as_strategy(GenerationMode.NEGATIVE),
                          *_anchored(schema, sweep_id=sid, schedule_id=client.get("/api/schedules").json()["items"][0]["id"]),
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
