"""Dashboard pages over HTTP (no browser): view-model functions, routes, the submit form, auth.

The browser checks (rendering, console errors, screenshot, 2,000-trial load) are in
test_dashboard_browser.py; these are the fast ones.
"""

from __future__ import annotations

import html
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api import format as fmt
from api import store
from api.dashboard import views
from api.dashboard.importance import param_importance
from api.dashboard.router import RANK_PAGE
from api.main import create_app
from api.settings import Settings
from api.sweeps import service
from tests.helpers.dashboard_seed import (
    MIGRATION_LAYOUTS,
    StubReshardRunner,
    add_running_trial,
    seed_migration_sweep,
    seed_sweep,
    summary_of,
)
from tuner import Layout

TOKEN = "tok-alice"
GiB = 2**30


# --- view-model ------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", [
    Layout(),
    Layout(tp=4, pp=2, dp=2, cp=2, zero=3, mbs=4, ac="selective", sp=True, schedule="interleaved", vpp=2),
    Layout(tp=2, pp=4, dp=1, ep=2, zero=1, ac="full", schedule="gpipe"),
])
def test_layout_key_is_read_back(layout):
    assert fmt.layout_from_key(layout.key) == layout.__dict__
    assert fmt.layout_from_key("not a key") is None


def _point(key, tp, pp, tokens, mem, front=False):
    return {"layout_key": key, "layout": {"tp": tp, "pp": pp}, "tokens_per_s_per_device": tokens,
            "peak_memory_bytes": mem * GiB, "on_front": front, "trial_id": key}


def test_pareto_chart_colours_by_tp_symbols_by_pp_and_draws_the_front():
    points = [_point("a", 1, 1, 100, 10, True), _point("b", 2, 1, 150, 20, True), _point("c", 2, 2, 90, 30),
              _point("d", 4, 2, 160, 40, True)]
    chart = views.pareto_chart(points, device_memory=80 * GiB)
    by_name = {t["name"]: t for t in chart["traces"]}
    assert by_name["TP=2"]["x"] == [20, 30] and by_name["TP=2"]["customdata"] == ["b", "c"]
    assert by_name["TP=2"]["marker"]["symbol"] == ["circle", "square"]  # PP=1, PP=2
    assert by_name["Pareto front"]["x"] == [10, 20, 40] and by_name["Pareto front"]["y"] == [100, 150, 160]
    assert {"PP=1", "PP=2"} <= set(by_name) and chart["device_memory_gib"] == 80


def test_heatmap_keeps_the_best_layout_per_cell_and_facets_nodes():
    pts = [_point("a", 1, 2, 100, 1), _point("b", 1, 2, 130, 1), _point("c", 2, 1, 90, 1)]
    [hm] = views.heatmaps(pts)
    assert hm["x"] == ["TP=1", "TP=2"] and hm["y"] == ["PP=1", "PP=2"]
    assert hm["z"] == [[None, 90], [130, None]]
    faceted = views.heatmaps([p | {"nodes": n} for p, n in zip(pts, (1, 2, 2), strict=True)])
    assert [h["title"].endswith(f"on {n} node(s)") for h, n in zip(faceted, (1, 2), strict=True)] == [True, True]


def _trial(i, tp, mbs, tokens, status="completed"):
    return {"id": i, "number": i, "status": status, "key": f"k{i}", "tokens_per_s_per_device": tokens,
            "layout": {"tp": tp, "pp": 1, "dp": 1, "cp": 1, "ep": 1, "zero": 0, "mbs": mbs, "ac": "none",
                       "sp": False, "schedule": "1f1b", "vpp": 1}}


def test_importance_finds_the_knob_that_drives_throughput():
    trials = [_trial(i, tp, mbs, 1000 / tp + mbs) for i, (tp, mbs) in
              enumerate((tp, mbs) for tp in (1, 2, 4, 8) for mbs in (1, 2, 4) for _ in range(3))]
    imp = param_importance(lambda: trials)
    assert imp["params"][0] == "tp" and set(imp["params"]) == {"tp", "mbs"}  # constant knobs left out
    assert imp["importance"][0] > 0.5 and imp["note"] is None


