"""CPU of one refresh of a *running* sweep's dashboard state (api/dashboard/data.py), from scratch
(what every LIVE_TTL_S expiry cost before the state was kept) against the incremental refresh.

Stores one running sweep of ``--trials`` rows in a temporary SQLite file (benchmarks/
bench_api_latency.py's bulk seed: 40% pruned, 40% measured once, 20% re-measurements), then, in
process, the median over ``--repeats`` of the CPU time (``time.process_time``: the coordinator's
cost, less sensitive than wall time to other processes on a shared machine) of:

    scratch    data._read_state: every trial read and formatted, the ranking read
    unchanged  a refresh that finds nothing new (the same state comes back)
    started    a refresh after a trial started (a new "running" row)
    finished   a refresh after that trial recorded its result (the ranking's tag moves: it is read again)

Each changed refresh is checked against a from-scratch read (the dicts, less the version).

    python benchmarks/bench_dashboard_live.py [--trials 10000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_api_latency import seed  # noqa: E402

from api import store  # noqa: E402
from api.dashboard import data  # noqa: E402
from api.sweeps import service  # noqa: E402
from workers import TrialResult  # noqa: E402


def _cpu(fn) -> tuple[float, object]:
    t = time.process_time()
    out = fn()
    return time.process_time() - t, out


def _bare(state: dict) -> dict:
    return {k: v for k, v in state.items() if k != "version"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{os.path.join(tmp, 'bench.db')}"
        sid = seed(url, args.trials)
        engine, sessions = store.open_store(url)
        with store.session_scope(sessions) as s:  # seed() leaves it completed: running again
            s.execute(store.Sweep.__table__.update().where(store.Sweep.id == sid)
                      .values(status="running", finished_at=None))
        out: dict[str, list[float]] = {"scratch": [], "unchanged": [], "started": [], "finished": []}
        with sessions() as s:
            sweep = service.describe_sweep(s, sweep_id=sid)
            for _ in range(args.repeats):
                out["scratch"].append(_cpu(lambda: data._read_state(s, sweep))[0])
            kept = data._kept(sweep)
            kept.refresh(s, sweep, data.sweep_header(sweep, kept.prob))
            for _ in range(args.repeats):
                out["unchanged"].append(_cpu(lambda: kept.refresh(s, sweep, data.sweep_header(sweep, kept.prob)))[0])
            row = service.list_trials(s, sweep_id=sid, status="completed", limit=1).items[0]
        for i in range(args.repeats):
            with store.session_scope(sessions) as s:
                number = store.next_number(s, sweep_id=sid)
                store.insert_trial(s, sweep_id=sid, number=number, layout=dict(row.layout),
                                   layout_key=row.layout_key, world_size=row.world_size, repeat=3 + i,
                                   phase="remeasure", backend="simulate")
            for kind in ("started", "finished"):
                if kind == "finished":
                    with store.session_scope(sessions) as s:
                        store.record_result(s, sweep_id=sid, number=number, attempt=0, result=TrialResult(
                            status="completed", backend="simulate", simulated=True, step_time_s=1.0,
                            step_times_s=[1.0], tokens_per_s_per_device=1000.0 + i, tokens_per_s=8000.0,
                            peak_memory_bytes=2**30, device_seconds=8.0))
                        store.refresh_sweep_cache(s, sweep_id=sid)
                with sessions() as s:
                    now = service.describe_sweep(s, sweep_id=sid)
                    seconds, state = _cpu(lambda: kept.refresh(s, now, data.sweep_header(now, kept.prob)))  # noqa: B023
                    out[kind].append(seconds)
                    assert _bare(state) == _bare(data._read_state(s, now)), f"{kind}: the kept state differs"
        engine.dispose()
    print(f"{args.trials} trials, CPU per refresh (median of {args.repeats}), load {os.getloadavg()[0]:.2f}:")
    for name, values in out.items():
        print(f"  {name:10s} {statistics.median(values) * 1000:8.1f} ms")


if __name__ == "__main__":
    main()
