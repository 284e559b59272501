"""The coordinator's HTTP API in process (FastAPI TestClient on a migrated SQLite file): auth, every
error code, the read routes over a sweep run by the real engine on the simulate backend, /healthz,
/metrics, the OpenAPI document, and a junk sweep over every route that must never produce a 500."""

from __future__ import annotations

import json
import logging
import socket
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from api import store
from api.auth import match_token
from api.engine import SweepRunner
from tests.helpers.api_client import ALICE, CI, SIMULATED, TINY, TOKENS, WRONG, client_for, settings_for
from tuner import MODEL_PRESETS


@pytest.fixture(scope="module")
def finished_sweep(client: TestClient, db_url: str) -> dict:
    """A sweep submitted over the API and run to its end by the real engine (simulate backend)."""
    r = client.post("/api/sweeps", json=SIMULATED, headers=CI)
    assert r.status_code == 201, r.text
    engine = store.create_engine(db_url)
    SweepRunner(settings_for(db_url), sessions=store.make_sessionmaker(engine)).run_sweep(r.json()["id"])
    engine.dispose()
    done = client.get(f"/api/sweeps/{r.json()['id']}").json()
    assert done["status"] == "completed", done
    return done


# --- auth ----------------------------------------------------------------------------------------


def test_writes_need_a_valid_token_and_record_its_name(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    r = client.post("/api/sweeps", json=TINY)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert "bearer token" in r.json()["detail"]
    r = client.post("/api/sweeps", json=TINY, headers={"Authorization": f"Basic {TOKENS['alice']}"})
    assert r.status_code == 401
    r = client.post("/api/sweeps", json=TINY, headers=WRONG)
    assert r.status_code == 403 and "not valid" in r.json()["detail"]
    assert client.post("/api/sweeps/1/cancel", headers=WRONG).status_code == 403
    for headers, name in ((ALICE, "alice"), (CI, "ci")):
        r = client.post("/api/sweeps", json=TINY, headers=headers)
        assert r.status_code == 201, r.text
        assert r.json()["owner"] == name and r.json()["status"] == "queued"
    for token in TOKENS.values():  # never echoed, never logged
        assert token not in caplog.text and token[:-1] not in r.text


def test_reads_are_open_by_default_but_a_wrong_token_is_refused(client: TestClient) -> None:
    assert client.get("/api/sweeps").status_code == 200
    assert client.get("/api/sweeps", headers=ALICE).status_code == 200
    assert client.get("/api/sweeps", headers=WRONG).status_code == 403


def test_reads_can_be_closed(db_url: str) -> None:
    with client_for(db_url, read_requires_auth=True) as c:
        for path in ("/api/sweeps", "/api/presets", "/metrics", "/api/plan?model=tiny&cluster=cpu-local&global_batch=16"):
            assert c.get(path).status_code == 401, path
            assert c.get(path, headers=WRONG).status_code == 403, path
            assert c.get(path, headers=ALICE).status_code == 200, path
        assert c.get("/healthz").status_code == 200  # load balancers probe without a token


def test_no_configured_tokens_means_auth_off(db_url: str) -> None:
    with client_for(db_url, api_tokens={}) as c:
        r = c.post("/api/sweeps", json=TINY)
        assert r.status_code == 201 and r.json()["owner"] == "anonymous"


def test_match_token_finds_the_name_in_constant_time_loop() -> None:
    tokens = {"a": "same-prefix-1", "b": "same-prefix-2", "c": "other"}
    assert match_token("same-prefix-2", tokens) == "b"
    assert match_token("other", tokens) == "c"
    assert match_token("same-prefix-", tokens) is None
    assert match_token("", tokens) is None


# --- validation and error codes ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field", "value"),
    [
        ({**TINY, "model": {"preset": "tiny", "heads": 3}}, "model.heads", 3),
        ({**TINY, "training": {"global_batch": -4}}, "training.global_batch", -4),
        ({**TINY, "training": {"global_batch": 16, "bogus": 1}}, "training.bogus", 1),
        ({**TINY, "search": {"max_trials": "many"}}, "search.max_trials", "many"),
        ({**TINY, "search": {"sampler": "annealing"}}, "search.sampler", "annealing"),
        ({**TINY, "trial": {"measure_steps": 0}}, "trial.measure_steps", 0),
        ({**TINY, "colour": "blue"}, "colour", "blue"),
        ({**TINY, "space": {"tp": [0]}}, "space.tp", None),
        ({"cluster": "cpu-local", "training": {"global_batch": 16}}, "model", None),
        ({**TINY, "cluster": "tpu-pod"}, "cluster.preset", None),
    ],
)
def test_bad_specs_are_422_naming_field_and_value(client: TestClient, body: dict, field: str, value: object) -> None:
    r = client.post("/api/sweeps", json=body, headers=ALICE)
    assert r.status_code == 422, r.text
    err = r.json()["errors"][0]
    assert err["field"] == field, r.json()
    assert field in r.json()["detail"]
    if value is not None:
        assert err["value"] == value
        assert repr(value) in r.json()["detail"] or str(value) in r.json()["detail"]


