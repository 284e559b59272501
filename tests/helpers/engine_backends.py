"""Test backends for the engine (importable as ``tests.helpers.engine_backends:...`` with tests/ on sys.path).

``ScriptedBackend`` answers like the simulate backend (results stay labelled simulated) but lets a
spec's ``trial.options`` inject what real runs do: a slow step (``sleep_s``), an OOM the memory model
did not predict (``oom_tp``: every layout with that tp), a crash (``crash_pp``).
"""

from __future__ import annotations

import os
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


class LoggedSimulate:
    """The simulate backend on the coordinator's simulated cluster (``MESHTUNE_SIMULATE_DEVICES``,
    ``MESHTUNE_SIMULATE_PACE``: trials hold their devices for a while), appending each trial's start
    and end (trial id, process id, time) to the file ``MESHTUNE_TEST_RUN_LOG`` names, so a test can
    audit what every coordinator process ran. Results stay labelled simulated."""

    name = "simulate"

    def __init__(self) -> None:
        from api.settings import Settings

        settings = Settings()
        self.sim = SimulateBackend(seed=0, devices=settings.simulate_devices, pace=settings.simulate_pace)
        self.log = os.environ["MESHTUNE_TEST_RUN_LOG"]

    def capacity(self) -> int:
        return self.sim.capacity()

    def close(self) -> None:
        return None

    def _note(self, what: str, trial_id: str) -> None:
        with open(self.log, "a") as f:  # one short write per line: appends from processes do not interleave
            f.write(f"{what} {trial_id} {os.getpid()} {time.time():.6f}\n")

    def run(self, request):
        self._note("start", request.trial_id)
        result = self.sim.run(request)
        self._note("end", request.trial_id)
        return result