def test_importance_with_too_few_trials_says_why():
    imp = param_importance(lambda: [_trial(0, 1, 1, 5.0), _trial(1, 2, 1, 4.0, status="oom")])
    assert imp["params"] == [] and "at least" in imp["note"]
    same = param_importance(lambda: [_trial(i, 2, 1, float(i + 1)) for i in range(6)])
    assert same["params"] == [] and "varies" in same["note"]


def test_summary_counts_outcomes_and_device_time():
    rows = [_trial(0, 1, 1, 5.0) | {"device_seconds": 3700.0}, _trial(1, 2, 1, None, status="oom"),
            _trial(2, 2, 2, None, status="pruned"), _trial(3, 2, 2, None, status="interrupted")]
    s = views.summary(rows)
    assert s["counts"]["completed"] == 1 and s["failed"] == 1 and s["finished"] == 3
    assert s["device_time"] == "1 h 01 min" and s["best_tokens_per_s_per_device"] == 5.0


def test_summary_and_charts_count_confirm_runs_apart_from_the_budgeted_short_runs():
    confirm, losses = {"phase": "confirm", "repeat": 0}, {"losses": [2.0, 1.5, 1.2]}
    rows = [_trial(0, 1, 1, 5.0) | losses, _trial(1, 2, 1, 4.0) | losses, _trial(2, 1, 1, 9.0) | confirm | losses,
            _trial(3, 2, 1, None, status="crash") | confirm]
    s = views.summary(rows)
    assert s["finished"] == 2 and s["confirm_finished"] == 2 and s["counts"]["crash"] == 0
    assert s["best_tokens_per_s_per_device"] == 5.0  # a long run is not a short-run measurement
    assert views.loss_curves(rows)["reference_id"] == 0


def test_summary_counts_a_node_lost_trial_once_its_rerun_exists():
    lost = {"error": {"kind": "crash", "infra": "node_lost"}}
    rows = [_trial(0, 1, 1, 5.0), _trial(1, 2, 1, None, status="crash") | lost | {"key": "k9"},
            _trial(2, 2, 2, None, status="crash") | lost]
    before = views.summary(rows)
    assert before["counts"]["crash"] == 2 and before["failed"] == 2  # no re-run yet: the lost rows are the trials
    rows.append(_trial(3, 2, 1, 7.0) | {"key": "k9"})  # the re-run of trial 1's layout
    after = views.summary(rows)
    assert after["counts"]["crash"] == 1 and after["counts"]["completed"] == 2 and after["finished"] == 3


# --- pages -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pages_store(tmp_path_factory):
    url = f"sqlite:///{tmp_path_factory.mktemp('pages') / 'meshtune.db'}"
    engine, sessions = store.open_store(url)
    sid = seed_sweep(sessions, n_trials=30, name="pages sweep", rich=True)
    yield {"url": url, "sessions": sessions, "sid": sid}
    engine.dispose()


@pytest.fixture(scope="module")
def pages_client(pages_store):
    app = create_app(Settings(database_url=pages_store["url"], api_tokens={"alice": TOKEN}, read_requires_auth=False), run_engine=False)
    with TestClient(app) as c:
        yield c


def test_sweep_page_and_its_chart_data(pages_client, pages_store):
    sid = pages_store["sid"]
    truth = summary_of(pages_store["sessions"], sid)
    r = pages_client.get(f"/sweeps/{sid}")
    assert r.status_code == 200
    # The charts' data is fetched by dashboard.js (data.json), not embedded in the page.
    assert 'id="sweep-data"' not in r.text and f'data-data-url="/sweeps/{sid}/data.json"' in r.text
    bundle = pages_client.get(f"/sweeps/{sid}/data.json").json()
    assert bundle["live"] is False and bundle["pareto"]["points"] == len(truth["pareto"])
    assert sum(len(t["x"]) for t in bundle["timeline"]["traces"]) == truth["n_trials"]
    assert bundle["summary"]["best_tokens_per_s_per_device"] == views.sig(truth["ranking"].rows[0].median)
    assert r.text.count('<tr class="') == len(truth["ranking"].rows)  # one ranking row per layout
    # Links go to this sweep's trials and every asset is served here (root-relative, no CDN).
    assert f'href="/sweeps/{sid}/trials/' in r.text
    assert not re.search(r'(src|href)="(https?:)?//', r.text)


