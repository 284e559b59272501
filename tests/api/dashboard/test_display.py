"""What the dashboard, the API's CSV and /metrics show: a
sweep's best is the ranking's first row, a layout measured once is "not comparable" (never "tied"),
prediction errors are coloured by size, simulated device time is never counted as real, empty charts
say why, a simulated sweep offers no migration check (and the API refuses one), and the text
formatting of api/format.py. The CLI's side is in test_cli_sweep.py, the browser's in
test_dashboard_browser.py.
"""

from __future__ import annotations

import csv
import io
import re
import sys
import types

import pytest
from fastapi.testclient import TestClient

from api import format as fmt
from api import store
from api.main import create_app
from api.reshard import service as reshard_service
from api.settings import Settings
from api.spec import SweepSpec
from tests.helpers.dashboard_seed import StubReshardRunner, seed_measured_sweep, seed_sweep, valid_layouts
from tuner import Layout

TOKEN = "tok-display"
GiB = 2**30
BEST = Layout(dp=4, zero=1, mbs=2)  # the best median (606.2)
LUCKY = Layout(pp=2, dp=2)  # the single fastest run (628.2), but a median of 505: wide interval, tied
CLOSE = Layout(tp=2, dp=2)  # tied with the best
SLOW = Layout(dp=4)  # known interval, apart from the best's
ONCE = Layout(tp=4)  # one run, far below the best


@pytest.fixture(scope="module")
def display_site(tmp_path_factory):
    url = f"sqlite:///{tmp_path_factory.mktemp('display') / 'display.db'}"
    engine, sessions = store.open_store(url)
    ids = {
        "real": seed_measured_sweep(sessions, [
            (LUCKY, [628.2, 500.0, 505.0]), (BEST, [606.2, 607.0, 605.5]), (CLOSE, [603.0, 606.0, 609.0]),
            (SLOW, [300.0, 301.0, 299.0]), (ONCE, [68.5]),
        ], name="real one", predicted={BEST.key: 606.2 * 0.03, CLOSE.key: 606.0 * 1.3, LUCKY.key: 505.0 * 1.05}),
        "sim": seed_sweep(sessions, n_trials=30, name="simulated one"),  # simulate backend: no stage times, no losses
    }
    app = create_app(Settings(database_url=url, api_tokens={"alice": TOKEN}, read_requires_auth=False),
                     run_engine=False)
    app.state.reshard_runner = runner = StubReshardRunner()  # TEST STUB: runs nothing (see tests/helpers/dashboard_seed.py)
    with TestClient(app) as client:
        yield {"client": client, "ids": ids, "sessions": sessions, "url": url, "runner": runner}
    engine.dispose()


def _rows(page: str, attr: str = "data-key") -> dict[str, str]:
    """The HTML of each table row, by its ``attr`` value."""
    return {m[1]: m[0] for m in re.finditer(rf'<tr[^>]*{attr}="([^"]+)"[^>]*>.*?</tr>', page, re.S)}


# --- item 15: the best is the ranking's #1 -----------------------------------------------------------

def test_the_sweeps_list_shows_the_rankings_first_row_not_the_fastest_run(display_site):
    c, sid = display_site["client"], display_site["ids"]["real"]
    assert c.get(f"/api/sweeps/{sid}/ranking").json()["rows"][0]["layout_key"] == BEST.key
    page = c.get("/").text
    row = next(m[0] for m in re.finditer(r"<tr>.*?</tr>", page, re.S) if f'href="/sweeps/{sid}"' in m[0])
    assert "606.2" in row and "dp4 z1 mbs2" in row, row
    assert "628" not in row and "pp2" not in row  # the single fastest run is not the sweep's best


# --- item 16: measured once is not comparable; the tied count leaves out the best ---------------

