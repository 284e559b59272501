"""Stored sweeps for the dashboard tests, written through the store functions the engine uses.

Numbers come from the ``simulate`` backend (the tuner's analytical model with seeded noise) over a
grid of valid layouts of llama3-8b on 4 nodes of 8 H100, so every row is labelled simulated. The
simulate backend trains nothing; to give the loss and stage charts something to draw, ``rich=True``
adds to completed pipeline trials the partitioner's per-stage share of the step time and to every
completed trial a seeded test loss curve — test fixtures, stored with ``simulated=True`` like the
rest. ``rich=True`` also stores one trial of each failure the engine records (timeout, crash, NaN),
with the error text a worker would send.
"""

from __future__ import annotations

import itertools
import math
import random
from datetime import datetime, timedelta, timezone
from typing import Any

import sqlalchemy as sa

import tuner
from api import store
from api.ranking import service as rankings
from api.spec import SweepSpec
from api.sweeps import service
from tuner import Layout, LayoutError, check_layout
from workers import TrialError, TrialRequest, TrialResult
from workers.simulate import SimulateBackend

SPEC = {
    "model": "llama3-8b",
    "cluster": {"preset": "h100-sxm", "nodes": 4},
    "training": {"global_batch": 64, "precision": "bf16"},
    "backend": "simulate",
}


def valid_layouts(model, cluster, training) -> list[Layout]:
    out = []
    for tp, pp, cp, zero, mbs, ac in itertools.product(
        (1, 2, 4, 8), (1, 2, 4, 8), (1, 2), (0, 1, 2, 3), (1, 2, 4), ("none", "selective", "full")
    ):
        if cluster.devices % (tp * pp * cp):
            continue
        dp = cluster.devices // (tp * pp * cp)
        scheds = [("1f1b", 1), ("gpipe", 1), ("interleaved", 2)] if pp > 1 else [("1f1b", 1)]
        for sp, (sched, vpp) in itertools.product((False, True) if tp > 1 else (False,), scheds):
            try:
                lay = Layout(tp=tp, pp=pp, dp=dp, cp=cp, zero=zero, mbs=mbs, ac=ac, sp=sp, schedule=sched, vpp=vpp)
                check_layout(lay, model=model, cluster=cluster, training=training)
            except LayoutError:
                continue
            out.append(lay)
    return out