def test_sweep_page_shows_one_ranking_page_at_a_time(tmp_path):
    url = f"sqlite:///{tmp_path / 'meshtune.db'}"
    engine, sessions = store.open_store(url)
    sid = seed_sweep(sessions, n_trials=130, name="paged sweep")
    rows = summary_of(sessions, sid)["ranking"].rows
    assert len(rows) > RANK_PAGE  # the seed measures more layouts than one page holds
    app = create_app(Settings(database_url=url), run_engine=False)
    with TestClient(app) as c:
        first, second = c.get(f"/sweeps/{sid}").text, c.get(f"/sweeps/{sid}?rank_page=2").text
    engine.dispose()
    ranks = [re.findall(r'<tr class="[^"]*" data-trial="[^"]*" data-key="[^"]*" data-rank="(\d+)"', t) for t in (first, second)]
    assert ranks[0] == [str(r.rank) for r in rows[:RANK_PAGE]]
    assert ranks[1] == [str(r.rank) for r in rows[RANK_PAGE:2 * RANK_PAGE]]
    assert f'/sweeps/{sid}?rank_page=2&amp;' in first and "page 1 of" in first


def test_sweep_page_etag_and_a_new_result_renders_it_again(tmp_path):
    url = f"sqlite:///{tmp_path / 'meshtune.db'}"
    engine, sessions = store.open_store(url)
    sid = seed_sweep(sessions, n_trials=12, name="etag sweep")
    app = create_app(Settings(database_url=url, api_tokens={"alice": TOKEN, "reader": "r" * 24},
                              api_roles={"reader": "read-only"}), run_engine=False)
    with TestClient(app) as c:
        for path in (f"/sweeps/{sid}", f"/sweeps/{sid}/tables", f"/sweeps/{sid}/data.json"):
            r = c.get(path)
            etag = r.headers["etag"]
            assert r.status_code == 200 and r.headers["cache-control"] == "no-cache"
            again = c.get(path, headers={"If-None-Match": etag})
            assert again.status_code == 304 and again.content == b"" and again.headers["etag"] == etag
            # gzipped once for browsers; the same bytes plain for a client that does not take gzip
            plain = c.get(path, headers={"Accept-Encoding": "identity"})
            assert r.headers["content-encoding"] == "gzip" and "content-encoding" not in plain.headers
            assert plain.content == r.content and plain.headers["etag"] == etag
        # A read-only viewer's page hides the actions: a page of its own, never the writer's cached one.
        mig = seed_migration_sweep(sessions)
        writer = c.get(f"/sweeps/{mig}")
        reader = c.get(f"/sweeps/{mig}", headers={"Authorization": "Bearer " + "r" * 24})
        assert reader.headers["etag"] != writer.headers["etag"]
        assert 'class="mig-open"' in writer.text and 'class="mig-open"' not in reader.text
        assert c.get(f"/sweeps/{mig}").text == writer.text  # the writer's again
        page = c.get(f"/sweeps/{sid}")
        # A result lands: the page's version changes, so the old ETag no longer matches and the page shows it.
        add_running_trial(sessions, sweep_id=sid, tokens=987654.0, peak=3 * 2**30)
        with store.session_scope(sessions) as session:
            store.set_sweep_status(session, sweep_id=sid, status="completed")
        after = c.get(f"/sweeps/{sid}", headers={"If-None-Match": page.headers["etag"]})
        assert after.status_code == 200 and after.headers["etag"] != page.headers["etag"]
        assert "987,654" in after.text or "988k" in after.text or "987.7k" in after.text
        assert c.get(f"/sweeps/{sid}/data.json").json()["pareto"]["points"] == len(summary_of(sessions, sid)["pareto"])
    engine.dispose()


def test_trial_pages_and_filters(pages_client, pages_store):
    sid = pages_store["sid"]
    with pages_store["sessions"]() as s:
        crash = service.list_trials(s, sweep_id=sid, status="crash").items[0]
        oom = service.list_trials(s, sweep_id=sid, status="oom").items[0]
    r = pages_client.get(f"/sweeps/{sid}/trials/{crash.id}")
    assert r.status_code == 200 and "injected crash on rank 1" in r.text and "RuntimeError" in r.text
    r = pages_client.get(f"/sweeps/{sid}/trials/{oom.id}")
    assert "exceeds device_memory" in r.text and "bytes_requested" in r.text
    only_oom = pages_client.get(f"/sweeps/{sid}/tables?trial_status=oom").text
    table = only_oom.split('id="trials-table"')[1]
    assert table.count('class="badge oom"') == table.count("data-trial=") >= 1


