"""The HTTP API under input a careless or hostile client sends: text and numbers the
stores cannot hold, ids beyond 32 bits, oversized and undecodable bodies, callers refused before
their body is read, planning work bounded before it starts and charged to anonymous clients, the
Allow header, strict request types, and docs pages that need no CDN. Both stores where they differ."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from api import store
from api.main import create_app
from api.settings import Settings
from tests.helpers.api_client import ALICE, SIMULATED, TINY, TOKENS, WRONG, client_for


@pytest.fixture(scope="module")
def pg_api(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """The API on the session's PostgreSQL database (text refuses NUL there; ids are 32-bit)."""
    store.upgrade(pg_url)
    settings = Settings(home=tmp_path_factory.mktemp("pg-home"), database_url=pg_url, api_tokens=TOKENS,
                        read_requires_auth=False, ray_address=None)
    with TestClient(create_app(settings, run_engine=False), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def any_store(request: pytest.FixtureRequest) -> TestClient:
    return request.getfixturevalue("client" if request.param == "sqlite" else "pg_api")


def _first_error(r) -> dict:  # noqa: ANN001
    assert r.status_code == 422, (r.status_code, r.text)
    return r.json()["errors"][0]


def test_text_the_store_cannot_hold_is_422_naming_the_field(any_store: TestClient) -> None:
    c = any_store
    before = c.get("/api/sweeps").json()["total"]
    nul = {**SIMULATED, "name": "a\x00b"}
    err = _first_error(c.post("/api/sweeps", json=nul, headers=ALICE))
    assert err["field"] == "name" and "NUL" in err["message"] and err["value"] == "a\x00b"
    layouts = {**TINY, "backend": "simulate", "search": {"layouts": [{"tp": 2, "schedule": "1f\x001b"}]}}
    assert _first_error(c.post("/api/sweeps", json=layouts, headers=ALICE))["field"] == "search.layouts.0.schedule"
    keyed = {**TINY, "training": {"global_batch": 16, "pre\x00cision": "fp32"}}
    assert _first_error(c.post("/api/sweeps", json=keyed, headers=ALICE))["field"] == "training"
    surrogate = json.dumps({**SIMULATED, "name": "\ud800"}).encode()  # JSON's escape of a lone surrogate
    r = c.post("/api/sweeps", content=surrogate, headers={**ALICE, "content-type": "application/json"})
    assert _first_error(r)["field"] == "name" and "surrogate" in r.json()["detail"]
    for raw, field in ((b'"search": {"max_device_seconds": Infinity}', "search.max_device_seconds"),
                       (b'"trial": {"step_timeout_s": 1e999}', "trial.step_timeout_s"),  # json.loads: inf
                       (b'"trial": {"options": {"sleep_per_step_s": NaN}}', "trial.options.sleep_per_step_s")):
        body = json.dumps(SIMULATED).encode()[:-1] + b", " + raw + b"}"
        r = c.post("/api/sweeps", content=body, headers={**ALICE, "content-type": "application/json"})
        assert _first_error(r)["field"] == field and "not a finite number" in r.json()["detail"], r.text
    seed = {**SIMULATED, "search": {**SIMULATED["search"], "seed": 2**64}}  # numpy seeds are 32-bit
    assert _first_error(c.post("/api/sweeps", json=seed, headers=ALICE))["field"] == "search.seed"
    schedule = {"name": "n\x00", "cron": "0 2 * * *", "remeasure": {"sweep_id": 1}}
    assert _first_error(c.post("/api/schedules", json=schedule, headers=ALICE))["field"] == "name"
    for url, field in (("/api/sweeps?owner=a%00b", "owner"), ("/api/alerts?layout=a%00b", "layout"),
                       ("/api/trends?schedule_id=1&layout=%00", "layout")):  # unauthenticated reads
        r = c.get(url)
        assert _first_error(r)["field"] == field and "NUL" in r.json()["detail"], url
    assert c.get("/api/sweeps").json()["total"] == before  # nothing stored


def _route_table(app) -> list[tuple[str, set[str]]]:  # noqa: ANN001
    """(path, methods) of every route, through included routers (FastAPI >= 0.16x keeps an included
    router as one entry of ``app.routes`` whose effective routes carry the full path)."""
    out = []
    for route in app.routes:
        for ctx in route.effective_route_contexts() if hasattr(route, "effective_route_contexts") else [route]:
            original = getattr(ctx, "original_route", ctx)
            path, methods = getattr(ctx, "path", "") or getattr(original, "path", ""), getattr(original, "methods", None)
            if path and methods:
                out.append((path, set(methods)))
    return out


@pytest.mark.postgres
def test_ids_beyond_32_bits_are_422_on_every_route(pg_api: TestClient) -> None:
    """Every route with an id in its path, the dashboard's pages included (PostgreSQL's INTEGER is
    32-bit; SQLite's driver overflows past 2^63): 422 naming the parameter, never a 500."""
    routes = [(path, methods) for path, methods in _route_table(pg_api.app) if "{" in path]
    assert {"/sweeps/{sweep_id}", "/sweeps/{sweep_id}/data.json", "/sweeps/{sweep_id}/trials/{trial_id}",
            "/schedules/{schedule_id}/trends", "/api/schedules/{schedule_id}"} <= {p for p, _ in routes}
    checked = 0
    for path, methods in routes:
        names = re.findall(r"{(\w+)}", path)
        for bad in ("2147483648", "99999999999999999999", "0"):
            url = re.sub(r"{\w+}", bad, path)
            for method in methods - {"HEAD"}:
                r = pg_api.request(method, url, headers=ALICE, json={})
                assert r.status_code == 422, (method, url, r.status_code, r.text[:200])
                assert r.json()["errors"][0]["field"] in names, (method, url, r.text[:200])
                checked += 1
    assert checked >= 60
    assert pg_api.get("/api/sweeps/2147483647").status_code == 404  # the largest id is a plain miss


@pytest.mark.postgres
def test_cli_schedule_ids_beyond_32_bits_exit_2(pg_url: str, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    from api.cli import main

    store.upgrade(pg_url)
    monkeypatch.setenv("MESHTUNE_DATABASE_URL", pg_url)
    for argv in (["schedule", "rm", "2147483648"], ["schedule", "run-now", "99999999999999999999"],
                 ["schedule", "alerts", "--schedule", "0"]):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        err = capsys.readouterr().err
        assert exited.value.code == 2 and "is not an id between 1 and 2147483647" in err and "Traceback" not in err


def test_bodies_are_bounded_and_the_caller_is_checked_before_the_body_is_read(client: TestClient) -> None:
    big = json.dumps({**TINY, "name": "x" * (2 << 20)}).encode()
    r = client.post("/api/sweeps", content=big, headers={"content-type": "application/json"})  # no token
    assert r.status_code == 413 and "1,048,576 bytes" in r.json()["detail"], r.text[:200]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"name": "'
        for _ in range(40):
            yield b"y" * 65536

    r = client.post("/api/sweeps", content=chunks(), headers={**ALICE, "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["detail"].startswith("body:"), r.text[:200]
    # An unauthenticated caller is refused before its body is parsed: a broken body is still a 401.
    r = client.post("/api/sweeps", content=b'{"model": tiny', headers={"content-type": "application/json"})
    assert r.status_code == 401, r.text
    assert client.post("/api/sweeps", content=b"{", headers={**WRONG, "content-type": "application/json"}).status_code == 403
    doc = client.get("/openapi.json").json()
    assert "413" in doc["paths"]["/api/sweeps"]["post"]["responses"]


@pytest.mark.parametrize(("content", "needle"), [
    pytest.param(b'{"name": "caf\xe9"}', "not UTF-8", id="latin-1"),
    pytest.param(b"\xff\xfe{}", "not UTF-8", id="utf-16-bom"),
    # Within the size limit; json.loads would recurse 100,000 deep.
    pytest.param(b"[" * 100_000, "deeper than the limit of 32 levels", id="100k-deep"),
    pytest.param(b'{"model": {"a": ' + b"[" * 40 + b"1" + b"]" * 40 + b"}}", "deeper than the limit", id="42-deep"),
])
def test_undecodable_bodies_are_a_documented_422_naming_body(client: TestClient, content: bytes, needle: str) -> None:
    # Every route that reads a JSON body (from the OpenAPI document, so a new one is covered too).
    doc = client.get("/openapi.json").json()
    json_posts = [path for path, ops in doc["paths"].items()
                  if "application/json" in ops.get("post", {}).get("requestBody", {}).get("content", {})]
    assert "/api/sweeps" in json_posts and "/api/plan" in json_posts
    for path in json_posts:
        url = path.replace("{sweep_id}", "1").replace("{schedule_id}", "1")
        r = client.post(url, content=content, headers={**ALICE, "content-type": "application/json"})
        assert r.status_code == 422 and _first_error(r)["field"] == "body" and needle in r.json()["detail"], (path, r.text)
        assert "UTF-8" in doc["paths"][path]["post"]["responses"]["422"]["description"], path


def test_planning_work_is_bounded_before_it_starts(client: TestClient) -> None:
    # 240,240 devices (2^4*3*5*7*11*13: 35,840 meshes) would enumerate ~1.2 x 10^7 layouts inside the request.
    unrestricted = {k: v for k, v in SIMULATED.items() if k != "space"}
    divisor_rich = {**unrestricted, "cluster": {"preset": "h100-sxm", "nodes": 30_030}}
    r = client.post("/api/sweeps", json=divisor_rich, headers=ALICE)
    assert _first_error(r)["field"] == "cluster.nodes" and "candidate layouts" in r.json()["detail"], r.text
    huge = {**SIMULATED, "cluster": {"preset": "h100-sxm", "nodes": 131_072}, "search": {"max_trials": 5}}
    assert "exceeds the limit of 262144" in client.post("/api/sweeps", json=huge, headers=ALICE).json()["detail"]
    many = {**SIMULATED, "search": {"max_trials": 100_000}}
    r = client.post("/api/sweeps", json=many, headers=ALICE)
    assert _first_error(r)["field"] == "search.max_trials" and "limit of 10,000" in r.json()["detail"], r.text
    # 24,024 devices (2^3*3*7*11*13) is within the plan endpoint's device limit but not its work limit.
    r = client.get("/api/plan", params={"model": "tiny", "cluster": "h100-sxm", "nodes": 3003, "global_batch": 16})
    assert _first_error(r)["field"] == "cluster.nodes" and "candidate layouts" in r.json()["detail"], r.text
    space = {**divisor_rich, "space": {"tp": [1], "cp": [1], "pp": [1]}}  # a restricted space is within the limit
    assert "candidate layouts" not in client.post("/api/sweeps", json=space, headers=ALICE).json()["detail"]


def test_anonymous_plans_are_charged_to_a_budget_that_refills(db_url: str) -> None:
    from api.plan import service as plan_service
    from api.plan.service import ClientBudget
    from tuner import cluster_spec, model_spec
    from tuner._plan import candidate_layouts

    cost = candidate_layouts(model=model_spec("tiny"), cluster=cluster_spec({"preset": "h100-sxm", "nodes": 2}))
    now = [0.0]
    plan_service._PLANS.clear()  # answers cached by earlier tests of this process would be free
    with client_for(db_url) as c:
        c.app.state.plan_budget = ClientBudget(capacity=2 * cost, rate=cost / 10, clock=lambda: now[0])

        def plan(batch: int, headers: dict | None = None):  # noqa: ANN202 - a new batch is a new (uncached) answer
            return c.get("/api/plan", params={"model": "tiny", "cluster": "h100-sxm", "nodes": 2,
                                              "global_batch": batch}, headers=headers or {})

        assert plan(7 * 16).status_code == 200 and plan(7 * 32).status_code == 200
        r = plan(7 * 64)
        assert r.status_code == 429 and r.headers["retry-after"] == "10", r.text
        assert "planning budget" in r.json()["detail"] and "bearer token" in r.json()["detail"]
        assert plan(7 * 16).status_code == 200  # a cached answer costs nothing
        assert plan(7 * 64, ALICE).status_code == 200  # a token holder is not charged
        assert plan(7 * 128).status_code == 429
        now[0] += 10.0  # what Retry-After said
        assert plan(7 * 128).status_code == 200
    assert "429" in c.app.openapi()["paths"]["/api/plan"]["get"]["responses"]


def test_the_budget_behind_a_proxy_follows_x_forwarded_for_only_from_a_trusted_proxy(db_url: str) -> None:
    """Behind a proxy every anonymous client shared the proxy's budget; X-Forwarded-For is believed only
    from an address of MESHTUNE_TRUSTED_PROXIES (read from the right: what a client writes to its left
    is not), so neither can a client that reaches the API directly pick the address it is charged to."""
    from api.plan import service as plan_service
    from api.plan.service import ClientBudget
    from tuner import cluster_spec, model_spec
    from tuner._plan import candidate_layouts

    cost = candidate_layouts(model=model_spec("tiny"), cluster=cluster_spec({"preset": "h100-sxm", "nodes": 2}))
    settings = Settings(home="/nonexistent", database_url=db_url, trusted_proxies="10.0.0.0/8, 192.0.2.7",
                        ray_address=None)
    assert [str(n) for n in settings.trusted_proxies] == ["10.0.0.0/8", "192.0.2.7/32"]
    batch = iter(range(1, 10_000))

    def plan(c: TestClient, forwarded: str | None) -> int:  # a new batch each time: never a cached answer
        headers = {"X-Forwarded-For": forwarded} if forwarded else {}
        return c.get("/api/plan", params={"model": "tiny", "cluster": "h100-sxm", "nodes": 2,
                                          "global_batch": 16 * next(batch)}, headers=headers).status_code

    plan_service._PLANS.clear()
    app = create_app(settings, run_engine=False)
    for peer, trusted in (("10.1.2.3", True), ("198.51.100.9", False)):
        app.state.plan_budget = ClientBudget(capacity=cost, rate=1e-9)  # one plan per client
        with TestClient(app, client=(peer, 5000)) as c:
            assert plan(c, "203.0.113.1") == 200
            # another client behind the same proxy has a budget of its own only if the proxy is trusted
            assert plan(c, "203.0.113.2") == (200 if trusted else 429)
            assert plan(c, "203.0.113.1") == 429  # the first one's is spent either way
            # a client naming someone else to the left of what the trusted proxies appended is still itself
            assert plan(c, "203.0.113.99, 203.0.113.1, 10.9.9.9") == 429
            # a header that is not addresses is not believed: the peer is charged (spent already if untrusted)
            assert plan(c, "not an address") == (200 if trusted else 429)
            assert plan(c, "not an address") == 429
    with pytest.raises(ValueError, match="MESHTUNE_TRUSTED_PROXIES='10.0.0.0/33'"):
        Settings(trusted_proxies="10.0.0.0/33")


def test_a_workload_is_checked_off_the_event_loop(client: TestClient) -> None:
    """A spec's validation imports and builds its workload (``workload: hf`` imports transformers:
    seconds). FastAPI validates bodies on the event loop, so every other request of the process
    waited (measured under load: /api/presets stalled 16.1 s while an hf sweep was validated, 0.58 s
    at most after); bodies are now validated in a worker thread, the sweep's and a schedule's
    template alike."""
    from tests.helpers import workloads as _workloads

    _workloads.BUILT_ON_LOOP.clear()
    for i, (path, body) in enumerate((("/api/sweeps", {}), ("/api/schedules", {"template": True}))):
        spec = {**SIMULATED, "name": f"where-{i}", "workload": "tests.helpers.workloads:WHERE",  # a model of its own: not cached
                "model": {"preset": "tiny", "name": f"where-{i}"}}
        data = {"name": "n", "cron": "0 2 * * *", "template": spec} if body else spec
        r = client.post(path, json=data, headers=ALICE)
        assert r.status_code == 201, r.text
    assert _workloads.BUILT_ON_LOOP == [False, False]


def test_options_and_405_list_every_method_of_the_path(client: TestClient) -> None:
    """GET and POST /api/sweeps are two routes (so are GET, PATCH and DELETE of a schedule): the
    Allow header lists the methods of all of them, and exactly the methods that are not a 405."""
    for path, expected in (("/api/sweeps", {"GET", "POST"}), ("/api/schedules/1", {"GET", "PATCH", "DELETE"})):
        r = client.options(path)
        assert r.status_code == 204, (path, r.status_code)
        allowed = set(r.headers["allow"].split(", "))
        assert expected | {"OPTIONS"} <= allowed, (path, allowed)
        for method in ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"):
            answer = client.request(method, path, headers=ALICE, json={})
            assert (answer.status_code != 405) == (method in allowed), (method, path, answer.status_code)
            if answer.status_code == 405:
                assert set(answer.headers["allow"].split(", ")) == allowed, (method, path)
    assert client.options("/no/such/path").status_code == 404


@pytest.mark.parametrize(("change", "field"), [
    ({"search": {"max_trials": True}}, "search.max_trials"),
    ({"search": {"max_device_seconds": True}}, "search.max_device_seconds"),
    ({"search": {"repeats": 2.0}}, "search.repeats"),
    ({"trial": {"options": {"cpu_bf16": 0}}}, "trial.options.cpu_bf16"),
    ({"trial": {"options": {"grad_norm": "true"}}}, "trial.options.grad_norm"),
    ({"trial": {"warmup_steps": "1"}}, "trial.warmup_steps"),
])
def test_request_types_are_strict(client: TestClient, change: dict, field: str) -> None:
    """A boolean must be a JSON boolean and a number must not be one (lax coercion would take 0 as
    False and true as 1); an integer is still a valid float."""
    r = client.post("/api/sweeps", json={**SIMULATED, **change}, headers=ALICE)
    assert _first_error(r)["field"] == field, r.text
    ok = {**SIMULATED, "search": {**SIMULATED["search"], "max_device_seconds": 100}, "trial": {"step_timeout_s": 30}}
    assert client.post("/api/sweeps", json=ok, headers=ALICE).status_code == 201


def test_docs_pages_load_every_asset_from_this_server(client: TestClient) -> None:
    for page in ("/docs", "/redoc"):
        r = client.get(page)
        assert r.status_code == 200, page
        urls = re.findall(r'(?:src|href)="([^"]+)"', r.text) + re.findall(r"url: '([^']+)'", r.text)
        assert urls and not re.search(r"(https?:)?//", r.text.split("<body>", 1)[0] + "".join(urls)), (page, urls)
        assert "fonts.googleapis" not in r.text and "cdn" not in r.text.lower()
        for url in urls:
            asset = client.get(url)
            assert asset.status_code == 200 and len(asset.content) > 0, url
    assert client.get("/docs/oauth2-redirect").status_code == 200


def test_a_sweep_spec_is_one_tuner_problem_built_once() -> None:
    import tuner
    from api.spec import SweepSpec

    spec = SweepSpec.model_validate({**TINY, "space": {"mbs": [1, 2]}})
    problem = spec.to_problem()
    assert isinstance(problem, tuner.Problem) and spec.to_problem() is problem  # validated once, not rebuilt
    with pytest.raises(ValueError, match="frozen"):  # so the problem never goes stale
        spec.cluster = "h100-sxm"
    assert problem.model == tuner.model_spec("tiny") and problem.cluster == tuner.cluster_spec("cpu-local")
    assert problem.training.global_batch == 16 and problem.space.mbs == (1, 2) and problem.capabilities is None
    with pytest.raises(TypeError, match=r"^Problem\.space must be a SearchSpace, got None$"):
        tuner.Problem(model=problem.model, cluster=problem.cluster, training=problem.training, space=None)


def test_an_empty_space_is_refused_by_the_tuner_without_building_the_sweep_model(
        client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    import tuner
    from api.engine import SweepModel
    from api.engine._submission import no_valid_layout_message
    from api.spec import SweepSpec

    built: list[int] = []
    init = SweepModel.__init__
    monkeypatch.setattr(SweepModel, "__init__", lambda self, *a, **k: built.append(1) or init(self, *a, **k))
    SweepModel.from_spec(SweepSpec.model_validate(TINY))
    assert built == [1]  # the counter sees every sweep model built
    body = {**TINY, "space": {"tp": [3]}}
    before = client.get("/api/sweeps").json()["total"]
    r = client.post("/api/sweeps", json=body, headers=ALICE)
    assert r.status_code == 422, r.text
    enum = tuner.enumerate_layouts(problem=SweepSpec.model_validate(body).to_problem())
    want = no_valid_layout_message(enum.rejected, {"tp": [3]}, enum.refusal)
    assert r.json()["detail"] == want and "\n" not in want and want.startswith("space.tp=[3]: "), r.json()
    assert built == [1]  # refused by the tuner's enumeration alone
    assert client.get("/api/sweeps").json()["total"] == before
