"""Cost columns of a stored sweep: each ranked layout's time and cost to train the token
budget from its measured (here: simulated, and labelled so) tokens/s, and what the search spent,
in the API ranking, ``meshtune show`` and the dashboard sweep page; and ``GET /api/plan/sizes``.
The sweep is seeded through the store functions the engine uses (tests/helpers/dashboard_seed.py)."""

from __future__ import annotations

import html
import json
import re

import pytest
from fastapi.testclient import TestClient

from api import format as fmt
from api import store
from api.cli import main
from api.main import create_app
from api.settings import Settings
from tests.helpers import dashboard_seed as seed

PRICE, TOKENS = 2.5, 1e12


@pytest.fixture(scope="module")
def priced_store(tmp_path_factory):
    url = f"sqlite:///{tmp_path_factory.mktemp('budget') / 'meshtune.db'}"
    engine, sessions = store.open_store(url)
    with pytest.MonkeyPatch.context() as mp:  # the seeded sweep's spec, with a price and a token budget
        mp.setattr(seed, "SPEC", {**seed.SPEC, "cluster": {"preset": "h100-sxm", "nodes": 4, "price_per_device_hour": PRICE},
                                  "training": {**seed.SPEC["training"], "train_tokens": TOKENS}})
        sid = seed.seed_sweep(sessions, n_trials=12, name="priced sweep")
    plain = seed.seed_sweep(sessions, n_trials=12, name="unpriced sweep", seed=1)
    app = create_app(Settings(database_url=url, api_tokens={"alice": "tok-alice"}, read_requires_auth=False),
                     run_engine=False)
    with TestClient(app) as client:
        yield {"url": url, "sid": sid, "plain": plain, "client": client}
    engine.dispose()


def test_api_ranking_rows_carry_time_and_cost_to_train(priced_store):
    body = priced_store["client"].get(f"/api/sweeps/{priced_store['sid']}/ranking").json()
    sweep = priced_store["client"].get(f"/api/sweeps/{priced_store['sid']}").json()
    devices = 32
    assert body["rows"]
    for row in body["rows"]:
        b = row["budget"]
        job = row["tokens_per_s_per_device"] * devices
        assert b["simulated"] is True and b["devices"] == devices
        assert b["time_to_train_s"] == pytest.approx(TOKENS / job)
        assert b["cost"] == pytest.approx(devices * TOKENS / job / 3600 * PRICE)
        assert b["cost_per_token"] == pytest.approx(b["cost"] / TOKENS)
    spent = body["budget"]
    assert spent["search_device_seconds"] == pytest.approx(sweep["device_seconds"]) and spent["simulated"] is True
    assert spent["search_cost"] == pytest.approx(sweep["device_seconds"] / 3600 * PRICE)
    # A sweep with neither a budget nor a price: the parts are null, the search spend still counted.
    plain = priced_store["client"].get(f"/api/sweeps/{priced_store['plain']}/ranking").json()
    assert plain["rows"][0]["budget"]["time_to_train_s"] is None and plain["budget"]["search_cost"] is None
    assert plain["budget"]["search_device_hours"] > 0


def test_meshtune_show_prints_the_cost_columns_and_the_search_spend(priced_store, monkeypatch, capsys):
    monkeypatch.setenv("MESHTUNE_DATABASE_URL", priced_store["url"])
    assert main(["show", str(priced_store["sid"])]) == 0
    out = capsys.readouterr().out
    body = priced_store["client"].get(f"/api/sweeps/{priced_store['sid']}/ranking").json()
    sweep = priced_store["client"].get(f"/api/sweeps/{priced_store['sid']}").json()
    assert "time to train" in out and "cost" in out
    best = fmt.budget_cells(body["rows"][0]["budget"], simulated=True)
    assert best["time"].endswith("(simulated)") and best["time"] in out and best["cost"] in out
    spent = fmt.search_spent(sweep["device_seconds"], price_per_device_hour=PRICE, simulated=True)
    assert f"search spent: {spent}" in out and "token budget to train: 1T" in out
    assert main(["show", str(priced_store["plain"])]) == 0
    out = capsys.readouterr().out
    assert "time to train" not in out and "search spent: simulated" in out


