"""Why a sweep ended (``stop_reason``: API, CLI, dashboard, the sweep's row) and what it starts from
(``search.learn_from``: auto, none, sweep ids; an inherited model its own first measurements
contradict is dropped and said). Simulate-backend sweeps of the tiny model: seconds each."""

from __future__ import annotations

import dataclasses
import json
import re
import threading

import pytest
import yaml

from api import store
from api.cli import main
from api.cli.show import calibration_lines
from api.engine import SweepModel, SweepRunner
from api.settings import Settings
from api.spec import SweepSpec
from api.sweeps import service as svc
from tests.helpers.api_client import ALICE, client_for
from workers.simulate import SimulateBackend

TINY = {"model": "tiny", "cluster": "cpu-local", "training": {"global_batch": 16}, "backend": "simulate"}


class Misread(SimulateBackend):
    """A cluster that differs from the model the way real ones do: peaks ``memory`` times and steps
    ``time`` times what the analytical model says (its results stay labelled simulated)."""

    def __init__(self, *, memory: float = 1.0, time: float = 1.0) -> None:
        super().__init__(seed=0)
        self.memory, self.time = memory, time

    def run(self, request):  # noqa: ANN001, ANN201
        r = super().run(request)
        changes = {}
        if r.peak_memory_bytes:
            changes["peak_memory_bytes"] = int(r.peak_memory_bytes * self.memory)
        if r.step_time_s:
            changes.update(step_time_s=r.step_time_s * self.time, step_times_s=[x * self.time for x in r.step_times_s],
                           tokens_per_s=r.tokens_per_s / self.time,
                           tokens_per_s_per_device=r.tokens_per_s_per_device / self.time)
        return dataclasses.replace(r, **changes)



def _run(settings, sessions, search, backend=None, sampler="surrogate", **over):  # noqa: ANN001, ANN202
    defaults = {"warm_start_top_k": 1, "remeasure_top_k": 1, "repeats": 2, **({"sampler": sampler} if sampler else {})}
    spec = SweepSpec.model_validate({**TINY, "name": "end", **over, "search": {**defaults, **search}})
    with sessions() as s:
        sweep_id = svc.create_sweep(s, spec=spec, owner="t").id
    factory = (lambda spec: backend) if backend is not None else None
    return SweepRunner(settings, sessions=sessions, backend_factory=factory).run_sweep(sweep_id)


# --- stop_reason ---------------------------------------------------------------------------------



def _spec_file(tmp_path, name, search):  # noqa: ANN001, ANN202
    path = tmp_path / name
    path.write_text(yaml.safe_dump({**TINY, "name": name, "search": search}))
    return path


def test_a_sweep_says_why_it_stopped_in_the_cli_the_api_and_its_record(home, capsys):
    """max_trials and patience: `meshtune sweep`'s and `meshtune show`'s end lines, --json, the API."""
    capped = _spec_file(home, "capped.yaml", {"sampler": "random", "max_trials": 3, "remeasure_top_k": 0})
    assert main(["sweep", str(capped)]) == 0
    assert "stopped: reached max_trials=3" in capsys.readouterr().out
    patient = _spec_file(home, "patient.yaml", {"sampler": "random", "seed": 3, "max_trials": 60, "patience": 2,
                                                "warm_start_top_k": 0, "remeasure_top_k": 0})
    assert main(["sweep", str(patient), "--json"]) == 0
    sweep = json.loads(capsys.readouterr().out)["sweep"]
    assert sweep["stop_reason"].startswith("patience=2: 2 trials without beating the best (")
    assert sweep["n_trials"] < 60
    assert main(["show", str(sweep["id"])]) == 0
    assert f"stopped: {sweep['stop_reason']}" in capsys.readouterr().out
    url = Settings().resolved_database_url
    with client_for(url) as client:
        got = {sw["id"]: sw["stop_reason"] for sw in client.get("/api/sweeps").json()["items"]}
        assert got == {sweep["id"] - 1: "reached max_trials=3", sweep["id"]: sweep["stop_reason"]}
        page = client.get(f"/sweeps/{sweep['id']}")  # the dashboard's sweep page
        assert page.status_code == 200
        assert re.search(r'id="stop-reason"><b>Stopped:</b> <span data-fact="stop_reason">patience=2: 2 trials',
                         page.text)