def seed_sweep(
    sessions, *, n_trials: int, name: str, rich: bool = False, status: str = "completed",
    owner: str = "alice", seed: int = 0,
) -> int:
    """Store a sweep of ``n_trials`` trials (plus 2 re-measurements of the top 3); returns its id."""
    spec = SweepSpec.model_validate(SPEC | {"name": name, "search": {"max_trials": n_trials}})
    problem = spec.to_problem()
    model, cluster, training = problem.model, problem.cluster, problem.training
    rng = random.Random(seed)
    layouts = valid_layouts(model, cluster, training)
    rng.shuffle(layouts)
    assert len(layouts) >= n_trials, f"only {len(layouts)} valid layouts"
    backend = SimulateBackend(seed=seed)
    t0 = datetime(2026, 11, 28, 22, 0, tzinfo=timezone.utc)
    lanes = [t0] * 4  # four trials at a time
    with store.session_scope(sessions) as session:
        sweep = service.create_sweep(session, spec=spec, owner=owner)
        sid = sweep.id
        done: list[tuple[float, Layout]] = []
        failures = ["nan", "crash", "timeout"]
        times: dict[int, tuple[datetime, datetime | None]] = {}
        for number in range(n_trials + 6):
            phase, repeat = "search", 0
            if number < n_trials:
                lay = layouts[number]
            else:  # re-measure the top 3 twice each, as the engine does
                if number == n_trials:
                    top3 = [lay for _, lay in sorted(done, key=lambda x: -x[0])[:3]]
                lay = top3[(number - n_trials) % 3]
                phase, repeat = "remeasure", 1 + (number - n_trials) // 3
            result = backend.run(TrialRequest(model=model, cluster=cluster, training=training, layout=lay,
                                              trial_id=f"{sid}-{number}", seed=seed))
            ws = lay.world_size
            mem = tuner.estimate_memory(lay, model=model, cluster=cluster, training=training)
            est = tuner.estimate_time(lay, model=model, cluster=cluster, training=training)
            if result.status == "oom" and phase == "search" and number % 2 == 0:  # the model prunes it
                store.insert_trial(session, sweep_id=sid, number=number, layout=lay.__dict__.copy(),
                                   layout_key=lay.key, world_size=ws, status="pruned",
                                   cause=f"predicted {result.peak_memory_bytes} bytes > device memory",
                                   predicted_memory_bytes=result.peak_memory_bytes, phase=phase)
                lane = min(range(4), key=lanes.__getitem__)
                times[number] = (lanes[lane], None)
                continue
            if rich and result.ok and phase == "search" and number > 2 and failures:
                kind = failures.pop()
                result = TrialResult(status=kind, backend="simulate", simulated=True, env=result.env,
                                     error=TrialError(kind=kind, message=_MESSAGES[kind], rank=1,
                                                      exception_type=_EXC[kind]),
                                     wall_s=0.5, device_seconds=30.0 * ws)
            if rich and result.ok:
                _add_fixture_curves(result, lay, model, rng)
            store.insert_trial(session, sweep_id=sid, number=number, layout=lay.__dict__.copy(), layout_key=lay.key,
                               world_size=ws, phase=phase, repeat=repeat, backend="simulate",
                               predicted_memory_bytes=int(mem.total), predicted_step_time_s=est.step_time_s,
                               predicted_tokens_per_s_per_device=est.tokens_per_s_per_device)
            store.record_result(session, sweep_id=sid, number=number, attempt=0, result=result)
            lane = min(range(4), key=lanes.__getitem__)
            secs = (result.device_seconds or 0.0) / ws or 1.0
            start, lanes[lane] = lanes[lane], lanes[lane] + timedelta(seconds=secs + 1.0)
            times[number] = (start, start + timedelta(seconds=secs))
            if result.ok:
                done.append((result.tokens_per_s_per_device, lay))
        _set_times(session, sid, times)
        store.refresh_sweep_cache(session, sweep_id=sid)
        store.set_sweep_status(session, sweep_id=sid, status="running")
        if status != "running":
            store.set_sweep_status(session, sweep_id=sid, status=status)
    return sid


_MESSAGES = {
    "timeout": "step 3 took longer than step_timeout_s=120.0 (watchdog)",
    "crash": "RuntimeError: injected crash on rank 1",
    "nan": "loss became NaN at step 2",
}
_EXC = {"timeout": "TimeoutError", "crash": "RuntimeError", "nan": "FloatingPointError"}


def _set_times(session, sweep_id: int, times: dict[int, tuple[datetime, datetime | None]]) -> None:
    """Spread the trials over a night, four at a time (one bulk UPDATE by primary key)."""
    ids = dict(session.execute(sa.select(store.Trial.number, store.Trial.id).where(store.Trial.sweep_id == sweep_id)).all())
    session.execute(sa.update(store.Trial), [
        {"id": ids[n], "started_at": start if end else None, "finished_at": end or start, "created_at": start}
        for n, (start, end) in times.items()
    ])


def _add_fixture_curves(result: TrialResult, lay: Layout, model, rng: random.Random) -> None:
    from tuner import partition_stages

    if lay.pp > 1:
        part = partition_stages(model, lay.stages)
        total = sum(part.stage_costs)
        per_rank = [0.0] * lay.pp
        for s, c in enumerate(part.stage_costs):
            per_rank[s % lay.pp] += c / total
        result.stage_times_s = [result.step_time_s * f for f in per_rank]
        result.stage_imbalance = max(per_rank) / (sum(per_rank) / lay.pp)
    result.losses = [5.6 * math.exp(-0.08 * i) + 0.2 + rng.gauss(0, 0.003) for i in range(5)]


