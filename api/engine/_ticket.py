"""One trial attempt in flight, as the sweep loop (api/engine/_loop.py) launches it and the loop's
outage handling (api/engine/_outage.py) re-runs it."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from api.engine._share import Grant
from tuner import Layout


@dataclass
class Ticket:
    number: int
    attempt: int
    layout: Layout
    phase: str
    handle: Any  # the asked Optuna trial, or None
    future: Future | None = None
    grant: Grant | None = None  # its devices in the coordinator's ledger (api/engine/_share.py)
    cancelled: bool = False  # the sweep was cancelled and the backend told to stop this trial