def test_dashboard_sweep_page_shows_cost_columns_and_spend(priced_store):
    r = priced_store["client"].get(f"/sweeps/{priced_store['sid']}")
    assert r.status_code == 200
    body = priced_store["client"].get(f"/api/sweeps/{priced_store['sid']}/ranking").json()
    cells = fmt.budget_cells(body["rows"][0]["budget"], simulated=True)
    assert "time to<br>train" in r.text and f'<td class="budget-time">{cells["time"]}</td>' in r.text
    assert f'<td class="budget-cost">{cells["cost"]}</td>' in r.text
    assert r.text.count('class="budget-cost"') == len(body["rows"])
    assert 'id="fact-search-spent"' in r.text and "simulated" in r.text and "budget 1T tokens" in r.text
    sweep = priced_store["client"].get(f"/api/sweeps/{priced_store['sid']}").json()
    spent = fmt.search_spent(sweep["device_seconds"], price_per_device_hour=PRICE, simulated=True)
    assert f'data-fact="summary.search_spent">{spent}<' in r.text  # a live page refreshes it from data.json
    assert priced_store["client"].get(f"/sweeps/{priced_store['sid']}/data.json").json()["summary"]["search_spent"] == spent
    plain = priced_store["client"].get(f"/sweeps/{priced_store['plain']}").text
    assert 'class="budget-cost"' not in plain and 'id="fact-search-spent"' in plain