def add_running_trial(sessions, *, sweep_id: int, tokens: float, peak: int) -> None:
    """A new completed measurement of a layout not measured before (for the live-refresh test)."""
    with store.session_scope(sessions) as session:
        sweep = service.get_sweep(session, sweep_id=sweep_id)
        spec = SweepSpec.model_validate(sweep.spec)
        problem = spec.to_problem()
        model, cluster, training = problem.model, problem.cluster, problem.training
        taken = {t.layout_key for t in store.all_trials(session, sweep_id=sweep_id)}
        lay = next(x for x in valid_layouts(model, cluster, training) if x.key not in taken)
        number = store.next_number(session, sweep_id=sweep_id)
        store.insert_trial(session, sweep_id=sweep_id, number=number, layout=lay.__dict__.copy(), layout_key=lay.key,
                           world_size=lay.world_size, backend="simulate")
        store.record_result(session, sweep_id=sweep_id, number=number, attempt=0, result=TrialResult(
            status="completed", backend="simulate", simulated=True, step_time_s=1.0, step_times_s=[1.0],
            tokens_per_s_per_device=tokens, tokens_per_s=tokens * lay.world_size, peak_memory_bytes=peak,
            device_seconds=5.0 * lay.world_size))
        store.refresh_sweep_cache(session, sweep_id=sweep_id)


def summary_of(sessions, sweep_id: int) -> dict[str, Any]:
    """What the charts should show, read back through the services."""
    with sessions() as session:
        ranking = rankings.ranking(session, sweep_id=sweep_id)
        pareto = service.pareto(session, sweep_id=sweep_id)
        trials = store.all_trials(session, sweep_id=sweep_id)
    return {
        "ranking": ranking,
        "pareto": pareto,
        "statuses": sorted({t.status for t in trials}),
        "n_trials": len(trials),
        "best": max(r.median for r in ranking.rows),
    }


# --- migration (reshard) checks ---------------------------------------------------------------------

# backend "ray": a migration check runs real ranks, so it is refused on simulate-backend sweeps
# (api.reshard.service.refusal); the stored numbers are still the simulate backend's, labelled so.
MIGRATION_SPEC = {"model": "tiny-moe", "cluster": "cpu-local", "backend": "ray",
                  "training": {"global_batch": 8, "precision": "fp32"}, "search": {"max_trials": 4}}
# Ranked layouts of that sweep; the expert-parallel one is refused by the reshard check (ep>1: 422).
MIGRATION_LAYOUTS = (Layout(dp=4), Layout(tp=2, dp=2), Layout(pp=2, dp=2), Layout(ep=2, dp=2))


def seed_migration_sweep(sessions, *, name: str = "tiny-moe on 4 CPU ranks", seed: int = 3) -> int:
    """A finished sweep of tiny-moe on cpu-local (backend ray) whose ranking holds
    ``MIGRATION_LAYOUTS``, one simulated measurement each (labelled simulated like every seeded
    result); returns its id."""
    spec = SweepSpec.model_validate(MIGRATION_SPEC | {"name": name})
    problem = spec.to_problem()
    model, cluster, training = problem.model, problem.cluster, problem.training
    backend = SimulateBackend(seed=seed)
    with store.session_scope(sessions) as session:
        sid = service.create_sweep(session, spec=spec, owner="alice").id
        for number, lay in enumerate(MIGRATION_LAYOUTS):
            store.insert_trial(session, sweep_id=sid, number=number, layout=lay.__dict__.copy(), layout_key=lay.key,
                               world_size=lay.world_size, backend="simulate")
            result = backend.run(TrialRequest(model=model, cluster=cluster, training=training, layout=lay,
                                              trial_id=f"{sid}-{number}", seed=seed))
            assert result.ok, result
            store.record_result(session, sweep_id=sid, number=number, attempt=0, result=result)
        store.refresh_sweep_cache(session, sweep_id=sid)
        store.set_sweep_status(session, sweep_id=sid, status="running")
        store.set_sweep_status(session, sweep_id=sid, status="completed")
    return sid