def test_non_json_and_non_object_bodies_are_422(client: TestClient) -> None:
    r = client.post("/api/sweeps", content=b"{model: tiny", headers={**ALICE, "content-type": "application/json"})
    assert r.status_code == 422 and "not valid JSON" in r.json()["detail"]
    r = client.post("/api/sweeps", json=[TINY], headers=ALICE)
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "body"


def test_unknown_ids_are_404(client: TestClient, finished_sweep: dict) -> None:
    for path in ("", "/trials", "/ranking", "/ranking?format=csv", "/pareto"):
        r = client.get(f"/api/sweeps/987654{path}")
        assert r.status_code == 404 and "987654" in r.json()["detail"], path
    assert client.post("/api/sweeps/987654/cancel", headers=ALICE).status_code == 404
    assert client.get(f"/api/sweeps/{finished_sweep['id']}/trials/987654").status_code == 404


def test_cancel_queued_then_conflicts(client: TestClient, finished_sweep: dict) -> None:
    sid = client.post("/api/sweeps", json=TINY, headers=ALICE).json()["id"]
    r = client.post(f"/api/sweeps/{sid}/cancel", headers=CI)  # a member acts only on its own
    assert r.status_code == 403 and "belongs to 'alice'" in r.json()["detail"]
    r = client.post(f"/api/sweeps/{sid}/cancel", headers=ALICE)
    assert r.status_code == 200 and r.json()["status"] == "cancelled" and r.json()["finished_at"]
    r = client.post(f"/api/sweeps/{sid}/cancel", headers=ALICE)
    assert r.status_code == 409 and "cancelled" in r.json()["detail"]
    r = client.post(f"/api/sweeps/{finished_sweep['id']}/cancel", headers=CI)
    assert r.status_code == 409 and "completed" in r.json()["detail"]


# --- reads over a finished (simulated) sweep -----------------------------------------------------


