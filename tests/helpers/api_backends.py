"""A slow simulate backend for the coordinator restart test (loaded as ``tests.helpers.api_backends:SlowSimulate``),
and a noisy one (``tests.helpers.api_backends:NoisySimulate``) for what a sweep says of a host too noisy to rank on.

Real trials on 2 CPU cores take long enough to make a kill-and-restart test slow, so the restart test
runs the simulate backend (every result labelled ``simulated=True``) with ``trial.options.delay_s``
seconds of wall time per trial: long enough that a SIGKILL lands while a trial is running.
"""

from __future__ import annotations

import time

from workers.simulate import SimulateBackend


class SlowSimulate(SimulateBackend):
    name = "simulate"

    def capacity(self) -> int:
        return 1  # one trial at a time: a kill always finds finished trials and a running one

    def run(self, request):  # noqa: ANN001, ANN201 - the Backend protocol
        time.sleep(float(request.options.get("delay_s", 0.0)))
        return super().run(request)


class NoisySimulate(SimulateBackend):
    """The simulate backend on a busy host: repeats of one layout spread by 30% (the README's quick
    start measured 29% on a loaded machine), more than a ranking can be trusted with."""

    name = "simulate"

    def __init__(self, **kwargs) -> None:  # noqa: ANN003 - SimulateBackend's
        super().__init__(**{**kwargs, "noise": 0.3})
