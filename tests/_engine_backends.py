"""Test backends for the engine (importable as ``_engine_backends:...`` with tests/ on sys.path).

``ScriptedBackend`` answers like the simulate backend (results stay labelled simulated) but lets a
spec's ``trial.options`` inject what real runs do: a slow step (``sleep_s``), an OOM the memory model
did not predict (``oom_tp``: every layout with that tp), a crash (``crash_pp``).
"""

from __future__ import annotations

import time

from workers import TrialError, TrialResult
from workers.simulate import SimulateBackend


class ScriptedBackend:
    name = "scripted"

    def __init__(self, capacity: int = 8) -> None:
        self.sim = SimulateBackend(seed=0)
        self._capacity = capacity
        self.calls: list[str] = []

    def capacity(self) -> int:
        return self._capacity

    def close(self) -> None:
        return None

    def run(self, request):
        opts = request.options
        self.calls.append(request.layout.key)
        time.sleep(float(opts.get("sleep_s", 0.0)))
        if opts.get("oom_tp") == request.layout.tp:
            return TrialResult(status="oom", backend=self.name, simulated=True, peak_memory_bytes=request.cluster.device_memory + 1,
                               error=TrialError(kind="oom", message="scripted OOM", bytes_requested=2**20),
                               device_seconds=1.0)
        if opts.get("crash_pp") == request.layout.pp:
            return TrialResult(status="crash", backend=self.name, simulated=True,
                               error=TrialError(kind="crash", message="scripted crash", rank=0), device_seconds=1.0)
        return self.sim.run(request)