def test_trials_ranking_csv_and_pareto(client: TestClient, finished_sweep: dict) -> None:
    sid = finished_sweep["id"]
    assert finished_sweep["owner"] == "ci" and finished_sweep["n_completed"] >= 4
    trials = client.get(f"/api/sweeps/{sid}/trials").json()
    assert trials["total"] == len(trials["items"]) >= finished_sweep["n_trials"]
    assert [t["number"] for t in trials["items"]] == sorted(t["number"] for t in trials["items"])
    assert all(t["simulated"] and t["backend"] == "simulate" for t in trials["items"])
    page = client.get(f"/api/sweeps/{sid}/trials?limit=2&offset=1").json()
    assert [t["id"] for t in page["items"]] == [t["id"] for t in trials["items"][1:3]]
    one = trials["items"][0]
    assert client.get(f"/api/sweeps/{sid}/trials/{one['id']}").json() == one

    ranking = client.get(f"/api/sweeps/{sid}/ranking").json()
    rows = ranking["rows"]
    assert rows and ranking["simulated"] and [r["rank"] for r in rows] == list(range(1, len(rows) + 1))
    assert all(r["low"] <= r["median"] <= r["high"] for r in rows if r["n"] >= 2)  # n=1: no interval (null)
    assert [r["median"] for r in rows] == sorted((r["median"] for r in rows), reverse=True)
    assert rows[0]["layout_key"] == finished_sweep["best_layout_key"] or rows[0]["tied_with_best"]
    assert max(r["n"] for r in rows) == 2  # the re-measured leaders
    assert ranking["total"] == len(rows)
    page = client.get(f"/api/sweeps/{sid}/ranking?limit=2&offset=1").json()
    assert page["rows"] == rows[1:3] and page["total"] == len(rows)
    assert len(client.get(f"/api/sweeps/{sid}/ranking?format=csv&limit=1").text.strip().splitlines()) == 2
    useful = client.get(f"/api/sweeps/{sid}/ranking?metric=useful_tokens_per_s").json()
    assert useful["metric"] == "useful_tokens_per_s" and len(useful["rows"]) == len(rows)

    for kwargs in ({"params": {"format": "csv"}}, {"headers": {"Accept": "text/csv"}}):
        r = client.get(f"/api/sweeps/{sid}/ranking", **kwargs)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
        lines = r.text.strip().splitlines()
        assert lines[0].startswith("rank,layout_key,") and len(lines) == len(rows) + 1
        assert lines[1].split(",")[1] == rows[0]["layout_key"]

    points = client.get(f"/api/sweeps/{sid}/pareto").json()["points"]
    assert {p["layout_key"] for p in points} == {r["layout_key"] for r in rows}
    front = [p for p in points if p["on_front"]]
    assert front and points[: len(front)] == front
    for p in front:  # nothing measured is both faster and lighter
        assert not any(q["tokens_per_s_per_device"] > p["tokens_per_s_per_device"]
                       and q["peak_memory_bytes"] < p["peak_memory_bytes"] for q in points)


def test_list_sweeps_filters_and_paginates(client: TestClient, finished_sweep: dict) -> None:
    everything = client.get("/api/sweeps?limit=1000").json()
    assert everything["total"] == len(everything["items"]) >= 3
    ids = [s["id"] for s in everything["items"]]
    assert ids == sorted(ids, reverse=True)  # newest first
    page = client.get("/api/sweeps?limit=2&offset=1").json()
    assert [s["id"] for s in page["items"]] == ids[1:3] and page["total"] == everything["total"]
    completed = client.get("/api/sweeps?status=completed").json()
    assert finished_sweep["id"] in [s["id"] for s in completed["items"]]
    assert all(s["status"] == "completed" for s in completed["items"])
    mine = client.get("/api/sweeps?owner=alice").json()
    assert mine["total"] >= 1 and all(s["owner"] == "alice" for s in mine["items"])
    for query in ("status=weird", "limit=0", "limit=1001", "offset=-1", "limit=ten"):
        r = client.get(f"/api/sweeps?{query}")
        assert r.status_code == 422 and r.json()["errors"][0]["field"] == query.split("=")[0], query


# --- plan, presets, health, metrics --------------------------------------------------------------