def test_a_layout_measured_once_is_not_comparable_and_never_tied(display_site):
    tables = display_site["client"].get(f"/sweeps/{display_site['ids']['real']}/tables").text
    rows = _rows(tables)
    versus = {key: re.search(r'data-versus="([^"]+)"', html)[1] for key, html in rows.items()}
    # ONCE (68.5, one run) gets an interval from the sweep's pooled noise, clear of the
    # best's: slower, never tied. A run with no interval at all reads "not comparable" (test_stats).
    assert versus == {BEST.key: "best", CLOSE.key: "tied", LUCKY.key: "tied", SLOW.key: "slower",
                      ONCE.key: "slower"}
    once = rows[ONCE.key]
    assert "slower than best" in once and "tied with best" not in once
    assert 'class="tied' not in once  # no ≈ either
    assert "tied with best" in rows[CLOSE.key] and "slower than best" in rows[SLOW.key]
    assert "2 other layouts are tied with the best." in tables  # CLOSE and LUCKY; the best is not counted
    legend = re.search(r'<p class="caption legend" id="ranking-legend">(.*?)</p>', tables, re.S)[1]
    assert "not comparable" in legend and "95% interval overlaps" in legend and "≈" in legend


# --- item 17: prediction errors coloured by size -----------------------------------------------------

def test_prediction_errors_are_coloured_by_their_size_not_their_sign(display_site):
    rows = _rows(display_site["client"].get(f"/sweeps/{display_site['ids']['real']}/tables").text)
    cells = {key: re.findall(r'<td class="([^"]*)">([+-]\d+%)</td>', rows[key]) for key in (BEST.key, CLOSE.key, LUCKY.key)}
    assert ("err-poor", "-97%") in cells[BEST.key]  # far off, whatever the sign
    assert ("err-fair", "+30%") in cells[CLOSE.key]
    assert ("err-good", "+5%") in cells[LUCKY.key]
    assert [fmt.error_class(e) for e in (-0.97, 0.97, -0.3, 0.3, -0.05, 0.05)] == [
        "err-poor", "err-poor", "err-fair", "err-fair", "err-good", "err-good"]


# --- item 18: simulated device time is not real device time -----------------------------------------

def test_simulated_device_seconds_are_labelled_apart_from_real_ones(display_site):
    c, sessions = display_site["client"], display_site["sessions"]
    with sessions() as s:
        by_sweep = {sid: sum(t.device_seconds or 0.0 for t in store.all_trials(s, sweep_id=sid))
                    for sid in display_site["ids"].values()}
    metrics = c.get("/metrics").text
    values = dict(re.findall(r'^meshtune_device_seconds_total\{simulated="(true|false)"\} (\S+)$', metrics, re.M))
    assert float(values["false"]) == pytest.approx(by_sweep[display_site["ids"]["real"]]) == 13 * 2.0 * 4  # 13 trials of 4 ranks, 2 s each
    assert float(values["true"]) == pytest.approx(by_sweep[display_site["ids"]["sim"]]) and by_sweep[display_site["ids"]["sim"]] > 0

    sim = display_site["ids"]["sim"]
    page = c.get(f"/sweeps/{sim}").text
    label = re.search(r'data-fact="summary.device_time_label">([^<]*)<', page)[1]
    assert label == "simulated device time (no real device used)"
    real_page = c.get(f"/sweeps/{display_site['ids']['real']}").text
    assert re.search(r'data-fact="summary.device_time_label">device time<', real_page)
    listed = c.get("/").text
    row = next(m[0] for m in re.finditer(r"<tr>.*?</tr>", listed, re.S) if f'href="/sweeps/{sim}"' in m[0])
    assert "simulated</span></td>" in row
    with sessions() as s:
        trial = next(t for t in store.all_trials(s, sweep_id=sim) if t.status == "completed")
    detail = c.get(f"/sweeps/{sim}/trials/{trial.id}").text
    assert "<dt>simulated device time</dt>" in detail and "<dt>wall time / device time</dt>" not in detail


# --- item 19: empty charts say what is true; late panels show that they are loading ---------------

def test_simulated_sweeps_say_the_backend_records_no_stage_times_or_losses(display_site):
    c, sim = display_site["client"], display_site["ids"]["sim"]
    with display_site["sessions"]() as s:
        done = [t for t in store.all_trials(s, sweep_id=sim) if t.status == "completed"]
    piped = [t for t in done if t.layout["pp"] > 1]
    assert piped, "the seeded sweep has completed pipeline trials"
    bundle = c.get(f"/sweeps/{sim}/data.json").json()
    assert bundle["stages"]["traces"] == [] and bundle["losses"]["traces"] == []
    assert bundle["stages"]["note"] == (f"no per-stage times: the simulate backend records none "
                                        f"({len(piped)} completed pipeline trials (pp > 1), all simulated)")
    assert bundle["losses"]["note"] == (f"no losses: the simulate backend records none "
                                        f"({len(done)} completed trials, all simulated)")
    page = c.get(f"/sweeps/{sim}").text
    for plot in ("plot-pareto", "plot-heatmaps", "plot-importance", "plot-timeline", "plot-stages", "plot-losses"):
        assert re.search(rf'id="{plot}"><div class="loading[^"]*"><span class="spinner">', page), plot


