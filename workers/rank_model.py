"""One layout on this rank, built and stepped: the part of a trial that trains, without measuring.

``build_rank_model(request, device)`` -> ``RankModel`` (mesh, parallelised chunks, AdamW, the
pipeline schedule under pp > 1); per step ``rank_batch`` (this rank's share of the global batch),
``train_step`` (forward + backward + gradient sync + AdamW) and ``global_loss`` (a collective).
Every rank program that trains a layout uses these: the trial (workers/train.py, which adds the
measurements and injected failures around them), reshard-check's ``Trainer`` (workers/_reshard_state.py) and the memory probe (workers/memory_probe.py), so all of them train
the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import stage_backward
from torch.distributed.tensor import DTensor

from tuner import LayoutError, TrainingSpec, microbatches, realise
from workers import measure
from workers._contract import TrialRequest
from workers._data_parallel import is_expert_param, zero1_micro_batch
from workers._memory_timeline import Phases
from workers.model import synthetic_batch
from workers.parallelize import Parallelized, build_mesh, coordinate, parallelize_model
from workers.workload import capabilities_of
from workers.workload_registry import build_model

# --- building blocks -----------------------------------------------------------------------------


def _precision(training: TrainingSpec, device: torch.device, notes: list[str], options: dict) -> torch.dtype:
    if training.precision == "bf16" and (device.type == "cuda" or options.get("cpu_bf16")):
        # options.cpu_bf16: run the GPU's mixed-precision path (FSDP MixedPrecisionPolicy or
        # autocast, fp32 master weights) on CPU ranks, so CI exercises it.
        return torch.bfloat16
    if training.precision == "bf16":
        notes.append("precision bf16 requested; CPU ranks run fp32")
    return torch.float32


class _SyncingStage(PipelineStage):
    """torch's PipelineStage with the workers' gradient rule under pp > 1 (tuner/_realise.py,
    decision 6). torch's stage turns FSDP's gradient sync and reshard off for every micro-batch's
    backward and reduces once in ``perform_reduce_grad`` at the step's end, so every ZeRO level
    would hold unsharded fp32 gradients (and ZeRO-3 every gathered weight) through the step.
    Here ZeRO-2/3 reduce-scatter each micro-batch's gradients as its backward finishes (FSDP
    accumulates them into the sharded gradient), ZeRO-0/1 sync on the last micro-batch, ZeRO-3
    reshards after every backward, the others on the last; ``perform_reduce_grad`` then finds
    nothing left to reduce and only finalises and scales by 1/m."""

    zero: int = 0

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(self.submod, FSDPModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        assert backward_type == "full", backward_type  # the schedules used here never split B/W
        self.submod.set_is_last_backward(False)  # finalised by perform_reduce_grad
        self.submod.set_requires_gradient_sync(last_backward or self.zero >= 2)
        self.submod.set_reshard_after_backward(last_backward or self.zero == 3)
        grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
        return grads, None


def _build_schedule(par: Parallelized, layout, m: int, device: torch.device, pp_group, timer, phases: Phases):
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )
    from torch.distributed.pipelining.microbatch import _Replicate

    stages = []
    for s, chunk in par.chunks:
        stage = _SyncingStage(chunk, s, layout.stages, device, group=pp_group)
        stage.zero = layout.zero
        for name in ("forward_one_chunk", "backward_one_chunk"):  # this rank's compute, for imbalance
            orig = getattr(stage, name)
            what = "forward" if name.startswith("forward") else "backward"

            def timed(chunk_id, *a, _orig=orig, _what=what, _stage=s, **kw):
                phases.mark(_what, _stage, chunk_id)  # the memory timeline's phases (a no-op unless armed)
                try:
                    with timer.span():
                        return _orig(chunk_id, *a, **kw)
                finally:
                    phases.mark("pipeline send/recv", _stage)

            setattr(stage, name, timed)
        stages.append(stage)
    def loss_fn(*a, **kw):  # the schedule computes the loss after the last stage's forward of a micro-batch
        phases.mark("loss", layout.stages - 1, phases.micro_batch)
        return par.loss_fn(*a, **kw)

    # Positions (context parallel) are the same for every micro-batch: replicate, do not split.
    kw = {"loss_fn": loss_fn, "kwargs_chunk_spec": {"positions": _Replicate()}}
    if layout.schedule == "interleaved":
        return ScheduleInterleaved1F1B(stages, m, **kw)
    cls = ScheduleGPipe if layout.schedule == "gpipe" else Schedule1F1B
    return cls(stages[0], m, **kw)


# --- one layout on this rank: build it, step it (shared by trials and reshard-check) ---------------


@dataclass
class RankModel:
    """This rank's share of one layout, ready to train: mesh, parallelised model chunks, AdamW over
    their parameters, the pipeline schedule (``None`` when pp == 1) and the compute timer its
    chunks report to. Built by ``build_rank_model``, stepped by ``rank_batch`` + ``train_step`` +
    ``global_loss``; every layout built this way starts from the single model's weights."""

    request: TrialRequest
    device: torch.device
    dtype: torch.dtype  # parameters and activations: bfloat16 (mixed precision) or float32
    mesh: Any
    par: Parallelized
    optimizer: torch.optim.Optimizer
    timer: measure.ComputeTimer
    schedule: Any
    microbatches: int
    # Phase markers of the step whose memory is recorded (workers/_memory_timeline.py); unarmed otherwise.
    phases: Phases = field(default_factory=Phases)

    @property
    def stage_ids(self) -> list[int]:
        return [s for s, _ in self.par.chunks]

    @property
    def autocast(self) -> bool:
        return self.dtype != torch.float32 and not self.par.fsdp  # FSDP casts itself (MixedPrecisionPolicy)


