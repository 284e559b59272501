"""The planner's entries are the ones it gave before it was restructured for speed: every entry of
every list in order, every number exact, and the rejections counted by reason (tests/helpers/plan_golden.py
says how the snapshot was taken and when to rewrite it)."""

from __future__ import annotations

import gc

import pytest

import tuner._memory
from tests.helpers import plan_golden as golden
from tuner import Layout, PlannedLayout, enumerate_layouts, estimate_memory, estimate_time, plan

GOLDEN = golden.load()
SUITE = [name for name in golden.PROBLEMS if not name.startswith("llama3-405b")]  # those: benchmarks/bench_plan.py


@pytest.mark.parametrize("name", SUITE)
def test_plan_entries_equal_the_golden_ones(name: str) -> None:
    got, want = golden.compute(name), GOLDEN[name]
    for field in ("feasible", "infeasible", "rejected", "twins"):
        assert got[field] == want[field], field
    for lst in ("entries", "infeasible_entries"):
        assert got[f"{lst}_first"] == want[f"{lst}_first"], lst  # readable when it differs
        assert got[f"{lst}_sha256"] == want[f"{lst}_sha256"], f"{lst}: an entry past the first {golden.KEPT_WHOLE} differs"


def test_entries_equal_the_per_layout_estimators() -> None:
    """The plan costs every layout at once on arrays; the public estimators one at a time, through the
    same functions on numbers: the same numbers."""
    problem, opts = golden.problem("dense-shapes-mi300x")
    model, cluster, training = problem.model, problem.cluster, problem.training
    p = plan(problem=problem, **opts)
    kw = {"model": model, "cluster": cluster, "training": training}
    for e in p.entries[::5] + p.infeasible[::5]:
        assert e.memory == estimate_memory(e.layout, **kw)
        assert e.time == estimate_time(e.layout, placement=e.placement, **kw)


def test_plan_does_no_work_per_layout_that_a_mesh_shares(monkeypatch) -> None:
    """Planning's speed is its structure: one Realisation per mesh (not one per mesh, ZeRO level,
    mbs and schedule), and no object per layout until an entry is read."""
    problem, opts = golden.problem("llama3-8b-h100x4")
    meshes = {(x.tp, x.cp, x.ep, x.dp, x.pp, x.vpp) for x in enumerate_layouts(problem=problem).valid}
    calls = []
    realise = tuner._memory.realise
    monkeypatch.setattr(tuner._memory, "realise", lambda *a, **k: calls.append(1) or realise(*a, **k))
    tuner._memory.mesh_memory.cache_clear()

    def alive() -> tuple[int, int]:
        objects = gc.get_objects()
        return sum(type(o) is Layout for o in objects), sum(type(o) is PlannedLayout for o in objects)

    before = alive()
    p = plan(problem=problem, **opts)
    made = tuple(a - b for a, b in zip(alive(), before, strict=True))
    assert len(p.entries) + len(p.infeasible) > 10 * len(meshes) and len(calls) <= len(meshes)
    assert made == (0, 0), made
    assert p.entries[0].layout.key and alive()[1] == before[1] + 1  # the entry read, and only it
