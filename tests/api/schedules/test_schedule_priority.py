"""A schedule's queue priority (a nightly sweep and an interactive one side by side): the
sweeps it fires carry it, by cron and by run-now; the API, the CLI and the schedules page show it;
an unknown priority is one line naming the field and the value (HTTP 422, CLI exit 2)."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest

from api import store
from api.schedules import _store
from api.schedules._launch import fire_schedule
from tests.helpers.schedules import SIM_TEMPLATE


def _body(**over) -> dict:
    return {"name": "nightly", "cron": "0 2 * * *", "template": SIM_TEMPLATE, **over}


def _fired_priority(client, sid: int) -> str:
    fire = client.post(f"/api/schedules/{sid}/run-now").json()
    assert fire["status"] == "running", fire
    (sweep_id,) = fire["sweep_ids"]
    return client.get(f"/api/sweeps/{sweep_id}").json()["priority"]


def test_the_sweeps_a_schedule_fires_carry_its_priority(db, client) -> None:
    sessions = db.sessions
    low = client.post("/api/schedules", json=_body(priority="low")).json()
    assert low["priority"] == "low"
    assert _fired_priority(client, low["id"]) == "low"
    default = client.post("/api/schedules", json=_body(name="plain")).json()
    assert default["priority"] == "normal" and _fired_priority(client, default["id"]) == "normal"
    # A cron fire takes the same path as run-now: its sweeps are queued with the schedule's priority.
    changed = client.patch(f"/api/schedules/{low['id']}", json={"priority": "high"}).json()
    assert changed["priority"] == "high"
    with store.session_scope(sessions) as s:
        schedule = _store.get_schedule(s, schedule_id=low["id"])
        fire_id = fire_schedule(s, schedule=schedule, fire_time=datetime(2026, 12, 2, 2, tzinfo=timezone.utc),
                                claimed_by="test", trigger="cron")
    with sessions() as s:
        (sweep_id,) = _store.get_fire(s, fire_id=fire_id).sweep_ids
        assert store.get_sweep(s, sweep_id=sweep_id).priority == "high"
    listed = {s["name"]: s["priority"] for s in client.get("/api/schedules").json()["items"]}
    assert listed == {"nightly": "high", "plain": "normal"}
    page = client.get("/schedules")
    assert page.status_code == 200 and "<th class=\"l\">priority</th>" in page.text
    assert '<td class="l">high</td>' in page.text, page.text


@pytest.mark.parametrize("method", ["post", "patch"])
def test_an_unknown_priority_is_one_line_naming_the_field_and_value(client, method) -> None:
    if method == "post":
        r = client.post("/api/schedules", json=_body(priority="urgent"))
    else:
        sid = client.post("/api/schedules", json=_body()).json()["id"]
        r = client.patch(f"/api/schedules/{sid}", json={"priority": "urgent"})
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert detail.startswith("priority='urgent': ") and "'high', 'normal' or 'low'" in detail, detail
    assert "\n" not in detail
    items = client.get("/api/schedules").json()["items"]
    assert [s["priority"] for s in items] == ([] if method == "post" else ["normal"])
    if method == "patch":
        r = client.patch(f"/api/schedules/{items[0]['id']}", json={"priority": None})
        assert r.status_code == 422 and r.json()["detail"] == "priority cannot be null", r.text


def test_cli_takes_shows_and_refuses_a_priority(db, monkeypatch, capsys, tmp_path) -> None:
    from api.cli import main

    url = db.url
    monkeypatch.setenv("MESHTUNE_DATABASE_URL", url)
    spec = tmp_path / "t.json"
    spec.write_text(json.dumps(SIM_TEMPLATE))
    base = ["schedule", "add", "--name", "n", "--cron", "0 2 * * *", "--template", str(spec)]
    assert main([*base, "--priority", "urgent"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "priority='urgent'" in err and "Traceback" not in err, err
    assert main([*base, "--priority", "low"]) == 0
    assert "priority low" in capsys.readouterr().out
    assert main(["schedule", "list", "--json"]) == 0
    assert [s["priority"] for s in json.loads(capsys.readouterr().out)["items"]] == ["low"]
    assert main(["schedule", "list"]) == 0
    table = capsys.readouterr().out
    assert "priority" in table and " low " in table, table
