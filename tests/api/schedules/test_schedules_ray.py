"""A slowdown injected into real runs (Ray, CPU rank on gloo, the tiny model) is flagged as a
regression naming the layout, its drop with an interval and the environment, and the alert reaches a
webhook on 127.0.0.1. Two baseline nights, so the production test (tonight against the past nightly
means, default ``min_history_nights=2``) is the one that runs. The simulate backend ignores ``sleep_per_step_s``, so these runs are real.

Load-proof: with two past nights the test has one degree of freedom (t_0.975 = 12.7), so a tonight's
drop is flagged only if it is ~15x the spread of the two nightly means, and on a loaded machine the
tiny model's real compute time (~0.02 s idle, up to ~100x that under load) varies by more than
that between nights. Every night therefore pads each step to ``FLOOR_S`` (``min_step_s``, real
sleeps inside the timed step): the baseline step time is the floor whatever the load, as long as
the compute fits in it, and tonight's injected ``sleep_per_step_s`` comes on top of the compute, so
tonight's tokens/s are at most FLOOR_S / SLEEP_S of the baseline whatever the load does."""

from __future__ import annotations

from pathlib import Path

import pytest

from api import store
from api.engine import SweepRunner
from api.schedules import Scheduler, _store
from api.schedules import service as svc
from api.schedules._launch import pinned_space
from api.schedules.schemas import ScheduleIn
from api.settings import Settings
from tuner import Layout
from workers.ray_backend import RayBackend

LAYOUT = Layout()  # one CPU rank: tp=pp=dp=1
# Every night's step floor. A tiny-model step on one CPU rank computes in ~0.02-0.1 s on an idle machine;
# with both cores busy (two busy loops and the other tests) it was measured at 0.2-1.9 s.
FLOOR_S = 3.0
SLEEP_S = 6.0  # tonight's injected slowdown: a step >= SLEEP_S, so tokens/s <= FLOOR_S / SLEEP_S of the baseline
TEMPLATE = {
    "name": "nightly-real", "model": "tiny", "cluster": {"preset": "cpu-local", "devices_per_node": 1},
    "training": {"global_batch": 4, "precision": "fp32"}, "space": pinned_space(LAYOUT),
    "search": {"sampler": "grid", "max_trials": 1, "warm_start_top_k": 0, "repeats": 2, "remeasure_top_k": 1},
    "trial": {"warmup_steps": 1, "measure_steps": 1, "step_timeout_s": 60, "options": {"min_step_s": FLOOR_S}},
    "backend": "ray",
}


class KeptOpen:
    """The Ray backend, left open when a sweep ends (the test closes it)."""

    name = "ray"

    def __init__(self, backend: RayBackend) -> None:
        self.backend = backend

    def run(self, request):
        return self.backend.run(request)

    def capacity(self) -> int:
        return self.backend.capacity()

    def close(self) -> None:
        return None


@pytest.mark.slow
@pytest.mark.timeout(600)  # a hang guard: on a loaded machine starting the rank process alone took ~2 min
def test_injected_slowdown_in_real_runs_is_flagged_and_posted(tmp_path: Path, ray_local, webhook_receiver,
                                                               monkeypatch) -> None:
    monkeypatch.setenv("MESHTUNE_WEBHOOK_ALLOW_PRIVATE", "true")  # the receiver is on 127.0.0.1
    url = f"sqlite:///{tmp_path / 'meshtune.db'}"
    engine, sessions = store.open_store(url)
    # One trial at a time (no trial slows another down), on one warm backend for the three nights: a
    # sweep's end frees its idle rank processes, and re-starting them (import torch) takes a minute
    # on a loaded machine.
    warm = RayBackend()
    runner = SweepRunner(Settings(database_url=url, backend="ray", max_concurrent_trials=1), sessions=sessions,
                         backend_factory=lambda spec: KeptOpen(warm))
    scheduler = Scheduler(sessions=sessions, replica_id="r1")
    with sessions() as s:
        sid = svc.create_schedule(s, data=ScheduleIn(name="real", cron="0 2 * * *", template=TEMPLATE,
                                                     webhook_url=webhook_receiver.url), owner="t").id

    def night() -> int:
        with sessions() as s:
            fire = svc.run_now(s, schedule_id=sid, by="test")
        for sweep_id in fire.sweep_ids:
            assert runner.run_sweep(sweep_id).status == "completed"
        assert scheduler.tick().finished == [fire.id]
        return fire.id

    try:
        baseline = [night(), night()]  # two nights: the default policy tests against nightly means
        options = {"min_step_s": FLOOR_S, "sleep_per_step_s": SLEEP_S}  # the same floor, plus the slowdown
        slow = dict(TEMPLATE, trial={**TEMPLATE["trial"], "options": options})
        with store.session_scope(sessions) as s:  # what changed tonight: a slower step (e.g. a driver)
            _store.update_schedule(s, schedule_id=sid, values={"template": slow})
        tonight = night()
        with sessions() as s:
            before = _store.get_fire(s, fire_id=baseline[-1])
            fire = _store.get_fire(s, fire_id=tonight)
            measured = _store.fire_measurements(s, sweep_ids=fire.sweep_ids)
            history = [t for f in baseline
                       for t in _store.fire_measurements(s, sweep_ids=_store.get_fire(s, fire_id=f).sweep_ids)]
            alerts = _store.list_alerts(s, schedule_id=sid)[0]
    finally:
        warm.close()
        engine.dispose()

    assert len(measured) == 2 and not any(t.simulated for t in measured)
    assert all(t.step_time_s > SLEEP_S for t in measured)  # the sleep really was in the timed steps
    assert len(history) == 4 and all(t.step_time_s >= FLOOR_S for t in history)  # the floor in the baseline's
    assert before.env["torch"] and before.env["device_kind"] == "cpu" and before.env["hosts"]
    assert fire.env_changes == {}  # same machine, same software: nothing to blame but the change itself
    (c,) = fire.comparisons
    assert c["layout"] == LAYOUT.key and c["verdict"] == "regression" and c["tonight_n"] == 2
    assert c["method"] == "nightly-means" and c["history_nights"] == 2 and c["history_n"] == 4
    assert c["ratio_low"] < c["ratio"] < c["ratio_high"] < 1.0 and c["ratio"] < 0.6

    (alert,) = alerts
    assert alert.kind == "regression" and alert.layout_key == LAYOUT.key and alert.ratio == pytest.approx(c["ratio"])
    assert LAYOUT.key in alert.message and "slower" in alert.message and "fingerprint unchanged" in alert.message
    assert alert.delivery_status == "delivered"
    (post,) = webhook_receiver.received
    body = post["json"]
    assert body["fire"]["id"] == tonight and body["alerts"][0]["layout"] == LAYOUT.key
    assert body["alerts"][0]["ratio_high"] < 1.0 and body["alerts"][0]["change"] < -0.4