def build_rank_model(request: TrialRequest, device: torch.device, *, notes: list[str] | None = None) -> RankModel:
    """Build ``request.layout`` on this rank (process group already initialised). ``notes``
    collects what the build could not honour (e.g. bf16 on CPU ranks)."""
    layout, spec, training = request.layout, request.model, request.training
    if dist.get_world_size() != layout.world_size:
        raise LayoutError(f"layout world size {layout.world_size} != process group size {dist.get_world_size()}")
    notes = [] if notes is None else notes
    dtype = _precision(training, device, notes, dict(request.options))
    # 1. Mesh and the model, built identically on every rank before any sharding.
    mesh = build_mesh(layout, request.cluster, device.type)
    model = build_model(spec, training, device, request.workload)  # workers/workload.py
    # 2.-7. Parallelisms, in the order documented in workers/parallelize.py.
    realisation = realise(layout, spec, request.cluster, training, capabilities_of(model))  # asserted
    par = parallelize_model(model, mesh, layout, param_dtype=dtype, realisation=realisation)
    notes += par.notes
    optimizer = torch.optim.AdamW([p for _, c in par.chunks for p in c.parameters()], lr=training.lr)
    timer = measure.ComputeTimer(device)
    m = microbatches(layout, training)
    phases = Phases()
    schedule = (_build_schedule(par, layout, m, device, mesh["pp"].get_group(), timer, phases)
                if layout.pp > 1 else None)
    return RankModel(request, device, dtype, mesh, par, optimizer, timer, schedule, m, phases)


