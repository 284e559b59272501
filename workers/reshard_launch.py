"""Run a reshard check on the trials' backend: ``run_reshard_check(job) -> ReshardReport``.

The Ray path is the trials' own machinery, ``RayBackend.run_program``: the same validation, the
same pooled gang of reused ``RankWorker`` actors (workers/_gangs.py), the same per-rank set-up and
clean-up (``workers._launch.run_rank``, running ``reshard_rank`` instead of a trial) and the same
watchdog. Both layouts run in one launch of one world size: the cluster fixes the world size, and
every layout of it fits the same gang.

A check that cannot run (a bad layout, no room on Ray) raises before any process starts; a check
whose ranks fail (crash, oom, timeout) is a ``ReshardReport`` with verdict "failed".
"""

from __future__ import annotations

import functools
import shutil
import tempfile
from typing import Any

from workers.reshard import ReshardJob, ReshardReport, failed_report, report_from_ranks


def _program(job: ReshardJob, request: Any, *, device: Any) -> Any:
    """``run_rank``'s program signature around ``reshard_rank`` (module level: picklable)."""
    from workers.reshard_rank import reshard_rank  # torch: imported on the rank, not by the coordinator

    return reshard_rank(job, device=device)


def run_reshard_check(job: ReshardJob, *, backend: Any = None) -> ReshardReport:
    """Run ``job`` on Ray (``backend``: a ``RayBackend``; default a new one, closed after)."""
    from workers.ray_backend import RayBackend

    job.validate()
    own = backend is None
    backend = backend or RayBackend()
    if not isinstance(backend, RayBackend):
        raise TypeError(f"reshard-check runs on the Ray backend, got {type(backend).__name__}")
    try:
        out = backend.run_program(job.request(job.from_layout), functools.partial(_program, job))
    finally:
        if own:
            backend.close()
    error = out.error
    if error is not None:
        where = f" on rank {error.rank}" if error.rank is not None else ""
        text = f"{error.kind}{where}: {error.message}"
        if error.traceback_tail:
            text += "\n" + error.traceback_tail[-2000:]
        return failed_report(job, text, backend="ray", wall_s=out.wall_s)
    return report_from_ranks(job, out.reports, backend="ray", wall_s=out.wall_s)


def run_with_temp_checkpoint(job: ReshardJob, *, backend: Any = None, keep: bool = False) -> ReshardReport:
    """``run_reshard_check`` with the checkpoint in a fresh temporary directory (removed unless
    ``keep``); for one machine, or a temp dir on storage every node shares."""
    from dataclasses import replace

    path = tempfile.mkdtemp(prefix="meshtune-reshard-")
    try:
        return run_reshard_check(replace(job, checkpoint_dir=path), backend=backend)
    finally:
        if not keep:
            shutil.rmtree(path, ignore_errors=True)
