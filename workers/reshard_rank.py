"""The rank program of reshard-check: ``reshard_rank(job, device=...)`` runs both phases (train and save
under layout A, load under layout B, compare, continue) on a rank of an initialised process group;
``run_jobs`` runs several checks on one process group. The check itself: workers/reshard.py."""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from workers._reshard_state import (
    Trainer,
    compare_full_state,
    corrupt_state,
    full_state,
    load_state,
    save_state,
)
from workers.reshard import MAX_LISTED_MISMATCHES, RankOutcome, ReshardJob


def reshard_rank(job: ReshardJob, *, device: Any) -> RankOutcome:
    """Run both phases on this rank (see the module docstring)."""
    device = torch.device(device)
    rank = dist.get_rank()
    ckpt = os.path.join(job.checkpoint_dir, "dcp")
    full_dir = os.path.join(job.checkpoint_dir, "full")
    total = job.steps_before + job.steps_after

    # Phase A: train, save (DCP), snapshot the full state, then continue uninterrupted.
    a = Trainer(job.request(job.from_layout), device)
    losses_a = [a.step(s) for s in range(job.steps_before)]
    t0 = time.perf_counter()
    dcp.save(save_state(a), checkpoint_id=ckpt)
    save_s = time.perf_counter() - t0
    saved_keys = full_state(a, write_dir=full_dir)
    losses_a += [a.step(s) for s in range(job.steps_before, total)]
    dtype = a.dtype
    a.close()
    del a

    # Phase B: build, load (DCP) into B's shards, optionally corrupt, verify, continue.
    b = Trainer(job.request(job.to_layout), device)
    t0 = time.perf_counter()
    state = save_state(b)
    dcp.load(state, checkpoint_id=ckpt)
    if job.corrupt:
        corrupt_state(state, job.corrupt)
    load_state(b, state)
    load_s = time.perf_counter() - t0
    checked, mismatches, max_diff = compare_full_state(b, saved_keys, full_dir)
    losses_b = [b.step(s) for s in range(job.steps_before, total)]
    b.close()
    dist.barrier()
    return RankOutcome(
        rank=rank, losses_a=losses_a, losses_b=losses_b, tensors_checked=checked,
        mismatches=[asdict(m) for m in mismatches[:MAX_LISTED_MISMATCHES]], mismatch_count=len(mismatches),
        max_abs_diff=max_diff, dtype=dtype, save_s=save_s, load_s=load_s,
    )


def run_jobs(rank: int, world: int, jobs: list[ReshardJob]) -> list[Any]:
    """Run several checks one after the other on one process group (tests: one spawn for many).
    A failing job yields its error text and the next one still runs (ranks stay in step only if the
    failure was collective; a rank-local failure ends the spawn as RankFailed)."""
    out: list[Any] = []
    for job in jobs:
        try:
            out.append(reshard_rank(job, device=torch.device("cpu")))
        except Exception:  # noqa: BLE001 - reported to the caller per job
            out.append(traceback.format_exc()[-3000:])
    return out
