"""Restart recovery: a coordinator process running a sweep is SIGKILLed mid-sweep and a new one
resumes it; every trial number ends up with exactly one (non-interrupted) result."""

from __future__ import annotations

import signal

import pytest

from api import store
from api.spec import SweepSpec
from api.sweeps import service as svc
from tests.helpers.coordinator import start_coordinator
from tests.helpers.devices_held import wait_for


@pytest.mark.slow
@pytest.mark.parametrize("backend_db", ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def test_killed_coordinator_resumes_with_every_trial_exactly_once(backend_db, tmp_path, request):
    url = f"sqlite:///{tmp_path / 'r.db'}" if backend_db == "sqlite" else request.getfixturevalue("fresh_pg_url")
    engine, sessions = store.open_store(url)
    spec = SweepSpec.model_validate({
        "model": "tiny", "cluster": "cpu-local", "training": {"global_batch": 16},
        "search": {"sampler": "tpe", "max_trials": 14, "warm_start_top_k": 2, "remeasure_top_k": 1, "repeats": 2},
        # 8 "devices" of capacity / 4 per trial: two trials in flight when the coordinator dies.
        "trial": {"options": {"sleep_s": 0.4}}, "backend": "tests.helpers.engine_backends:ScriptedBackend",
    })
    with sessions() as s:
        sweep_id = svc.create_sweep(s, spec=spec, owner="t").id

    def rows():
        with sessions() as s:
            return store.all_trials(s, sweep_id=sweep_id)

    first = start_coordinator(url, tmp_path)
    try:
        wait_for(lambda: sum(t.status == "completed" for t in rows()) >= 4 and any(t.status == "running" for t in rows()),
              60, "the first coordinator to be mid-sweep")
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    finally:
        if first.poll() is None:
            first.kill()
    running_at_kill = {t.number for t in rows() if t.status == "running"}
    assert running_at_kill

    second = start_coordinator(url, tmp_path)
    try:
        def done():
            with sessions() as s:
                return svc.get_sweep(s, sweep_id=sweep_id).status in store.FINISHED_SWEEP_STATUSES
        wait_for(done, 90, "the resumed sweep to finish")
    finally:
        second.send_signal(signal.SIGKILL)
        second.wait(10)
    with sessions() as s:
        final = svc.get_sweep(s, sweep_id=sweep_id)
    assert final.status == "completed", final.error
    all_rows = rows()
    live = [t for t in all_rows if t.status != "interrupted"]
    numbers = sorted(t.number for t in live)
    assert numbers == list(range(len(numbers))) == list(range(14 + 1))  # none lost, none twice
    assert all(t.status in store.TERMINAL_TRIAL_STATUSES for t in live)
    interrupted = [t for t in all_rows if t.status == "interrupted"]
    assert {t.number for t in interrupted} == running_at_kill
    for t in interrupted:  # the documented rule: re-run under the same number as attempt + 1
        rerun = next(x for x in live if x.number == t.number)
        assert rerun.attempt == t.attempt + 1 and rerun.layout_key == t.layout_key
    search_keys = [t.layout_key for t in live if t.phase == "search"]
    assert len(search_keys) == len(set(search_keys)) == 14
    engine.dispose()
