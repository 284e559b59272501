"""A reused rank process keeps no thread of a past trial: after every trial — completed or failed —
no gloo thread is left ("pt_gloo_runloop", "gloo_tcp_loop": native, so counted from
/proc/self/task), and the process's thread count stays that of after its first trial.

torch's DTensor caches (sharding propagation, redistribution plans, mesh topology) used to keep
every trial's ``DeviceMesh`` and so its gloo groups alive; each trial of a new mesh shape left ~16
threads per rank behind, hundreds after a test run, each polling (workers/_launch.py
``release_mesh_caches``)."""

from __future__ import annotations

import pytest
import ray

from tuner import Layout, cluster_spec, model_spec, training_spec
from workers import TrialRequest

# Ray's own threads come and go by one or two (gRPC, its event loops); a leaked trial is ~16 per rank.
MARGIN = 3

# Distinct mesh shapes (a cache hit on an equal mesh would not show a leak), each through DTensor
# (tensor parallel, FSDP2), one of them a failed trial (NaN on every rank: all ranks return, none killed).
TRIALS = [
    (Layout(tp=2), {}, "completed"),
    (Layout(dp=2), {"fail": "nan", "fail_step": 1}, "nan"),
    (Layout(tp=2, zero=3), {}, "completed"),
    (Layout(cp=2), {}, "completed"),
]


def _request(layout: Layout, options: dict) -> TrialRequest:
    return TrialRequest(
        model=model_spec("tiny"),
        cluster=cluster_spec({"preset": "cpu-local", "devices_per_node": 2}),
        training=training_spec({"global_batch": 4}),
        layout=layout,
        warmup_steps=1,
        measure_steps=1,
        step_timeout_s=120,
        options=options,
    )


def _census() -> tuple[list[int], list[dict[str, int]]]:
    """(pid, threads by name) of each rank process of the 2-rank gang."""
    from workers._gangs import POOL

    (gang,) = [g for g in POOL._gangs if g.key == ("CPU", (2,))]
    return [s.info["pid"] for s in gang.ranks], ray.get([s.actor.threads.remote() for s in gang.ranks])


@pytest.mark.timeout(900)  # hang guard: fresh actors start slowly on a loaded machine
def test_reused_rank_processes_keep_no_gloo_thread_of_past_trials(ray_backend) -> None:
    pids: list[int] | None = None
    totals: list[list[int]] = []  # [trial][rank]: threads of the rank process after the trial
    gloo: list[list[dict[str, int]]] = []  # [trial][rank]: its gloo threads by name
    for k, (layout, options, status) in enumerate(TRIALS, start=1):
        result = ray_backend.run(_request(layout, options))
        assert result.status == status, (layout.key, result.error)
        now_pids, census = _census()
        pids = pids or now_pids
        assert now_pids == pids, f"trial {k} replaced a rank process: the test needs them reused"
        totals.append([sum(threads.values()) for threads in census])
        gloo.append([{n: c for n, c in threads.items() if "gloo" in n} for threads in census])
    first = totals[0]
    assert all(t <= f + MARGIN for later in totals[1:] for t, f in zip(later, first, strict=True)), (
        f"threads per rank after trials 1..{len(TRIALS)}: {totals}"
    )
    assert all(g == {} for after in gloo for g in after), f"gloo threads per rank after trials 1..: {gloo}"