def test_api_plan_sizes_table_and_figure(priced_store):
    c = priced_store["client"]
    r = c.get("/api/plan/sizes", params={"model": "tiny", "cluster": "cpu-local", "nodes": "1,2,4", "global_batch": 16,
                                         "train_tokens": 1e9, "price_per_device_hour": 0.5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [s["devices"] for s in body["sizes"]] == [4, 8, 16]
    for s in body["sizes"]:
        assert s["budget"]["time_to_train_s"] == pytest.approx(1e9 / s["tokens_per_s"])
    assert body["figure"]["data"][0]["x"] == [4, 8, 16] and body["figure"]["layout"]["title"]["text"]
    for bad, field in (({"nodes": "1,0"}, "nodes=1,0: 0 is not a positive integer"),
                       ({"nodes": "2,2"}, "nodes=2,2: 2 is given twice"),
                       ({"nodes": "1,²"}, "is not a positive integer"),
                       ({"nodes": "1", "price_per_device_hour": -1}, "price_per_device_hour")):
        r = c.get("/api/plan/sizes", params={"model": "tiny", "cluster": "cpu-local", "global_batch": 16, **bad})
        assert r.status_code == 422 and field in r.text, r.text
    r = c.get("/api/plan", params={"model": "tiny", "cluster": "cpu-local", "global_batch": 16, "top": 1,
                                   "train_tokens": 1e9, "price_per_device_hour": 2})
    entry = r.json()["entries"][0]
    assert entry["budget"]["cost"] == pytest.approx(4 * 1e9 / entry["time"]["tokens_per_s"] / 3600 * 2)


def test_dashboard_plan_page_compares_sizes_and_names_bad_input(priced_store):
    c = priced_store["client"]
    home = c.get("/plan")
    assert home.status_code == 200 and 'id="plan-form"' in home.text and 'id="plan-table"' not in home.text
    r = c.get("/plan", params={"model": "tiny", "cluster": "cpu-local", "nodes": "1,2,4", "global_batch_tokens": "1024",
                               "train_tokens": "1e9", "price_per_device_hour": "0.5"})
    assert r.status_code == 200 and r.text.count("<tr data-nodes=") == 3
    api = c.get("/api/plan/sizes", params={"model": "tiny", "cluster": "cpu-local", "nodes": "1,2,4",
                                           "global_batch_tokens": 1024, "train_tokens": 1e9,
                                           "price_per_device_hour": 0.5}).json()
    for s in api["sizes"]:  # the page shows what the API answers, through the one formatting module
        assert f"<td>{fmt.budget_cells(s['budget'])['cost']}</td>" in r.text
    m = re.search(r"data-figure='(.*?)'", r.text, re.S)
    assert m and json.loads(html.unescape(m[1]))["data"][0]["x"] == [4, 8, 16]
    for params, line in (({"nodes": "4,4"}, "nodes=4,4: 4 is given twice"),
                         ({"nodes": "1", "price_per_device_hour": "-3"},
                          "cluster.price_per_device_hour must be a non-negative number, got -3.0"),
                         ({"nodes": "1", "train_tokens": "lots"}, "train_tokens=&#39;lots&#39; is not a number")):
        bad = c.get("/plan", params={"model": "tiny", "cluster": "cpu-local", "global_batch_tokens": "1024", **params})
        assert bad.status_code == 422 and f"<li>{line}</li>" in bad.text, bad.text[:2000]


def test_sweep_spec_takes_price_and_budget_and_refuses_bad_ones(priced_store):
    c, auth = priced_store["client"], {"Authorization": "Bearer tok-alice"}
    base = {"model": "tiny", "cluster": {"preset": "cpu-local", "price_per_device_hour": 1.5},
            "training": {"global_batch": 16, "train_tokens": 5e9}, "backend": "simulate", "search": {"max_trials": 2}}
    for cluster, training, line in (
        ({"preset": "cpu-local", "price_per_device_hour": -1}, base["training"],
         "cluster.price_per_device_hour must be a non-negative number, got -1"),
        (base["cluster"], {"global_batch": 16, "train_tokens": -5}, "training.train_tokens must be a positive number, got -5"),
        ({"preset": "gb200-nvl72", "fast_domain_devices": 70}, base["training"],
         "cluster.fast_domain_devices=70 is not a multiple of cluster.devices_per_node=4"),
    ):
        r = c.post("/api/sweeps", json={**base, "cluster": cluster, "training": training}, headers=auth)
        assert r.status_code == 422 and line in r.text, r.text
    r = c.post("/api/sweeps", json=base, headers=auth)
    assert r.status_code == 201, r.text
    spec = r.json()["spec"]
    assert spec["cluster"]["price_per_device_hour"] == 1.5 and spec["training"]["train_tokens"] == 5e9


def test_ranking_csv_ends_with_time_and_cost_to_train(priced_store):
    import csv
    import io

    c, sid = priced_store["client"], priced_store["sid"]
    rows = list(csv.DictReader(io.StringIO(c.get(f"/api/sweeps/{sid}/ranking?format=csv").text)))
    body = c.get(f"/api/sweeps/{sid}/ranking").json()
    assert list(rows[0])[-2:] == ["time_to_train_s", "cost_to_train"]
    for row, js in zip(rows, body["rows"], strict=True):
        assert float(row["time_to_train_s"]) == pytest.approx(js["budget"]["time_to_train_s"])
        assert float(row["cost_to_train"]) == pytest.approx(js["budget"]["cost"])


def test_ranking_transfer_reranks_for_a_stack_api_and_cli(priced_store, monkeypatch, capsys):
    """The measured layouts re-ranked by the target stack's prediction under the sweep's calibration
    (api/ranking/transfer.py): every measured layout once, its measured rank beside, the move marked."""
    c = priced_store["client"]
    ranking = c.get(f"/api/sweeps/{priced_store['sid']}/ranking").json()["rows"]
    body = c.get(f"/api/sweeps/{priced_store['sid']}/transfer", params={"stack": "megatron"}).json()
    assert body["stack"]["name"] == "megatron" and body["simulated"] is True
    rows = body["rows"]
    assert sorted(r["measured_rank"] for r in rows) == [r["rank"] for r in ranking]
    assert [r["target_rank"] for r in rows] == list(range(1, len(rows) + 1))
    fitting = [r for r in rows if r["target_fits"]]
    assert [r["target_tokens_per_s_per_device"] for r in fitting] == sorted(
        (r["target_tokens_per_s_per_device"] for r in fitting), reverse=True)
    assert all(r["moved"] == r["measured_rank"] - r["target_rank"] for r in rows)
    assert body["reordered"] == sum(r["moved"] != 0 for r in rows)
    assert body["same_winner"] == (rows[0]["measured_rank"] == 1)
    # Megatron's fused kernels keep less than the workers' eager torch on the same layouts.
    by_key = {r["layout_key"]: r for r in ranking}
    assert all(r["target_memory_bytes"] < by_key[r["layout_key"]]["predicted_memory_bytes"] for r in rows)
    bad = c.get(f"/api/sweeps/{priced_store['sid']}/transfer", params={"stack": "jax"})
    assert bad.status_code == 422 and bad.json()["detail"].startswith("stack='jax' is not a known stack")
    monkeypatch.setenv("MESHTUNE_DATABASE_URL", priced_store["url"])
    assert main(["show", str(priced_store["sid"]), "--stack", "megatron"]) == 0
    out = capsys.readouterr().out
    assert f"sweep {priced_store['sid']} re-ranked for stack megatron" in out and "measured #" in out
    assert ("also the predicted winner on megatron" in out) == body["same_winner"]


def test_export_prints_the_target_stacks_prediction_beside_the_measurement(priced_store):
    r = priced_store["client"].get(f"/api/sweeps/{priced_store['sid']}/export", params={"format": "megatron"})
    notes = json.loads(r.headers["X-Meshtune-Notes"])
    predicted = [n for n in notes if n.startswith("predicted for stack megatron")]
    measured = [n for n in notes if n.startswith("measured on meshtune's own workers (stack meshtune, SIMULATED)")]
    assert len(predicted) == 2 and len(measured) == 1, notes
    assert "tokens/s per device, MFU" in predicted[0] and "peak memory" in predicted[0]
    titan = json.loads(priced_store["client"].get(f"/api/sweeps/{priced_store['sid']}/export",
                                            params={"format": "torchtitan"}).headers["X-Meshtune-Notes"])
    assert any(n.startswith("predicted for stack torchtitan") for n in titan)
    ds = json.loads(priced_store["client"].get(f"/api/sweeps/{priced_store['sid']}/export",
                                         params={"format": "deepspeed"}).headers["X-Meshtune-Notes"])
    assert any(n.startswith("no prediction for deepspeed") for n in ds)


def test_api_plan_takes_a_stack_and_compares_device_types(priced_store):
    c = priced_store["client"]
    q = {"model": "llama3-8b", "cluster": "h100-sxm", "global_batch": 128, "top": 1}
    ours, theirs = (c.get("/api/plan", params={**q, "stack": s}).json() for s in ("meshtune", "megatron"))
    assert theirs["training"]["stack"] == "megatron" and theirs["entries"][0]["key"] != ours["entries"][0]["key"]
    r = c.get("/api/plan/devices", params={"model": "llama3-8b", "cluster": "h100-sxm,b200,mi300x", "nodes": "1,2",
                                           "global_batch": 128, "train_tokens": 1e12, "stack": "megatron",
                                           "price_per_device_hour": "h100-sxm=2.5,b200=5,mi300x=1"})
    assert r.status_code == 200, r.text
    devices = r.json()["devices"]
    assert [(d["device"], d["nodes"]) for d in devices] == [(t, n) for t in ("h100-sxm", "b200", "mi300x") for n in (1, 2)]
    assert sum(d["fastest"] for d in devices) == sum(d["cheapest"] for d in devices) == 1
    post = c.post("/api/plan/devices", json={
        "model": "llama3-8b", "training": {"global_batch": 128, "train_tokens": 1e12, "stack": "megatron"},
        "cluster": {"preset": ["h100-sxm", "b200", "mi300x"], "price_per_device_hour": {"h100-sxm": 2.5, "b200": 5,
                                                                                      "mi300x": 1}}, "nodes": [1, 2]})
    assert post.json()["devices"] == devices
    for how, request, detail in (
            ("post", {"model": "tiny", "cluster": ["cpu-local", {"preset": "h100-sxm"}], "training": {"global_batch": 16}},
             "cluster[1]={'preset': 'h100-sxm'}: a list of device types names cluster presets only"),
            ("post", {"model": "tiny", "cluster": {"preset": ["cpu-local", "b200"], "price_per_device_hour": {"b300": 1}},
                      "training": {"global_batch": 16}},
             "cluster.price_per_device_hour: b300=1 names a device type that is not compared (compared: cpu-local, b200)"),
            ("get", {"model": "tiny", "cluster": "cpu-local", "global_batch": 16, "stack": "jax"},
             "training.stack='jax' is not a known stack (known: megatron, meshtune, torchtitan)")):
        r = c.post("/api/plan/devices", json=request) if how == "post" else c.get("/api/plan", params=request)
        assert r.status_code == 422 and r.json()["detail"].startswith(detail), r.text
    r = c.post("/api/plan", json={"model": "tiny", "cluster": {"preset": ["cpu-local", "b200"]},
                                  "training": {"global_batch": 16}})
    assert r.status_code == 422 and "cluster.preset must be a preset name" in r.json()["detail"]
    r = c.post("/api/sweeps", json={"model": "tiny", "cluster": "cpu-local",
                                    "training": {"global_batch": 16, "stack": "megatron"}},
               headers={"Authorization": "Bearer tok-alice"})
    assert r.status_code == 422 and r.json()["detail"].startswith("training.stack='megatron': a sweep measures "
                                                                  "meshtune's own workers")
