"""The dashboard at 1400 px in a real Chromium, as a new user saw it: long failure causes made the "All
trials" table wider than its card, wrapped one word per line; the trial page's step chart had ticks
between steps (-0.5, 0.5, ...); the "Pipeline stage times" note of a simulate sweep was cut off at the
plot's edge. Screenshots go to test-artifacts/."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from api import store
from api.main import create_app
from api.settings import Settings
from api.store._models import Trial
from tests.helpers.browser import serve, watched_page
from tests.helpers.dashboard_seed import seed_measured_sweep, seed_sweep
from tuner import Layout

pytestmark = pytest.mark.browser

# Causes as real runs write them: a gloo error with its file:line, a watchdog's verdict, a refusal.
LONG_CAUSES = [
    "crash: torch.distributed.DistBackendError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Read "
    "error [127.0.0.1]:54321: Connection reset by peer; rank 2 of 4 (exception raised from recvBytes at "
    "/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534)",
    "timeout: rank 0 made no progress for 60.0 s (step 3 of the measured steps, waiting in the pipeline's send to "
    "stage 1) after 3 optimizer steps; trial killed",
    "crash: refused: it no longer fits the cluster left after a node loss: the layout needs 8 devices on 2 nodes, "
    "6 are left on node 10.0.0.12 (raylet 4f1c2a9b8e7d6c5b4a3928171615141312111009)",
]


@pytest.fixture(scope="module")
def polish_site(tmp_path_factory) -> Iterator[dict]:
    url = f"sqlite:///{tmp_path_factory.mktemp('polish') / 'meshtune.db'}"
    engine, sessions = store.open_store(url)
    rich = seed_sweep(sessions, n_trials=12, name="llama3-8b on 32 H100", rich=True)
    with store.session_scope(sessions) as s:
        failed = s.scalars(sa.select(Trial.id).where(Trial.sweep_id == rich, Trial.status.in_(("crash", "timeout", "nan"))))
        for i, tid in enumerate(sorted(failed)):
            s.execute(sa.update(Trial).where(Trial.id == tid).values(cause=LONG_CAUSES[i % len(LONG_CAUSES)]))
    # a simulate sweep of pipeline layouts, one measured step each: no stage times, a one-step chart
    sim = seed_measured_sweep(sessions, [(Layout(pp=2, dp=2), [600.0]), (Layout(pp=4), [500.0, 505.0]),
                                         (Layout(pp=2, tp=2), [450.0])], name="simulated pipelines", backend="simulate")
    app = create_app(Settings(database_url=url, backend="simulate"), run_engine=False)
    try:
        with serve(app) as base:
            yield {"base": base, "rich": rich, "sim": sim, "sessions": sessions}
    finally:
        engine.dispose()


@pytest.fixture
def polish_page(browser, polish_site):
    with watched_page(browser, polish_site["base"], width=1400, height=1000) as w:
        yield w


CAUSE_CELLS = """() => {
  const card = document.getElementById('trials-card'), scroll = card.querySelector('.scroll');
  const cells = [...document.querySelectorAll('#trials-table td.cause')].filter(td => td.textContent.trim());
  const line = parseFloat(getComputedStyle(cells[0]).lineHeight);
  return {over: [card.scrollWidth - card.clientWidth, scroll.scrollWidth - scroll.clientWidth],
          cells: cells.map(td => ({w: td.getBoundingClientRect().width, lines: (td.querySelector('.clamp') || td)
                   .getBoundingClientRect().height / line, title: td.title, text: td.textContent.trim()}))};
}"""


def test_long_causes_are_readable_cells_and_the_table_fits_its_card(polish_page, polish_site, artifacts_dir):
    polish_page.goto(f"/sweeps/{polish_site['rich']}")
    polish_page.page.wait_for_selector("#trials-table")
    got = polish_page.page.evaluate(CAUSE_CELLS)
    polish_page.page.locator("#trials-card").screenshot(path=str(artifacts_dir / "dashboard-1400-trial-causes.png"))
    assert got["over"] == [0, 0], got["over"]  # no horizontal scrolling: the table fits its card
    longs = [c for c in got["cells"] if any(c["title"].startswith(long[:40]) for long in LONG_CAUSES)]
    assert len(longs) >= 2, got["cells"]
    for cell in longs:
        assert cell["w"] >= 180 and cell["lines"] <= 2.2, cell  # a readable cell: not one word per line
        assert cell["title"] in LONG_CAUSES  # the full text on hover
    polish_page.goto(f"/sweeps/{polish_site['rich']}?trial_status=crash")  # and on the trial page
    polish_page.page.click("#trials-table tbody tr:first-child a")
    polish_page.page.wait_for_selector("#trial-error")
    assert any(c in polish_page.page.locator("#trial-error").inner_text() for c in LONG_CAUSES)
    polish_page.clean()


def test_the_step_chart_ticks_whole_steps_and_the_stage_note_is_whole(polish_page, polish_site, artifacts_dir):
    with polish_site["sessions"]() as s:
        tid = s.scalar(sa.select(Trial.id).where(Trial.sweep_id == polish_site["sim"], Trial.number == 0))
    polish_page.goto(f"/sweeps/{polish_site['sim']}/trials/{tid}")
    polish_page.page.wait_for_function("() => document.getElementById('plot-trial')._fullLayout")
    ticks = polish_page.page.evaluate("() => [...document.querySelectorAll('#plot-trial .xtick text')].map(t => t.textContent)")
    assert ticks and all(t.replace("−", "-").lstrip("-").isdigit() for t in ticks), ticks
    polish_page.goto(f"/sweeps/{polish_site['sim']}")
    polish_page.page.wait_for_function("() => document.getElementById('plot-stages')._fullLayout")
    box = polish_page.page.evaluate("""() => {
      const plot = document.getElementById('plot-stages').getBoundingClientRect();
      const text = document.querySelector('#plot-stages .annotation-text').getBoundingClientRect();
      return {plot: [plot.left, plot.right], text: [text.left, text.right],
              note: document.querySelector('#plot-stages .annotation-text').textContent};
    }""")
    polish_page.page.locator("#plot-stages").screenshot(path=str(artifacts_dir / "dashboard-stage-note.png"))
    assert "the simulate backend records none" in box["note"] and box["note"].endswith("all simulated)"), box
    assert box["plot"][0] <= box["text"][0] and box["text"][1] <= box["plot"][1], box  # inside the plot
    polish_page.clean()