def rank_batch(rm: RankModel, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, targets, positions) of global step ``step`` that this rank trains on: its
    data-parallel rows of the global batch, and its sequence shard under context parallelism."""
    layout, spec, training, device = rm.request.layout, rm.request.model, rm.request.training, rm.device
    tokens, targets = synthetic_batch(spec, batch=training.global_batch, step=step, seed=training.seed)
    local_batch = training.global_batch // layout.data_ranks
    data_index = coordinate(rm.mesh, "dp") * layout.ep + coordinate(rm.mesh, "ep")
    rows = slice(data_index * local_batch, (data_index + 1) * local_batch)
    tokens, targets = tokens[rows].to(device), targets[rows].to(device)
    # Explicit positions: a later pipeline stage under sequence parallelism sees only a shard.
    positions = torch.arange(spec.seq_len, device=device)
    if layout.cp > 1:
        from workers._cp import shard_sequence

        tokens, targets, positions = shard_sequence(tokens, targets, rm.mesh["cp"])
    return tokens, targets, positions


def train_step(
    rm: RankModel, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor,
    *, grad_norms: list[float] | None = None,
) -> torch.Tensor | None:
    """One optimiser step: forward + backward over the micro-batches (accumulation, or the pipeline
    schedule), gradient sync, AdamW. Returns this rank's mean loss (``None`` off the last stage).
    ``grad_norms``: append the global gradient norm before the update (a diagnostic)."""
    layout = rm.request.layout
    with torch.autocast(rm.device.type, dtype=rm.dtype, enabled=rm.autocast), rm.par.loss_context():
        step = _accumulate if rm.schedule is None else _pipeline_step
        local_loss = step(rm, tokens, targets, positions)
    if rm.par.grad_sync is not None:
        rm.phases.mark("gradient sync")
        rm.par.grad_sync()
    if grad_norms is not None:
        grad_norms.append(_global_grad_norm(rm.par, layout))
    rm.phases.mark("optimizer")
    rm.optimizer.step()
    rm.optimizer.zero_grad(set_to_none=True)
    return local_loss


def global_loss(rm: RankModel, local_loss: torch.Tensor | None) -> float:
    """The step's global loss, on every rank (a collective): the last stage's tp-rank-0 replicas
    hold the shares, each (dp, cp, ep) rank's loss being the mean over its own tokens."""
    layout = rm.request.layout
    holds = layout.stages - 1 in rm.stage_ids and coordinate(rm.mesh, "tp") == 0 and local_loss is not None
    share = local_loss * (1.0 / (layout.dp * layout.cp * layout.ep)) if holds else torch.zeros((), device=rm.device)
    total = share.detach().float().reshape(1).clone()
    dist.all_reduce(total)
    return float(total.item())


def _global_grad_norm(par: Parallelized, layout) -> float:
    """L2 norm of the whole model's gradient, gathered (a diagnostic for the numerics tests)."""
    dense, experts = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    seen: set[int] = set()
    for _, chunk in par.chunks:
        for mod in chunk.modules():
            for name, p in mod.named_parameters(recurse=False):
                if p.grad is None or id(p) in seen:
                    continue
                seen.add(id(p))
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                sq = g.detach().double().pow(2).sum().cpu()
                if is_expert_param(mod, name):
                    experts += sq
                else:
                    dense += sq
    device = next(iter(par.chunks[0][1].parameters())).device
    # A stage's dense weights are replicated over world/pp ranks (TP shards gathered by full_tensor),
    # its expert shards (ep experts, ffn/tp slices: plain tensors) over world/(pp*ep*tp).
    replicas = layout.world_size // layout.pp
    t = (dense / replicas + experts / (replicas // (layout.ep * layout.tp))).to(device)
    dist.all_reduce(t)
    return float(t.sqrt().item())


def _accumulate(rm: RankModel, tokens, targets, positions) -> torch.Tensor:
    """pp == 1: gradient accumulation over m micro-batches of mbs sequences; returns the local mean loss."""
    par, layout, m = rm.par, rm.request.layout, rm.microbatches
    model = par.chunks[0][1]
    total = torch.zeros((), device=tokens.device)
    with rm.timer.span():
        for i in range(m):
            rows = slice(i * layout.mbs, (i + 1) * layout.mbs)
            if par.fsdp and layout.zero <= 1:  # ZeRO-0 (replicate) and ZeRO-1: sync on the last only
                zero1_micro_batch(par.chunks, last=i == m - 1)
            rm.phases.mark("forward", 0, i)
            loss = par.loss_fn(model(tokens[rows], positions), targets[rows]) / m
            rm.phases.mark("backward", 0, i)
            loss.backward()
            total += loss.detach().float()
    return total


def _pipeline_step(rm: RankModel, tokens, targets, positions) -> torch.Tensor | None:
    """pp > 1: the schedule splits the local batch into m micro-batches and scales gradients by 1/m."""
    has_first, has_last = 0 in rm.stage_ids, rm.request.layout.stages - 1 in rm.stage_ids
    losses: list[torch.Tensor] = []
    args = (tokens,) if has_first else ()
    rm.schedule.step(*args, target=targets if has_last else None, losses=losses if has_last else None,
                     return_outputs=False, positions=positions)
    if not has_last:
        return None
    return torch.stack([x.detach().float() for x in losses]).mean()
