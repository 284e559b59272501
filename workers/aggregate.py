"""Merge the ranks' reports of one trial into a ``TrialResult``. Pure Python: no torch needed.

Step time is the median of the measured steps (each the maximum over ranks); tokens/s is global
tokens per step over it; MFU (GPU only) counts FLOPs as the predicted MFU does
(``tuner.model_flops_per_token``) against the cluster's bf16 peak; peak memory is the maximum over
ranks with the per-rank list and timelines; losses come from the last pipeline stage; stage times
and their imbalance (max/mean) from each pp rank's own compute; env is rank 0's fingerprint plus
every rank's host. Each figure's definition: docs/workers.md, "Aggregating a trial".
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from tuner import model_flops_per_token  # the one MFU FLOP count (PaLM convention)
from workers._contract import TrialRequest, TrialResult


def _get(report: Any, name: str, default: Any = None) -> Any:
    if isinstance(report, Mapping):
        return report.get(name, default)
    return getattr(report, name, default)


def aggregate(
    reports: Sequence[Any], request: TrialRequest, *, backend: str, wall_s: float | None = None
) -> TrialResult:
    """A completed ``TrialResult`` from every rank's ``RankReport`` (objects or dicts)."""
    assert reports, "aggregate needs at least one rank report"
    reports = sorted(reports, key=lambda r: _get(r, "rank"))
    world = len(reports)
    model, cluster, training = request.model, request.cluster, request.training

    per_rank_steps = [list(_get(r, "step_times_s") or []) for r in reports]
    n = min(len(s) for s in per_rank_steps)
    step_times = [max(s[i] for s in per_rank_steps) for i in range(n)]
    step = statistics.median(step_times) if step_times else None
    tokens = training.global_batch * model.seq_len
    tokens_per_s = tokens / step if step else None
    mfu = None
    if tokens_per_s is not None and cluster.device_kind == "cuda":
        mfu = model_flops_per_token(model) * tokens_per_s / (world * cluster.peak_flops)

    peaks = [_get(r, "peak_memory_bytes") for r in reports]
    known = [p for p in peaks if p is not None]
    reserved = [p for p in (_get(r, "peak_reserved_bytes") for r in reports) if p is not None]

    stages = [_get(r, "pp_stage") for r in reports]
    last_stage = max((s for s in stages if s is not None), default=None)
    loss_rank = next(r for r, s in zip(reports, stages, strict=True) if s == last_stage)

    by_stage: dict[int, list[list[float]]] = defaultdict(list)
    for r, s in zip(reports, stages, strict=True):
        by_stage[s or 0].append(list(_get(r, "stage_compute_s") or []))
    stage_times = []
    for s in sorted(by_stage):
        lists = by_stage[s]
        m = min(len(x) for x in lists)
        per_step = [statistics.fmean(x[i] for x in lists) for i in range(m)]
        if per_step:
            stage_times.append(statistics.median(per_step))
    imbalance = None
    if stage_times and statistics.fmean(stage_times) > 0:
        imbalance = max(stage_times) / statistics.fmean(stage_times)

    env = dict(_get(reports[0], "env") or {})
    env["hosts"] = sorted({(_get(r, "env") or {}).get("host") for r in reports} - {None})
    env["world_size"] = world
    timelines = [dict(tl, rank=_get(r, "rank"), pp_stage=s)
                 for r, s in zip(reports, stages, strict=True) if (tl := _get(r, "memory_timeline"))]
    notes = sorted({note for r in reports for note in (_get(r, "notes") or [])})
    if notes:
        env["notes"] = notes
    return TrialResult(
        status="completed",
        backend=backend,
        simulated=False,
        step_times_s=step_times,
        step_time_s=step,
        tokens_per_s=tokens_per_s,
        tokens_per_s_per_device=tokens_per_s / world if tokens_per_s is not None else None,
        mfu=mfu,
        peak_memory_bytes=max(known) if known else None,
        peak_memory_per_rank=[int(p) if p is not None else -1 for p in peaks],
        memory_measure=_get(reports[0], "memory_measure"),
        peak_reserved_bytes=max(reserved) if reserved else None,
        losses=list(_get(loss_rank, "losses") or []),
        stage_times_s=stage_times,
        stage_imbalance=imbalance,
        env=env,
        wall_s=wall_s,
        device_seconds=wall_s * world if wall_s is not None else None,
        memory_timeline=timelines or None,
    )