def test_a_sweep_whose_trials_all_run_out_of_memory_ends_with_a_reason(db):
    """No silent early stop: every trial OOMs (a diagnostic memory cap). A sweep that ends before
    max_trials says what ended it: the memory model ruling every unseen layout out, or no layout
    left, with the counts; one that goes on reaches max_trials and says that."""
    settings, sessions = db
    final = _run(settings, sessions, {"max_trials": 150}, trial={"options": {"memory_cap_bytes": 1}})
    space = len(SweepModel.from_spec(SweepSpec.model_validate(final.spec)).space)
    assert final.status == "completed" and final.n_completed == 0 and final.stop_reason
    unseen = re.fullmatch(r"the memory model predicts none of the (\d+) unseen layouts fits \(learned from "
                          r"0 measured peaks and (\d+) OOMs\)", final.stop_reason)
    if unseen:
        assert int(unseen.group(1)) == space - final.n_trials and int(unseen.group(2)) == final.n_failed
    elif final.n_trials < 150:
        assert final.stop_reason == (f"every layout of the space was tried ({space}: {final.n_failed} ran, "
                                     f"{final.n_pruned} pruned by the memory model)")
    else:
        assert final.stop_reason == "reached max_trials=150"


def test_listed_layouts_and_the_device_budget_say_so(db):
    settings, sessions = db
    listed = _run(settings, sessions, {"layouts": [{"tp": 2}, {"tp": 4}], "warm_start_top_k": 0}, sampler=None)
    assert listed.stop_reason == "every listed layout was tried (2 in search.layouts)"
    budget = _run(settings, sessions, {"max_trials": 50, "max_device_seconds": 1e-6, "remeasure_top_k": 0})
    assert re.fullmatch(r"device budget spent: [\d,.]+ of max_device_seconds=1e-06 simulated device-seconds",
                        budget.stop_reason), budget.stop_reason
    assert budget.n_trials < 50


def test_cancelled_and_failed_sweeps_say_so(db):
    settings, sessions = db
    spec = SweepSpec.model_validate({**TINY, "name": "c"})
    with sessions() as s:
        queued = svc.create_sweep(s, spec=spec, owner="t").id
        assert svc.cancel_sweep(s, sweep_id=queued).stop_reason == "cancelled after 0 trials"
        broken = svc.create_sweep(s, spec=spec, owner="t").id

    def refuse(spec):  # noqa: ANN001, ANN202
        raise ValueError("this backend cannot start")

    final = SweepRunner(settings, sessions=sessions, backend_factory=refuse).run_sweep(broken)
    assert final.status == "failed"
    assert final.stop_reason == f"failed: {final.error}" and "this backend cannot start" in final.stop_reason


# --- search.learn_from ----------------------------------------------------------------------------


def test_learn_from_naming_a_missing_or_another_clusters_sweep_is_refused(db, tmp_path, monkeypatch, capsys):
    (settings, sessions), url = db, db.url
    measured = _run(settings, sessions, {"max_trials": 2, "remeasure_top_k": 0})
    with sessions() as s:  # another cluster's measured sweep, and one of another backend
        other = svc.create_sweep(s, spec=SweepSpec.model_validate(
            {**TINY, "name": "o", "cluster": {"preset": "cpu-local", "nodes": 2}}), owner="t").id
        store.set_fingerprint(s, sweep_id=other, fingerprint=measured.fingerprint)
        ray = store.insert_sweep(s, name="r", owner="t", spec=measured.spec, backend="ray", sampler="surrogate").id
        store.set_fingerprint(s, sweep_id=ray, fingerprint="f00d")
        unmeasured = svc.create_sweep(s, spec=SweepSpec.model_validate({**TINY, "name": "u"}), owner="t").id
        s.commit()
        before = store.list_sweeps(s, limit=100)[1]
    cases = {9999: "search.learn_from[0]=9999: sweep 9999 does not exist",
             other: f"search.learn_from[0]={other}: sweep {other} measured another cluster",
             ray: f"search.learn_from[0]={ray}: sweep {ray} ran on backend 'ray'",
             unmeasured: f"search.learn_from[0]={unmeasured}: sweep {unmeasured} has measured nothing yet"}
    with client_for(url) as client:
        for sweep_id, message in cases.items():
            r = client.post("/api/sweeps", json={**TINY, "name": "n", "search": {"learn_from": [sweep_id]}},
                            headers=ALICE)
            assert r.status_code == 422, r.text
            assert r.json()["detail"].startswith(message), r.json()
            assert r.json()["errors"][0]["field"] == "search.learn_from[0]"
        r = client.post("/api/sweeps", json={**TINY, "name": "n", "search": {"learn_from": "sometimes"}},
                        headers=ALICE)
        assert r.status_code == 422 and r.json()["errors"][0]["field"] == "search.learn_from"
    monkeypatch.setenv("MESHTUNE_DATABASE_URL", url)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**TINY, "name": "bad", "search": {"learn_from": [9999]}}))
    assert main(["sweep", str(path)]) == 2
    err = capsys.readouterr().err
    assert "search.learn_from[0]=9999: sweep 9999 does not exist" in err and "Traceback" not in err
    with sessions() as s:
        assert store.list_sweeps(s, limit=100)[1] == before  # nothing stored