def seed_measured_sweep(sessions, measurements, *, name: str, backend: str = "ray", predicted=None) -> int:
    """A finished sweep of tiny on cpu-local holding exactly ``measurements`` ((Layout, [tokens/s per
    device, ...]) pairs, one trial per value, in order). TEST FIXTURE numbers chosen by the test,
    stored as the engine stores a result; ``simulated`` (and the trials' backend) follow ``backend``.
    ``predicted``: {layout key: predicted tokens/s per device} for prediction-error displays."""
    spec = SweepSpec.model_validate({"name": name, "model": "tiny", "cluster": "cpu-local", "backend": backend,
                                     "training": {"global_batch": 8, "precision": "fp32"}})
    simulated = backend == "simulate"
    with store.session_scope(sessions) as session:
        sid = service.create_sweep(session, spec=spec, owner="alice").id
        number = 0
        for lay, values in measurements:
            for repeat, tokens in enumerate(values):
                store.insert_trial(session, sweep_id=sid, number=number, layout=lay.__dict__.copy(),
                                   layout_key=lay.key, world_size=lay.world_size, backend=backend, repeat=repeat,
                                   phase="search" if repeat == 0 else "remeasure",
                                   predicted_memory_bytes=3 * 2**30,
                                   predicted_tokens_per_s_per_device=(predicted or {}).get(lay.key))
                store.record_result(session, sweep_id=sid, number=number, attempt=0, result=TrialResult(
                    status="completed", backend=backend, simulated=simulated, step_time_s=1.0, step_times_s=[1.0],
                    tokens_per_s_per_device=tokens, tokens_per_s=tokens * lay.world_size,
                    peak_memory_bytes=2 * 2**30, wall_s=2.0, device_seconds=2.0 * lay.world_size,
                    env={"hosts": ["node-a", "node-b"], "world_size": lay.world_size}))
                number += 1
        store.refresh_sweep_cache(session, sweep_id=sid)
        store.set_sweep_status(session, sweep_id=sid, status="running")
        store.set_sweep_status(session, sweep_id=sid, status="completed")
    return sid


class StubReshardRunner:
    """TEST STUB of the reshard-check runner (``app.state.reshard_runner``): it runs nothing. The
    real endpoint validates the request and stores what this returns; the stub records the jobs it
    was handed and answers a fixed "ok" report marked ``backend="test-stub"`` (after ``delay_s``, so
    a page can be seen waiting). The real runner (DCP save/load on Ray) is tested in test_reshard.py."""

    BACKEND = "test-stub"

    def __init__(self, delay_s: float = 0.0) -> None:
        self.jobs: list[Any] = []
        self.delay_s = delay_s

    def __call__(self, job: Any) -> Any:
        import time
        from dataclasses import asdict

        from workers.reshard import ReshardReport, tolerance

        self.jobs.append(job)
        time.sleep(self.delay_s)
        losses = [5.5 - 0.1 * i for i in range(job.steps_before + job.steps_after)]
        return ReshardReport(
            verdict="ok", from_layout=asdict(job.from_layout), to_layout=asdict(job.to_layout),
            steps_before=job.steps_before, steps_after=job.steps_after, tolerance=tolerance(job),
            tensors_checked=24, max_abs_diff=0.0, losses_before=losses[:job.steps_before],
            losses_a=losses[job.steps_before:], losses_b=losses[job.steps_before:], max_rel_loss_diff=0.0,
            backend=self.BACKEND, save_s=0.01, load_s=0.02, wall_s=self.delay_s,
        )