def test_unknown_ids_are_404_pages(pages_client, pages_store):
    assert pages_client.get("/sweeps/999999").status_code == 404
    assert "sweep 999999 does not exist" in pages_client.get("/sweeps/999999").text
    assert pages_client.get(f"/sweeps/{pages_store['sid']}/trials/999999").status_code == 404
    assert pages_client.get("/sweeps/999999/data.json").status_code == 404
    assert pages_client.get("/sweeps/abc").status_code == 422  # the API's own message for a bad path value


def test_assets_are_served_locally(pages_client):
    import plotly

    shipped = (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_bytes()
    r = pages_client.get("/dashboard/vendor/plotly.min.js")  # httpx asks for gzip and decodes it
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/javascript")
    assert r.headers["content-encoding"] == "gzip" and r.content == shipped
    r = pages_client.get("/dashboard/vendor/plotly.min.js", headers={"Accept-Encoding": "identity"})
    assert "content-encoding" not in r.headers and r.content == shipped
    assert pages_client.get("/dashboard/vendor/plotly.min.js", headers={"If-None-Match": r.headers["etag"]}).status_code == 304
    for name in ("dashboard.css", "dashboard.js", "trial.js", "migrate.js", "sweeps.js"):
        assert pages_client.get(f"/dashboard/static/{name}").status_code == 200


FORM = {"name": "form sweep", "model": "tiny", "cluster": "cpu-local", "global_batch": "16", "precision": "fp32",
        "sampler": "random", "max_trials": "4", "backend": "simulate"}


@pytest.mark.parametrize(("fields", "body"), [
    ({"max_trials": "0"}, {"search": {"sampler": "random", "max_trials": 0}}),
    ({"global_batch": "0"}, {"training": {"global_batch": 0, "precision": "fp32"}}),
    ({"model": "gpt-17"}, {"model": "gpt-17"}),
    ({"sampler": "annealing"}, {"search": {"sampler": "annealing", "max_trials": 4}}),
])
def test_form_errors_are_the_api_errors(pages_client, fields, body):
    r = pages_client.post("/sweeps", data=FORM | fields | {"token": TOKEN})
    assert r.status_code == 422
    shown = re.findall(r'<ul class="form-errors" id="form-errors">\s*<li>(.*?)</li>', r.text, re.S)
    api_body = {"name": "form sweep", "model": "tiny", "cluster": "cpu-local",
                "training": {"global_batch": 16, "precision": "fp32"},
                "search": {"sampler": "random", "max_trials": 4}, "backend": "simulate"} | body
    api = pages_client.post("/api/sweeps", json=api_body, headers={"Authorization": f"Bearer {TOKEN}"})
    assert api.status_code == 422
    assert [html.unescape(s) for s in shown] == [api.json()["detail"]]


def test_form_submits_a_sweep_owned_by_the_token(pages_client, pages_store):
    r = pages_client.post("/sweeps", data=FORM | {"token": TOKEN, "extra": "space: {tp: [1, 2]}\ntrial: {measure_steps: 2}"},
                    follow_redirects=False)
    assert r.status_code == 303
    sid = int(r.headers["location"].rsplit("/", 1)[1])
    with pages_store["sessions"]() as s:
        sweep = service.get_sweep(s, sweep_id=sid)
        assert sweep.owner == "alice" and sweep.status == "queued" and sweep.sampler == "random"
        assert sweep.spec["space"]["tp"] == [1, 2] and sweep.spec["trial"]["measure_steps"] == 2
    assert pages_client.get(r.headers["location"]).status_code == 200


def test_names_are_escaped(pages_client, pages_store):
    r = pages_client.post("/sweeps", data=FORM | {"token": TOKEN, "name": "<script>alert(1)</script>"})
    assert r.status_code == 200 and "&lt;script&gt;alert(1)&lt;/script&gt;" in r.text
    assert "<script>alert(1)" not in r.text
    assert "<script>alert(1)" not in pages_client.get("/").text


def test_form_needs_a_valid_token_when_auth_is_on(pages_client):
    r = pages_client.post("/sweeps", data=FORM)
    assert r.status_code == 401 and "token: missing" in r.text
    r = pages_client.post("/sweeps", data=FORM | {"token": "nope"})
    assert r.status_code == 403 and "token: not a valid token" in r.text
    assert "nope" not in r.text  # a token is never echoed
    r = pages_client.post("/sweeps", data=FORM | {"token": TOKEN, "extra": "space: [1"})
    assert r.status_code == 422 and "extra: not valid YAML/JSON" in r.text


def test_closed_reads_need_the_token_cookie(pages_store):
    settings = Settings(database_url=pages_store["url"], api_tokens={"alice": TOKEN}, read_requires_auth=True)
    with TestClient(create_app(settings, run_engine=False)) as c:
        r = c.get("/")
        assert r.status_code == 401 and 'action="/login"' in r.text and "pages sweep" not in r.text
        assert c.get(f"/sweeps/{pages_store['sid']}/data.json").status_code == 401
        assert c.post("/login", data={"token": "wrong", "next": "/"}).status_code == 403
        r = c.post("/login", data={"token": TOKEN, "next": f"/sweeps/{pages_store['sid']}"}, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == f"/sweeps/{pages_store['sid']}"
        assert "httponly" in r.headers["set-cookie"].lower()
        assert c.get("/").status_code == 200 and "pages sweep" in c.get("/").text
        assert c.get(f"/sweeps/{pages_store['sid']}/data.json").status_code == 200
        assert "Migration checks" in c.get(f"/sweeps/{pages_store['sid']}/tables").text  # the cookie reads the checks
        r = c.post("/login", data={"token": TOKEN, "next": "//evil.example"}, follow_redirects=False)
        assert r.headers["location"] == "/"


# --- sweeps list refresh ---------------------------------------------------------------------------

def _live_flag(page: str) -> str:
    m = re.search(r'data-live="(\d)"', page)
    assert m, "the list says nothing about refreshing"
    return m.group(1)


def test_sweeps_list_refreshes_only_while_a_sweep_is_queued_or_running(tmp_path):
    url = f"sqlite:///{tmp_path / 'list.db'}"
    engine, sessions = store.open_store(url)
    seed_migration_sweep(sessions, name="finished one")
    with TestClient(create_app(Settings(database_url=url), run_engine=False)) as c:
        page = c.get("/?refresh_ms=700").text
        assert _live_flag(page) == "0" and 'data-refresh-ms="700"' in page
        assert "/sweeps-table?status=&amp;page=1&amp;refresh_ms=700" in page  # what sweeps.js polls
        with store.session_scope(sessions) as s:
            from api.spec import SweepSpec

            spec = SweepSpec.model_validate({"name": "waiting", "model": "tiny", "cluster": "cpu-local",
                                             "backend": "simulate", "training": {"global_batch": 8}})
            queued = service.create_sweep(s, spec=spec, owner=None).id
        for filt in ("", "completed"):  # a live sweep anywhere keeps the list refreshing, whatever the filter
            frag = c.get(f"/sweeps-table?status={filt}&refresh_ms=700")
            assert frag.status_code == 200 and frag.headers["cache-control"] == "no-store"
            assert _live_flag(frag.text) == "1" and "every 0.7 s" in frag.text
        assert "waiting" in c.get("/sweeps-table").text and "<html" not in c.get("/sweeps-table").text
        with store.session_scope(sessions) as s:
            service.cancel_sweep(s, sweep_id=queued)
        frag = c.get("/sweeps-table").text
        assert _live_flag(frag) == "0" and "cancelled" in frag
    engine.dispose()


# --- "check migration" controls -------------------------------------------------------------------

class _RankedRows(HTMLParser):
    """The ranked rows' data attributes and the migration targets, read as static/migrate.js reads them."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict] = []
        self.buttons = 0
        self._targets: list[str] | None = None
        self.targets: list[dict] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "tr" and "data-layout" in a:
            self.rows.append({"key": a["data-key"], "rank": int(a["data-rank"]), "label": a["data-label"],
                              "layout": json.loads(a["data-layout"])})
        elif tag == "button" and "mig-open" in (a.get("class") or ""):
            self.buttons += 1
        elif tag == "script" and a.get("id") == "migration-targets":
            self._targets = []

    def handle_data(self, data):
        if self._targets is not None:
            self._targets.append(data)

    def handle_endtag(self, tag):
        if tag == "script" and self._targets is not None:
            self.targets, self._targets = json.loads("".join(self._targets)), None


def _payload(row: dict, targets: list[dict]) -> dict:
    """migrate.js's request body for a row with its default target (the best other ranked layout)."""
    to = next(t for t in targets if t["key"] != row["key"])
    return {"from_layout": row["layout"], "to_layout": to["layout"], "steps_before": 2, "steps_after": 2}


def test_migration_payload_of_the_page_is_what_the_reshard_endpoint_accepts(pages_store):
    """The body the page posts, read from the page, sent to the real endpoint (real validation, real
    storage): accepted for every pair without ep, refused with a 422 naming the field for ep>1. Only
    the runner is a stub (``StubReshardRunner``, labelled): the check itself is test_reshard.py's."""
    sid = seed_migration_sweep(pages_store["sessions"])
    app = create_app(Settings(database_url=pages_store["url"], api_tokens={"alice": TOKEN}, read_requires_auth=False),
                     run_engine=False)
    app.state.reshard_runner = runner = StubReshardRunner()
    with TestClient(app) as c:
        page = _RankedRows()
        page.feed(c.get(f"/sweeps/{sid}").text)
        assert "data-check=" not in c.get(f"/sweeps/{sid}/tables").text  # rendered (and cached) before any check
        assert len(page.rows) == len(MIGRATION_LAYOUTS) == page.buttons == len(page.targets)
        assert {r["key"] for r in page.rows} == {lay.key for lay in MIGRATION_LAYOUTS}
        assert [t["rank"] for t in page.targets] == [1, 2, 3, 4] and page.targets[0]["key"] == page.rows[0]["key"]
        url = f"/api/sweeps/{sid}/reshard-check"
        auth = {"Authorization": f"Bearer {TOKEN}"}
        accepted = []
        for row in page.rows:
            body = _payload(row, page.targets)
            r = c.post(url, json=body, headers=auth)
            ep = [name for name in ("from_layout", "to_layout") if body[name]["ep"] > 1]
            if ep:  # refused before anything runs; the message the page shows names the field
                assert r.status_code == 422, r.text
                assert r.json()["detail"].startswith(f"{ep[0]}.ep=2: expert-parallel"), r.json()
                continue
            assert r.status_code == 200, r.text
            target = next(t["key"] for t in page.targets if t["key"] != row["key"])
            job = runner.jobs[-1]  # what the endpoint validated and handed to the runner
            assert (job.from_layout.key, job.to_layout.key) == (row["key"], target)
            assert (job.steps_before, job.steps_after) == (2, 2)
            assert (r.json()["from_key"], r.json()["to_key"], r.json()["owner"]) == (row["key"], target, "alice")
            accepted.append(r.json()["id"])
        # dp4 (best) -> ep2 (2nd) and ep2 -> dp4 are refused; pp2 -> dp4 and tp2 -> dp4 run
        assert len(accepted) == 2 and len(runner.jobs) == 2
        assert c.post(url, json=_payload(page.rows[2], page.targets)).status_code == 401  # a writer token is needed

        tables = c.get(f"/sweeps/{sid}/tables").text
        listed = re.findall(r'<tr data-check="(\d+)" data-verdict="(\w+)">', tables)
        assert sorted(int(i) for i, _ in listed) == sorted(accepted) and {v for _, v in listed} == {"ok"}
        assert [c_["id"] for c_ in c.get(f"/api/sweeps/{sid}/reshard-checks").json()] == sorted(accepted)
        assert "tp2 dp2" in html.unescape(tables.split('id="migrations-table"')[1])  # Layout.short


# --- ids, and the form's free-text spec ------------------------------------------------------------

@pytest.mark.parametrize("bad", ["99999999999999999999", "2147483648", "0"])
def test_ids_out_of_range_are_422_not_500(pages_client, pages_store, bad):
    sid = pages_store["sid"]
    for url in (f"/sweeps/{bad}", f"/sweeps/{bad}/data.json", f"/sweeps/{bad}/importance.json", f"/sweeps/{bad}/tables",
                f"/sweeps/{bad}/trials/1", f"/sweeps/{sid}/trials/{bad}", f"/schedules/{bad}/trends"):
        r = pages_client.get(url)
        assert r.status_code == 422, (url, r.status_code)
        assert r.json()["errors"][0]["field"] in ("sweep_id", "trial_id", "schedule_id"), url


def _form_errors(page: str) -> list[str]:
    return [html.unescape(s) for s in re.findall(r'<ul class="form-errors" id="form-errors">\s*<li>(.*?)</li>', page, re.S)]


@pytest.mark.parametrize(("extra", "needle"), [
    pytest.param("[" * 5000 + "]" * 5000, "extra: nested deeper than the limit of 32 levels", id="flow-5000-deep"),
    pytest.param("space:\n" + "".join("  " * i + "-\n" for i in range(1, 60)),
                 "extra: nested deeper than the limit of 32 levels", id="block-60-deep"),
    pytest.param("a: &x [1, 2]\nspace: {tp: *x}", "extra: YAML aliases (*name) are not accepted; write the value out",
                 id="alias"),
    pytest.param("space: {tp: [" + ", ".join(["1"] * 30_000) + "]}",
                 "extra: 90,013 characters exceeds the limit of 65,536", id="90k-chars"),
])
def test_form_spec_text_is_parsed_with_limits_and_only_after_the_token(pages_client, extra, needle):
    r = pages_client.post("/sweeps", data=FORM | {"token": TOKEN, "extra": extra})
    assert r.status_code == 422 and _form_errors(r.text) == [needle], _form_errors(r.text)
    r = pages_client.post("/sweeps", data=FORM | {"extra": extra})  # no token: refused before anything is parsed
    assert r.status_code == 401 and _form_errors(r.text) == ["token: missing — this coordinator needs a token to submit"]
    r = pages_client.post("/sweeps", data=FORM | {"token": "nope", "extra": extra})
    assert r.status_code == 403 and _form_errors(r.text) == ["token: not a valid token"]


def test_form_text_the_store_cannot_hold_names_the_field(pages_client):
    r = pages_client.post("/sweeps", data=FORM | {"token": TOKEN, "name": "a\x00b"})
    assert r.status_code == 422 and _form_errors(r.text)[0].startswith("name contains a NUL character")
    r = pages_client.post("/sweeps", data=FORM | {"token": TOKEN, "extra": 'trial: {options: {"x\\0": 1}}'})
    assert r.status_code == 422 and _form_errors(r.text)[0].startswith("trial.options has a key that contains a NUL")


def test_sweep_page_shows_the_calibrations_held_out_figure_and_what_it_learned_from(pages_client, pages_store):
    """The dashboard prints the lines `meshtune show` prints: the held-out (leave-one-out)
    Spearman against the prior's, and the earlier sweeps on this cluster it learned from."""
    from api.cli.show import calibration_lines
    from api.spec import SweepSpec

    spec = SweepSpec.model_validate({"name": "calibrated", "model": "tiny", "cluster": "cpu-local",
                                     "training": {"global_batch": 16}, "backend": "simulate"})
    time = {"n": 8, "prior": "analytical", "prior_spearman": 0.62, "loo_spearman": 0.81, "accepted": True,
            "fitted": ["compute"], "weights": {"compute": 2.5, "comm": 1.0, "dp": 1.0, "p2p": 1.0, "latency": 0.0}}
    calibration = {"version": 3, "time": time, "learned_from": [pages_store["sid"]]}
    with pages_store["sessions"]() as s:
        sid = service.create_sweep(s, spec=spec, owner="t").id
        store.set_calibration(s, sweep_id=sid, calibration=calibration)
        s.commit()
    page = pages_client.get(f"/sweeps/{sid}")
    assert page.status_code == 200
    m = re.search(r'<div class="muted" id="calibration">(.*?)</div></div>', page.text, re.S)
    assert m, "no calibration lines on the sweep page"
    shown = [html.unescape(x) for x in re.findall(r"<div>(.*?)</div>", m.group(1) + "</div>")]
    assert shown == calibration_lines(calibration)
    assert any("held-out (leave-one-out) Spearman +0.81 vs prior (analytical) +0.62" in x for x in shown)
    assert f"learned from earlier sweeps on this cluster: #{pages_store['sid']}" in shown