def test_learn_from_none_is_a_cold_sweep_and_ids_choose_the_teachers(db):
    settings, sessions = db
    first = _run(settings, sessions, {"max_trials": 5})
    second = _run(settings, sessions, {"max_trials": 5})
    assert second.calibration["learned_from"] == [first.id]  # auto: by fingerprint
    cold = _run(settings, sessions, {"max_trials": 5, "learn_from": "none"})
    assert cold.fingerprint == first.fingerprint and not cold.calibration.get("learned_from")
    assert not any("learned from" in line or "inherited" in line for line in calibration_lines(cold.calibration))
    chosen = _run(settings, sessions, {"max_trials": 5, "learn_from": [first.id]})
    assert chosen.calibration["learned_from"] == [first.id]  # auto would take the newest ones too
    auto = _run(settings, sessions, {"max_trials": 5})
    assert auto.calibration["learned_from"] == [chosen.id, cold.id, second.id, first.id]


@pytest.mark.parametrize(("misread", "what"), [({"memory": 2.0}, "memory model"), ({"time": 3.0}, "time model")])
def test_an_inherited_model_the_new_sweeps_measurements_contradict_is_dropped_and_said(db, misread, what):
    """The first sweep ran where peaks were 2x (or steps 3x) the model's and learned it; the second,
    on the same fingerprint, measures the model's own figures: its first measurement contradicts
    what it inherited, which it drops (and says so in the calibration's notes, shown by `show`)."""
    settings, sessions = db
    first = _run(settings, sessions, {"max_trials": 8}, backend=Misread(**misread))
    section = "memory" if what == "memory model" else "time"
    assert first.calibration[section]["accepted"]  # it learned the misread cluster
    kept = _run(settings, sessions, {"max_trials": 8}, backend=Misread(**misread))
    assert kept.calibration["learned_from"] == [first.id]  # the same cluster again: what it learned holds
    assert not kept.calibration.get("notes")
    second = _run(settings, sessions, {"max_trials": 8}, backend=Misread())
    assert second.fingerprint == first.fingerprint
    notes = second.calibration["notes"]
    assert len(notes) == 1 and re.fullmatch(
        rf"inherited {what} of sweep #({first.id}|{kept.id}) \(fitted on \d+ measurements\) dropped with the rest of its "
        rf"learning: it predicted \d\.\d\dx the (peaks|step times) of this sweep's first 1 measurement, beyond "
        rf"its uncertainty of \d+%", notes[0]), notes
    assert not second.calibration.get("learned_from")
    assert notes[0] in calibration_lines(second.calibration)


def test_what_its_first_measurements_contradicted_stays_dropped_on_resume(db):
    """Stopped after its third result and resumed: the resumed loop inherits again, replays the
    stored rows and drops the same model with the same note (a function of the recorded rows)."""
    settings, sessions = db
    first = _run(settings, sessions, {"max_trials": 8}, backend=Misread(memory=2.0))
    spec = SweepSpec.model_validate({**TINY, "name": "resumed", "search": {"max_trials": 8, "remeasure_top_k": 0}})
    with sessions() as s:
        sweep_id = svc.create_sweep(s, spec=spec, owner="t").id
    stop, finished = threading.Event(), []

    def on_progress(event):  # noqa: ANN001, ANN202
        if event["event"] == "finished":
            finished.append(event["trial"].number)
            if len(finished) == 3:
                stop.set()

    runner = SweepRunner(settings, sessions=sessions, backend_factory=lambda spec: Misread())
    halted = runner.run_sweep(sweep_id, stop_event=stop, on_progress=on_progress)
    assert halted.status == "running" and halted.stop_reason is None  # unfinished: no reason yet
    notes = halted.calibration["notes"]
    assert len(notes) == 1 and f"memory model of sweep #{first.id}" in notes[0]
    final = runner.run_sweep(sweep_id)
    assert final.status == "completed" and final.stop_reason == "reached max_trials=8"
    assert final.calibration["notes"] == notes and not final.calibration.get("learned_from")