def test_plan_is_the_analytical_answer(client: TestClient) -> None:
    r = client.get("/api/plan", params={"model": "tiny", "cluster": "cpu-local", "global_batch": 16, "top": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["feasible"] >= len(body["entries"]) > 0 and len(body["entries"]) <= 3
    speeds = [e["time"]["tokens_per_s_per_device"] for e in body["entries"]]
    assert speeds == sorted(speeds, reverse=True)
    assert all(e["memory"]["total"] <= body["cluster"]["device_memory"] for e in body["entries"])
    r = client.get("/api/plan", params={"model": "llama3-8b", "cluster": "h100-sxm", "nodes": 2,
                                        "global_batch_tokens": 2**20})
    assert r.status_code == 200 and r.json()["cluster"]["nodes"] == 2 and r.json()["training"]["global_batch"] == 128
    bad = [
        ({"model": "tiny", "cluster": "cpu-local"}, "global_batch"),
        ({"model": "tiny", "cluster": "cpu-local", "global_batch": 16, "global_batch_tokens": 1024}, "global_batch"),
        ({"model": "gpt5", "cluster": "cpu-local", "global_batch": 16}, "model.preset"),
        ({"model": "tiny", "cluster": "cpu-local", "global_batch_tokens": 100}, "training.global_batch_tokens"),
        ({"model": "tiny", "cluster": "h100-sxm", "nodes": 100_000, "global_batch": 16}, "cluster.nodes"),
        ({"model": "tiny", "cluster": "cpu-local", "global_batch": 16, "precision": "fp8"}, "precision"),
    ]
    for params, field in bad:
        r = client.get("/api/plan", params=params)
        assert r.status_code == 422 and field in r.json()["detail"], (params, r.text)


def test_presets(client: TestClient) -> None:
    body = client.get("/api/presets").json()
    assert {m["name"] for m in body["models"]} == set(MODEL_PRESETS)
    tiny = next(m for m in body["models"] if m["name"] == "tiny")
    assert tiny["params"] == MODEL_PRESETS["tiny"].params
    assert "tpe" in body["samplers"] and any(c["device_kind"] == "cpu" for c in body["clusters"])


def test_healthz_reports_database_and_ray_separately(db_url: str) -> None:
    # No RAY_ADDRESS: "started on demand" (None) — or, when an earlier test of this session already
    # started a local Ray in this process, that Ray is reported as running.
    ray = sys.modules.get("ray")
    local_ray_up = ray is not None and ray.is_initialized()
    with client_for(db_url) as c:
        body = c.get("/healthz").json()
        assert body["status"] == "ok" and body["database"]["ok"] is True
        assert body["ray"]["ok"] is (True if local_ray_up else None)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    with client_for(db_url, ray_address=f"127.0.0.1:{port}") as c:
        r = c.get("/healthz")
        assert r.status_code == 200 and r.json()["ray"]["ok"] is True
    listener.close()
    with client_for(db_url, ray_address=f"ray://127.0.0.1:{port}") as c:
        r = c.get("/healthz")
        assert r.status_code == 503 and r.json()["ray"]["ok"] is False and r.json()["database"]["ok"] is True
    url = f"postgresql+psycopg://meshtune:s3cret-pw@127.0.0.1:{port}/nowhere"
    with client_for(db_url, database_url=url) as c:
        r = c.get("/healthz")
        assert r.status_code == 503 and r.json()["database"]["ok"] is False
        assert "s3cret-pw" not in r.text and f"127.0.0.1:{port}" in r.json()["database"]["detail"]
        # A database outage is a 503 naming the URL on every route, never a 500 or a leaked password.
        r = c.get("/api/sweeps")
        assert r.status_code == 503 and "s3cret-pw" not in r.text


def test_metrics_match_the_store(client: TestClient, finished_sweep: dict) -> None:
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    sweeps = {s.labels["state"]: s.value for s in families["meshtune_sweeps"].samples}
    for state in ("queued", "completed", "cancelled"):
        assert sweeps[state] == client.get(f"/api/sweeps?status={state}").json()["total"], state
    trials = {(s.labels["outcome"], s.labels["simulated"]): s.value for s in families["meshtune_trials"].samples}
    items = client.get(f"/api/sweeps/{finished_sweep['id']}/trials?limit=1000").json()["items"]
    for simulated in (False, True):  # the only sweep with trials; simulated outcomes counted apart
        assert trials[("completed", str(simulated).lower())] == sum(
            t["status"] == "completed" and bool(t["simulated"]) is simulated for t in items), simulated
    # simulated device-seconds (what the simulate backend models) are exported apart from real ones
    spent = {s.labels["simulated"]: s.value for s in families["meshtune_device_seconds"].samples}
    for simulated in (False, True):
        mine = sum(t["device_seconds"] for t in items if bool(t["simulated"]) is simulated)
        assert spent[str(simulated).lower()] == pytest.approx(mine), simulated
    assert sum(spent.values()) > 0


# --- OpenAPI -------------------------------------------------------------------------------------


def test_openapi_describes_every_field_and_has_spec_examples(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    undocumented = []
    for name, schema in doc["components"]["schemas"].items():
        for prop, sub in schema.get("properties", {}).items():
            if not sub.get("description"):
                undocumented.append(f"{name}.{prop}")
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert op.get("summary"), (method, path)
            for param in op.get("parameters", []):
                if not param.get("description") and not param["schema"].get("description"):
                    undocumented.append(f"{method} {path} ?{param['name']}")
    assert not undocumented, undocumented
    post = doc["paths"]["/api/sweeps"]["post"]
    examples = post["requestBody"]["content"]["application/json"]["examples"]
    assert {"tiny-cpu", "llama3-70b"} <= set(examples)
    assert doc["components"]["schemas"]["SweepSpec"]["examples"]
    assert {"401", "403", "422"} <= set(post["responses"])
    assert "409" in doc["paths"]["/api/sweeps/{sweep_id}/cancel"]["post"]["responses"]
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


# --- junk everywhere -----------------------------------------------------------------------------

JUNK_IDS = ["0", "-1", "abc", "99999999999999999999999", "%00", "x" * 300]
JUNK_QUERIES = [
    "limit=-5", "limit=abc", "limit=10000000000000", "offset=-1", "status=%00", "status=", "owner=" + "o" * 500,
    "format=xml", "metric=loss", "metric=", "model=tiny", "model=tiny&cluster=cpu-local&global_batch=0",
    "model=tiny&cluster=cpu-local&global_batch=abc", "model=tiny&cluster=cpu-local&global_batch=16&top=-1",
    "model=tiny&cluster=cpu-local&global_batch=16&nodes=0", "model=tiny-moe&cluster=cpu-local&global_batch=1",
    "model=%00&cluster=%00&global_batch=1", "model=tiny&cluster=cpu-local&global_batch_tokens=99999999999999",
    "model=llama3-405b&cluster=cpu-local&global_batch=1&precision=fp32",
]
JUNK_BODIES: list[object] = [
    None, 0, "x", [], [1], {}, {"model": None}, {"model": 1, "cluster": [], "training": "x"},
    {**TINY, "model": {"preset": "tiny", "layers": -1}}, {**TINY, "model": {"layers": 1}},
    {**TINY, "cluster": {"preset": "cpu-local", "nodes": 10**30}}, {**TINY, "training": {"global_batch": 1e400}},
    {**TINY, "training": {"global_batch": True}}, {**TINY, "training": None}, {**TINY, "space": {"tp": "x"}},
    {**TINY, "space": {"bogus": 1}}, {**TINY, "search": {"reference_layouts": ["nope"]}},
    {**TINY, "search": None}, {**TINY, "trial": {"options": [1]}}, {**TINY, "backend": ""},
    {**TINY, "name": ""}, {**TINY, "name": "n" * 10_000}, {"a": {"b": {"c": {"d": [[[[[]]]]]}}}},
]


def test_junk_on_every_route_is_never_a_500(client: TestClient, finished_sweep: dict) -> None:
    routes = client.get("/openapi.json").json()["paths"]
    assert {"/api/sweeps", "/api/plan", "/healthz", "/metrics"} <= set(routes)
    sid = str(finished_sweep["id"])
    seen = 0
    for template, operations in routes.items():
        valid = template.replace("{sweep_id}", sid).replace("{trial_id}", "1")
        requests = [(f"{valid}?{q}", ALICE) for q in JUNK_QUERIES]
        requests += [(valid, h) for h in (WRONG, {"Authorization": "Bearer"}, {"Accept": "text/csv"})]
        if "{" in template:
            requests += [(template.replace("{sweep_id}", j).replace("{trial_id}", j), ALICE) for j in JUNK_IDS]
        for method in operations:
            for url, headers in requests:
                r = client.request(method, url, headers=headers, content=b"\xff\xfe")
                assert r.status_code < 500, (method, url, r.status_code, r.text)
                seen += 1
    for body in JUNK_BODIES:
        content = json.dumps(body).encode()  # Python's json writes Infinity for 1e400, as a sloppy client might
        r = client.post("/api/sweeps", content=content, headers={**ALICE, "content-type": "application/json"})
        assert r.status_code == 422, (body, r.status_code, r.text)
        assert r.json()["errors"][0]["field"], r.text
        seen += 1
    assert seen > 250


def test_ranking_and_pareto_follow_each_recorded_result(client: TestClient, db_url: str) -> None:
    """The ranking/Pareto answers are cached per sweep version: a newly recorded trial shows at once."""
    from workers import TrialResult

    sid = client.post("/api/sweeps", json=TINY, headers=ALICE).json()["id"]
    engine = store.create_engine(db_url)
    sessions = store.make_sessionmaker(engine)

    def record(number: int, tp: int, speed: float) -> None:
        layout = {"tp": tp, "pp": 1, "dp": 4 // tp, "cp": 1, "ep": 1, "zero": 0, "mbs": 1, "ac": "none",
                  "sp": False, "schedule": "1f1b", "vpp": 1}
        with store.session_scope(sessions) as s:
            store.insert_trial(s, sweep_id=sid, number=number, layout=layout, layout_key=f"key-tp{tp}", world_size=4)
            result = TrialResult(status="completed", backend="test", simulated=True, tokens_per_s_per_device=speed,
                                 tokens_per_s=4 * speed, peak_memory_bytes=2**20 * tp, device_seconds=1.0)
            store.record_result(s, sweep_id=sid, number=number, attempt=0, result=result)
            store.refresh_sweep_cache(s, sweep_id=sid)

    record(0, 1, 100.0)
    assert [r["layout_key"] for r in client.get(f"/api/sweeps/{sid}/ranking").json()["rows"]] == ["key-tp1"]
    assert len(client.get(f"/api/sweeps/{sid}/pareto").json()["points"]) == 1
    record(1, 2, 300.0)
    rows = client.get(f"/api/sweeps/{sid}/ranking").json()["rows"]
    assert [r["layout_key"] for r in rows] == ["key-tp2", "key-tp1"]
    assert client.get(f"/api/sweeps/{sid}/ranking?format=csv").text.splitlines()[1].startswith("1,key-tp2,")
    points = client.get(f"/api/sweeps/{sid}/pareto").json()["points"]
    assert {p["layout_key"]: p["on_front"] for p in points} == {"key-tp1": True, "key-tp2": True}
    engine.dispose()


def test_serve_with_an_unreachable_database_exits_2_naming_the_url(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from api.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MESHTUNE_HOME", str(tmp_path))
    monkeypatch.setenv("MESHTUNE_DATABASE_URL", f"postgresql+psycopg://meshtune:pw-9z8y@127.0.0.1:{port}/meshtune")
    assert main(["serve", "--migrate-only"]) == 2
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}/meshtune" in err and "pw-9z8y" not in err and "Traceback" not in err
    monkeypatch.setenv("MESHTUNE_DATABASE_URL", f"sqlite:///{tmp_path / 'fresh.db'}")
    assert main(["serve", "--migrate-only"]) == 0
    assert main(["serve", "--migrate-only"]) == 0  # idempotent
    assert store.current_revision(f"sqlite:///{tmp_path / 'fresh.db'}")


def test_ray_addresses_resolve_to_the_port_probed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from api.routes import health

    assert health._ray_target("ray://head:10001") == ("head", 10001)
    assert health._ray_target("10.0.0.5:6379") == ("10.0.0.5", 6379)
    assert health._ray_target("[::1]:6379") == ("::1", 6379)
    assert health._ray_target("nonsense") is None
    current = tmp_path / "ray_current_cluster"
    monkeypatch.setattr(health, "RAY_CURRENT_CLUSTER", current)
    assert health._ray_target("auto") is None  # `ray start` has not run on this node
    current.write_text("192.0.2.7:6379\n")
    assert health._ray_target("auto") == ("192.0.2.7", 6379)


@pytest.mark.parametrize(("body", "field", "needle"), [
    ({**TINY, "space": {"tp": [3]}}, "space.tp", "no valid layout"),
    ({**TINY, "backend": "nosuch:mod"}, "backend", "cannot import module 'nosuch'"),
])
def test_unrunnable_specs_are_422_not_a_failed_sweep_later(client: TestClient, body: dict, field: str,
                                                           needle: str) -> None:
    before = client.get("/api/sweeps").json()["total"]
    r = client.post("/api/sweeps", json=body, headers=ALICE)
    assert r.status_code == 422, r.text
    assert r.json()["errors"][0]["field"] == field and needle in r.json()["detail"], r.json()
    assert client.get("/api/sweeps").json()["total"] == before  # nothing stored


@pytest.mark.parametrize(("options", "field"), [
    ({"fail": "explode"}, "trial.options.fail"),
    ({"fail_rank": -1}, "trial.options.fail_rank"),
    ({"sleep_per_step_s": -0.5}, "trial.options.sleep_per_step_s"),
    ({"memory_cap_bytes": 0}, "trial.options.memory_cap_bytes"),
    ({"grad_norm": "sometimes"}, "trial.options.grad_norm"),
    ({"rm_rf": True}, "trial.options.rm_rf"),
])
def test_trial_options_are_typed_and_unknown_ones_refused(client: TestClient, options: dict, field: str) -> None:
    r = client.post("/api/sweeps", json={**SIMULATED, "trial": {"options": options}}, headers=ALICE)
    assert r.status_code == 422, r.text
    assert r.json()["errors"][0]["field"] == field, r.json()


def test_diagnostic_options_flag_the_sweep_and_its_ranking(client: TestClient, db_url: str) -> None:
    body = {**SIMULATED, "name": "diag", "trial": {"options": {"sleep_per_step_s": 0.01, "fail_step": 3}}}
    r = client.post("/api/sweeps", json=body, headers=CI)
    assert r.status_code == 201, r.text
    assert r.json()["diagnostic"] is True
    assert r.json()["spec"]["trial"]["options"] == {"sleep_per_step_s": 0.01, "fail_step": 3}
    engine = store.create_engine(db_url)
    SweepRunner(settings_for(db_url), sessions=store.make_sessionmaker(engine)).run_sweep(r.json()["id"])
    engine.dispose()
    ranking = client.get(f"/api/sweeps/{r.json()['id']}/ranking").json()
    assert ranking["diagnostic"] is True and ranking["rows"]
    plain = client.post("/api/sweeps", json={**SIMULATED, "trial": {"options": {"grad_norm": True}}}, headers=CI)
    assert plain.status_code == 201 and plain.json()["diagnostic"] is False


def test_ranking_interval_is_pooled_for_one_run_and_positive_otherwise(client: TestClient,
                                                                       finished_sweep: dict) -> None:
    """Every interval brackets its median; a layout measured once has one only from the sweep's pooled
    noise (repeats elsewhere in the sweep), and then is tied with the best only if they overlap."""
    rows = client.get(f"/api/sweeps/{finished_sweep['id']}/ranking").json()["rows"]
    assert rows
    best = rows[0]
    for row in rows:
        if row["low"] is None:
            assert row["n"] < 2 and row["high"] is None and row["tied_with_best"]
        else:
            assert 0 < row["low"] <= row["median"] <= row["high"]
            if best["low"] is not None:
                overlaps = row["low"] <= best["high"] and best["low"] <= row["high"]
                assert row["tied_with_best"] == overlaps
