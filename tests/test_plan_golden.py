"""The planner's entries are the ones it gave before it was restructured for speed: every entry of
every list in order, every number exact, and the rejections counted by reason (tests/_plan_golden.py
says how the snapshot was taken and when to rewrite it)."""

from __future__ import annotations

import pytest

from tests import _plan_golden as golden
from tuner import estimate_memory, estimate_time, plan

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
    model, cluster, training, opts = golden.problem("dense-shapes-mi300x")
    p = plan(model=model, cluster=cluster, training=training, **opts)
    kw = {"model": model, "cluster": cluster, "training": training}
    for e in p.entries[::5] + p.infeasible[::5]:
        assert e.memory == estimate_memory(e.layout, **kw)
        assert e.time == estimate_time(e.layout, placement=e.placement, **kw)
