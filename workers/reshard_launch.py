"""Run a reshard check on the trials' backend: ``run_reshard_check(job) -> ReshardReport``.

The Ray path is the trials' own machinery: the same validation (``RayBackend._validate``), the same
pooled gang of reused ``RankWorker`` actors (workers/_gangs.py), the same per-rank set-up and
clean-up (``workers._launch.run_rank``, whose ``program`` argument runs ``reshard_rank`` instead of
a trial) and the same watchdog (``RayBackend._watch``). Both layouts run in one launch of one world
size: the cluster fixes the world size, and every layout of it fits the same gang.

A check that cannot run (a bad layout, no room on Ray) raises before any process starts; a check
whose ranks fail (crash, oom, timeout) is a ``ReshardReport`` with verdict "failed".
"""

from __future__ import annotations

import functools
import shutil
import tempfile
import time
from typing import Any

from workers.reshard import ReshardJob, ReshardReport, failed_report, report_from_ranks, reshard_rank


def _program(job: ReshardJob, request: Any, *, device: Any) -> Any:
    """``run_rank``'s program signature around ``reshard_rank`` (module level: picklable)."""
    return reshard_rank(job, device=device)


def run_reshard_check(job: ReshardJob, *, backend: Any = None) -> ReshardReport:
    """Run ``job`` on Ray (``backend``: a ``RayBackend``; default a new one, closed after)."""
    import ray

    from workers._gangs import POOL, ensure_actors, kill_actors
    from workers.ray_backend import RayBackend

    job.validate()
    own = backend is None
    backend = backend or RayBackend()
    if not isinstance(backend, RayBackend):
        raise TypeError(f"reshard-check runs on the Ray backend, got {type(backend).__name__}")
    t0 = time.monotonic()
    request = job.request(job.from_layout)
    try:
        resource, groups = backend._validate(request)
        init_timeout = backend.init_timeout_s
        gang = POOL.acquire((resource, groups), timeout_s=backend.placement_timeout_s)
        clean = False
        try:
            ensure_actors(gang, timeout_s=backend.actor_start_timeout_s)
            ranks = gang.ranks
            port = ray.get(ranks[0].actor.free_port.remote())
            addr = ranks[0].info["ip"]
            program = functools.partial(_program, job)
            refs = {}
            for rank, slot in enumerate(ranks):
                local = sum(1 for s in ranks[:rank] if s.info["node_id"] == slot.info["node_id"])
                device = "cpu"
                if resource == "GPU":
                    device = f"cuda:{slot.info['visible'].index(slot.info['gpu_ids'][0])}"
                launch = {"rank": rank, "world_size": job.from_layout.world_size, "local_rank": local,
                          "master_addr": addr, "master_port": port, "device": device,
                          "init_timeout_s": init_timeout, "program": program}
                refs[slot.actor.run.remote(request, launch)] = rank
            reports, error, clean = backend._watch(refs, ranks, request, init_timeout)
        finally:
            if not clean:
                kill_actors(gang)
            POOL.release(gang)
    finally:
        if own:
            backend.close()
    wall = time.monotonic() - t0
    if error is not None:
        where = f" on rank {error.rank}" if error.rank is not None else ""
        text = f"{error.kind}{where}: {error.message}"
        if error.traceback_tail:
            text += "\n" + error.traceback_tail[-2000:]
        return failed_report(job, text, backend="ray", wall_s=wall)
    return report_from_ranks(job, [reports[r] for r in sorted(reports)], backend="ray", wall_s=wall)


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
