"""Ranking transfer: a finished sweep's measured layouts re-ranked by what another training stack
(tuner/_stack.py) is predicted to make of them, so a user sees whether the winner on meshtune's
workers is also the predicted winner on the framework they train with.

Each layout's target-stack prediction is the analytical model for that stack on the sweep's cluster,
corrected with the sweep's calibration in force (``api.engine._prediction.predict_under``: the
weights the measurements fitted to the model's parts, applied to the target stack's parts). Where
that order differs from the measured one, each row says by how much. ``meshtune show SWEEP --stack``,
``GET /api/sweeps/{id}/transfer`` and ``meshtune export`` (``target_lines``) read it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session

from api.engine import predict_under
from api.ranking.service import RankingRow, ranking
from api.spec import SweepSpec
from api.sweeps import service
from tuner import (
    STACKS,
    ConflictError,
    Layout,
    check_stack,
    estimate_memory,
    estimate_time,
    model_flops_per_token,
)

# The stack each export format trains with (tuner/_export.py FORMATS); DeepSpeed has no stack yet.
FORMAT_STACKS = {"megatron": "megatron", "megatron-launch": "megatron", "nemo": "megatron",
                 "torchtitan": "torchtitan", "torchtitan-launch": "torchtitan"}


@dataclass(frozen=True)
class TransferRow:
    target_rank: int  # by the target stack's calibrated prediction (layouts it predicts do not fit last)
    measured_rank: int  # the sweep's ranking
    layout_key: str
    layout: dict[str, Any]
    n: int
    measured_tokens_per_s_per_device: float
    measured_peak_memory_bytes: int | None
    predicted_tokens_per_s_per_device: float | None  # meshtune's workers, calibrated (the ranking's prediction)
    target_tokens_per_s_per_device: float | None  # the target stack, calibrated
    target_model_tokens_per_s_per_device: float  # the target stack, the analytical model alone
    target_mfu: float | None
    target_memory_bytes: int | None  # calibrated
    target_fits: bool
    simulated: bool

    @property
    def moved(self) -> int:
        """Places gained on the target stack (positive: ranked higher there than measured)."""
        return self.measured_rank - self.target_rank


@dataclass
class Transfer:
    sweep_id: int
    stack: dict[str, Any]
    calibrated: bool  # the sweep kept a calibration (else the prior's weights: the model alone)
    rows: list[TransferRow] = field(default_factory=list)
    same_winner: bool = True
    reordered: int = 0  # rows whose target rank differs from their measured rank
    simulated: bool = False

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for row, d in zip(self.rows, out["rows"], strict=True):
            d["moved"] = row.moved
        return out


def _problem(sweep: Any, stack: str) -> tuple[Any, Any, Any, Any]:
    problem = SweepSpec.model_validate(sweep.spec).to_problem()
    model, cluster, training = problem.model, problem.cluster, problem.training
    return model, cluster, training, dataclasses.replace(training, stack=stack)


def _in_force(calibration: dict[str, Any] | None) -> bool:
    c = calibration or {}
    return bool(c.get("in_force") or any(k in c for k in ("time", "memory")))


def transfer(session: Session, *, sweep_id: int, stack: str) -> Transfer:
    """The sweep's measured layouts re-ranked for ``stack`` (SpecError naming ``stack`` when unknown;
    ConflictError when nothing was measured)."""
    check_stack(stack, field="stack")
    sweep = service.get_sweep(session, sweep_id=sweep_id)
    rows = ranking(session, sweep_id=sweep_id).rows
    if not rows:
        raise ConflictError(f"sweep {sweep_id} has no completed trial to re-rank (status {sweep.status})")
    model, cluster, _, target = _problem(sweep, stack)
    layouts = {r.layout_key: Layout(**r.layout) for r in rows}
    corrected = predict_under(sweep.calibration, layouts, model=model, cluster=cluster, training=target)
    flops = model_flops_per_token(model)
    made = []
    for r in rows:
        layout = layouts[r.layout_key]
        raw = estimate_time(layout, model=model, cluster=cluster, training=target)
        fits = estimate_memory(layout, model=model, cluster=cluster, training=target).fits
        tps, mem = corrected[r.layout_key]
        made.append((r, tps, mem, raw.tokens_per_s_per_device, fits))
    order = sorted(range(len(made)), key=lambda i: (not made[i][4], -(made[i][1] or 0.0), made[i][0].rank))
    out = []
    for target_rank, i in enumerate(order, 1):
        r, tps, mem, raw, fits = made[i]
        out.append(TransferRow(
            target_rank=target_rank, measured_rank=r.rank, layout_key=r.layout_key, layout=r.layout, n=r.n,
            measured_tokens_per_s_per_device=r.tokens_per_s_per_device, measured_peak_memory_bytes=r.peak_memory_bytes,
            predicted_tokens_per_s_per_device=r.predicted_tokens_per_s_per_device, target_tokens_per_s_per_device=tps,
            target_model_tokens_per_s_per_device=raw,
            target_mfu=None if tps is None else flops * tps / cluster.peak_flops, target_memory_bytes=mem,
            target_fits=fits, simulated=r.simulated))
    return Transfer(sweep_id=sweep_id, stack=STACKS[stack].to_dict(), calibrated=_in_force(sweep.calibration),
                    rows=out, same_winner=out[0].measured_rank == 1,
                    reordered=sum(row.moved != 0 for row in out), simulated=any(row.simulated for row in out))


def target_lines(sweep: Any, row: RankingRow, *, format: str) -> list[str]:
    """What ``meshtune export`` says beside the measured figures: the exported layout predicted for
    the stack the format trains with, by the model and corrected with the sweep's calibration, and
    what meshtune measured on its own workers, each labelled."""
    model, cluster, training, _ = _problem(sweep, "meshtune")
    layout = Layout(**row.layout)
    flops = model_flops_per_token(model)
    measured = (f"measured on meshtune's own workers (stack meshtune{', SIMULATED' if row.simulated else ''}): "
                f"{row.tokens_per_s_per_device:,.6g} tokens/s per device (median of {row.n}), "
                f"MFU {flops * row.tokens_per_s_per_device / cluster.peak_flops:.1%}, peak memory "
                + (_gib(row.peak_memory_bytes) if row.peak_memory_bytes is not None else "not recorded"))
    name = FORMAT_STACKS.get(format)
    if name is None:
        return [measured, f"no prediction for {format}: meshtune has no stack describing its runtime "
                          f"(tuner/_stack.py has {', '.join(STACKS)})"]
    target = dataclasses.replace(training, stack=name)
    est = estimate_time(layout, model=model, cluster=cluster, training=target)
    mem = estimate_memory(layout, model=model, cluster=cluster, training=target)
    tps, cal_mem = predict_under(sweep.calibration, {row.layout_key: layout}, model=model, cluster=cluster,
                                 training=target)[row.layout_key]
    fits = "fits" if mem.fits else "does NOT fit"
    lines = [
        f"predicted for stack {name} ({STACKS[name].description}) on {cluster.name} {cluster.nodes}x"
        f"{cluster.devices_per_node}, analytical model: {est.tokens_per_s_per_device:,.6g} tokens/s per device, MFU "
        f"{est.mfu:.1%}, peak memory {_gib(mem.total)} ({fits} {_gib(cluster.device_memory)})",
    ]
    if _in_force(sweep.calibration) and tps is not None:
        lines.append(f"predicted for stack {name}, corrected with this sweep's calibration: {tps:,.6g} tokens/s per "
                     f"device, MFU {flops * tps / cluster.peak_flops:.1%}, peak memory {_gib(cal_mem)}")
    else:
        lines.append(f"predicted for stack {name}: this sweep kept no calibration, so the figures above are the "
                     "model's alone")
    return [*lines, measured]


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f} GiB"