# --- item 20: no migration check of a simulated sweep ------------------------------------------------

def test_a_simulated_sweep_offers_no_migration_check_and_the_api_refuses_one(display_site):
    c, runner, sim, real = display_site["client"], display_site["runner"], display_site["ids"]["sim"], display_site["ids"]["real"]
    tables = c.get(f"/sweeps/{sim}/tables").text
    assert "mig-open" not in tables and 'id="migration-targets"' not in tables
    refused = re.search(r'id="migration-refused"><b>[^<]*</b> ([^<]*)</p>', tables)[1]
    assert "simulated (backend=simulate)" in refused and "llama3-8b on 32 ranks of h100-sxm" in refused

    auth = {"Authorization": f"Bearer {TOKEN}"}
    body = {"from_layout": {"tp": 8, "dp": 4}, "to_layout": {"tp": 4, "dp": 8}}
    jobs = len(runner.jobs)
    r = c.post(f"/api/sweeps/{sim}/reshard-check", json=body, headers=auth)
    assert r.status_code == 422, r.text
    assert r.json()["detail"].startswith(f"sweep_id={sim}: the sweep is simulated") and r.json()["errors"][0]["field"] == "sweep_id"
    assert len(runner.jobs) == jobs  # nothing ran

    assert "mig-open" in c.get(f"/sweeps/{real}/tables").text  # a sweep of a real backend keeps it
    r = c.post(f"/api/sweeps/{real}/reshard-check", json={"from_layout": {"dp": 4}, "to_layout": {"tp": 2, "dp": 2}},
               headers=auth)
    assert r.status_code == 200 and len(runner.jobs) == jobs + 1, r.text


def test_a_world_size_beyond_the_ray_cluster_is_refused_before_anything_runs(display_site, monkeypatch):
    fake = types.SimpleNamespace(is_initialized=lambda: True, cluster_resources=lambda: {"CPU": 2.0})
    monkeypatch.setitem(sys.modules, "ray", fake)  # a Ray already up in this process, with 2 CPUs
    with display_site["sessions"]() as s:
        sweep = store.get_sweep(s, sweep_id=display_site["ids"]["real"])
        reason = reshard_service.refusal(sweep)
    assert reason == "a migration check runs tiny on 4 ranks of cpu-local, but the Ray cluster has 2 CPU"
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: False))
    with display_site["sessions"]() as s:  # Ray not up: not started to answer; Ray's own check refuses at run time
        assert reshard_service.refusal(store.get_sweep(s, sweep_id=display_site["ids"]["real"])) is None


# --- item 21: text formatting -----------------------------------------------------------------------

def test_numbers_bytes_and_durations_are_never_in_exponent_notation():
    assert fmt.bytes_text(1040 * GiB) == "1.02 TiB" and fmt.gib_text(1040.0) == "1.02 TiB"
    assert [fmt.bytes_text(n) for n in (512, 1536, 80 * GiB, 0.05 * GiB)] == ["512 B", "1.5 KiB", "80 GiB", "51.2 MiB"]
    assert [fmt.duration(s) for s in (0.85, 42.5, 1234.0, 856_000.0)] == ["850 ms", "42.5 s", "20 min 34 s", "237 h 46 min"]
    assert [fmt.num(v) for v in (68.5, 606.2, 9999.7, 123456.0)] == ["68.5", "606.2", "10,000", "123,456"]
    for v in (999.96, 1234.5, 2.5e6, 0.00012):
        assert "e" not in fmt.num(v) + fmt.bytes_text(v * GiB) + fmt.duration(v)


def test_causes_show_byte_counts_in_binary_units():
    cause = ("pruned by the memory model: predicted 92341000000 bytes x calibrated scale 1.10 per device "
             "exceeds device_memory=85899345920")
    assert fmt.cause_text(cause) == ("pruned by the memory model: predicted 86 GiB x calibrated scale 1.10 per "
                                     "device exceeds device_memory=80 GiB")


def test_the_short_layout_form_leaves_out_defaults_and_tells_every_layout_apart():
    assert Layout(dp=4, zero=1, mbs=2).short == "dp4 z1 mbs2"
    assert Layout(tp=2, pp=2, dp=2, ac="full", sp=True, schedule="gpipe").short == "tp2 dp2 pp2 ac_full sp gpipe"
    assert Layout(pp=2, dp=2, schedule="interleaved", vpp=2).short == "dp2 pp2 interleaved-v2"
    assert "1f1b" not in Layout(dp=4).short  # no schedule without a pipeline
    spec = SweepSpec.model_validate({"name": "x", "model": "llama3-8b", "cluster": {"preset": "h100-sxm", "nodes": 4},
                                     "training": {"global_batch": 64}})
    layouts = valid_layouts(spec.to_problem().model, spec.to_problem().cluster, spec.to_problem().training)
    assert len({lay.short for lay in layouts}) == len({lay.key for lay in layouts}) > 500
    assert all(fmt.key_text(lay.key) == lay.short for lay in layouts)


def test_pages_show_short_layouts_yes_no_flags_and_no_schedule_without_a_pipeline(display_site):
    c, real = display_site["client"], display_site["ids"]["real"]
    with display_site["sessions"]() as s:
        trial = next(t for t in store.all_trials(s, sweep_id=real) if t.layout_key == BEST.key)
    page = c.get(f"/sweeps/{real}/trials/{trial.id}").text
    assert "Trial 3: dp4 z1 mbs2" in page and f"<code>{BEST.key}</code>" in page  # the full key is kept too
    assert "<dt>sp</dt><dd>no</dd>" in page and "<dt>schedule</dt>" not in page and "<dt>vpp</dt>" not in page
    assert "<dt>hosts</dt><dd>node-a, node-b</dd>" in page and "[&#39;node-a" not in page  # no Python list repr
    assert "e+0" not in page
    with display_site["sessions"]() as s:
        pruned = next(t for t in store.all_trials(s, sweep_id=display_site["ids"]["sim"]) if t.status == "pruned")
    shown = c.get(f"/sweeps/{display_site['ids']['sim']}/trials/{pruned.id}").text
    cause = re.search(r'<div class="card" id="trial-error">.*?<p title="[^"]*">([^<]*)</p>', shown, re.S)[1]
    assert re.search(r"\d{5,}", cause) is None and "GiB" in cause, cause
    header = c.get(f"/sweeps/{display_site['ids']['sim']}").text
    assert "llama3-8b on h100-sxm (4×8 cuda)" in header and "{&#39;" not in header and "{'" not in header


# --- item 23 (CSV half): one column per layout field ---------------------------------------------

def test_the_ranking_csv_has_one_column_per_layout_field_and_keeps_the_key(display_site):
    c, real = display_site["client"], display_site["ids"]["real"]
    text = c.get(f"/api/sweeps/{real}/ranking?format=csv").text
    rows = list(csv.DictReader(io.StringIO(text)))
    header = text.splitlines()[0].split(",")
    assert header[:13] == ["rank", "layout_key", "tp", "pp", "dp", "cp", "ep", "zero", "mbs", "ac", "sp", "schedule", "vpp"]
    best = rows[0]
    assert best["layout_key"] == BEST.key
    assert {k: best[k] for k in ("tp", "pp", "dp", "cp", "ep", "zero", "mbs", "ac", "sp", "schedule", "vpp")} == {
        "tp": "1", "pp": "1", "dp": "4", "cp": "1", "ep": "1", "zero": "1", "mbs": "2", "ac": "none", "sp": "False",
        "schedule": "1f1b", "vpp": "1"}
    assert len(c.get(f"/api/sweeps/{real}/ranking?format=csv&limit=2&offset=1").text.splitlines()) == 3


def test_the_submit_forms_yaml_reads_exponent_numbers_as_floats_like_spec_files():
    from api.dashboard.form import load_extra

    assert load_extra("cluster: {inter_node_bandwidth: 25.0e9, peak_flops: 1e11}") == {
        "cluster": {"inter_node_bandwidth": 25.0e9, "peak_flops": 1e11}}
