"""The rank program of a trial: build, parallelise and train the model for W + M real steps, measured.

``train_trial(request, device=...)`` runs on every rank of an already initialised process group
(gloo on CPU, NCCL on CUDA) and returns this rank's ``RankReport``; the launcher merges the reports
into a ``TrialResult``. Every layout trains the same model on the same global batch with the same
loss (mean cross-entropy over all tokens of the global batch), so losses are comparable with the
single-process ``reference_losses``.

Building and stepping a layout live in workers/rank_model.py (every rank program that trains one
uses them); ``train_trial`` adds the measurements and the injected failures around them.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from workers import measure
from workers._contract import TrialRequest
from workers._memory_timeline import StepMemory
from workers.model import synthetic_batch
from workers.parallelize import cross_entropy
from workers.rank_model import build_rank_model, global_loss, rank_batch, train_step
from workers.workload_registry import build_model

__all__ = ["NonFiniteLoss", "RankReport", "as_out_of_memory", "reference_losses", "train_trial"]


# Stays in this module: a trial's stored error names its type by module ("workers.train.NonFiniteLoss",
# workers/failures.py), and stored trials keep that name.
class NonFiniteLoss(RuntimeError):
    """The loss of ``step`` is NaN or infinite (the launcher classifies the trial as ``nan``)."""

    def __init__(self, step: int, value: float) -> None:
        super().__init__(f"non-finite loss {value} at step {step}")
        self.step, self.value = step, value

    def __reduce__(self):  # picklable across Ray / multiprocessing with its own arguments
        return (type(self), (self.step, self.value))


@dataclass
class RankReport:
    """One rank's measurement. ``losses`` and ``warmup_times_s`` include warm-up; ``step_times_s``
    and ``stage_compute_s`` are the measured steps only. ``step_times_s`` are the maximum over
    ranks of each step's wall time (every rank reports the same list). ``stage_compute_s`` is this
    rank's own forward+backward compute per measured step (all its pipeline chunks together).
    ``memory_measure`` "cpu.VmHWM" is the whole process's resident-set high-water mark since the
    trial started; "cuda.max_memory_allocated" is torch's caching allocator only. ``memory_timeline``
    is the last measured step's memory (workers/_memory_timeline.py), whose maximum the peak is."""

    rank: int
    world_size: int
    pp_stage: int | None
    losses: list[float]
    step_times_s: list[float]
    stage_compute_s: list[float]
    peak_memory_bytes: int | None
    peak_reserved_bytes: int | None
    memory_measure: str
    tokens_per_step: int
    warmup_times_s: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)  # only with options["grad_norm"]
    dtype: str = "float32"
    device: str = "cpu"
    notes: list[str] = field(default_factory=list)
    memory_timeline: dict[str, Any] | None = None


def reference_losses(request: TrialRequest, *, steps: int | None = None) -> tuple[list[float], list[float]]:
    """The single-process, non-distributed reference: whole global batch, one device, fp32.
    Returns (loss per step, global gradient norm per step)."""
    spec, training = request.model, request.training
    model = build_model(spec, training, torch.device("cpu"), request.workload)
    loss_fn = getattr(model, "loss", None) or cross_entropy
    opt = torch.optim.AdamW(model.parameters(), lr=training.lr)
    losses, norms = [], []
    for step in range(steps if steps is not None else request.warmup_steps + request.measure_steps):
        tokens, targets = synthetic_batch(spec, batch=training.global_batch, step=step, seed=training.seed)
        loss = loss_fn(model(tokens), targets)
        loss.backward()
        norms.append(math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in model.parameters())))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, norms


# --- injected failures (request.options) ---------------------------------------------------------

_CPU_ALLOC = re.compile(r"DefaultCPUAllocator: can't allocate memory: you tried to allocate (\d+) bytes")


def as_out_of_memory(exc: RuntimeError) -> torch.OutOfMemoryError | None:
    """torch's CPU allocator fails with a plain RuntimeError: turn it into torch.OutOfMemoryError
    (with ``bytes_requested``) here, at the source, so the launcher classifies by type."""
    if isinstance(exc, torch.OutOfMemoryError):
        return exc
    m = _CPU_ALLOC.search(str(exc))
    if m is None:
        return None
    oom = torch.OutOfMemoryError(str(exc))
    oom.bytes_requested = int(m.group(1))  # type: ignore[attr-defined]
    return oom


def _inject_before_step(options: dict[str, Any], step: int, rank: int, device: torch.device) -> None:
    fail = options.get("fail")
    if fail is None or step != int(options.get("fail_step", 1)) or rank != int(options.get("fail_rank", 0)):
        return
    if fail == "crash":
        raise RuntimeError(f"injected crash on rank {rank} at step {step}")
    if fail == "hang":
        while True:  # the launcher's watchdog must kill this process
            time.sleep(3600)
    if fail == "oom":
        nbytes = 2**50  # 1 PiB: more than any device or address space, so the real allocator fails
        try:
            torch.empty(nbytes, dtype=torch.uint8, device=device)
        except torch.OutOfMemoryError as exc:
            exc.bytes_requested = nbytes  # type: ignore[attr-defined]
            raise
    elif fail != "nan":
        raise ValueError(f"options.fail must be one of crash, hang, oom, nan; got {fail!r}")


def _nan_hook(options: dict[str, Any], state: dict[str, int]):
    """Forward hook on the embedding: multiply its output by inf on ``fail_step`` (fail='nan')."""

    def hook(module, args, output):
        if state["step"] == int(options.get("fail_step", 1)):
            return output * float("inf")
        return output

    return hook


# --- the trial -----------------------------------------------------------------------------------


def train_trial(request: TrialRequest, *, device: torch.device) -> RankReport:
    """Run ``request`` on this rank (process group already initialised); see the module docstring.

    Raises what the trial raised, typed for the launcher's classification: ``NonFiniteLoss`` (nan),
    ``torch.OutOfMemoryError`` with ``bytes_requested`` where known (oom, CPU allocator failures
    included), ``LayoutError`` for a layout this code cannot run, anything else (crash)."""
    try:
        return _run_trial(request, device)
    except RuntimeError as exc:
        oom = as_out_of_memory(exc)
        if oom is not None and oom is not exc:
            raise oom from exc
        raise


def _run_trial(request: TrialRequest, device: torch.device) -> RankReport:
    layout, spec, training = request.layout, request.model, request.training
    rank, world = dist.get_rank(), dist.get_world_size()
    options = dict(request.options)
    notes: list[str] = []
    if device.type == "cuda":
        torch.cuda.set_device(device)
    measure.reset_peak_memory(device)
    rm = build_rank_model(request, device, notes=notes)

    step_state = {"step": -1}
    if options.get("fail") == "nan":
        for _, chunk in rm.par.chunks:
            if chunk.tok_embeddings is not None:
                chunk.tok_embeddings.register_forward_hook(_nan_hook(options, step_state))
    sleep_s = float(options.get("sleep_per_step_s", 0.0))
    min_step_s = float(options.get("min_step_s", 0.0))

    # options.grad_norm: record the global gradient norm of every step (a diagnostic for the numerics
    # tests: Adam is invariant to the scale of the gradient, so losses alone would not show a wrong
    # 1/m or 1/dp factor). Its all-gathers then count in the step time.
    grad_norms: list[float] | None = [] if options.get("grad_norm", False) else None
    losses, warm_times, step_times, compute_times = [], [], [], []
    # The last measured step's memory is recorded (resident memory creeps up over a run: the last step
    # is where a CPU rank's peak usually falls); the trial's peak is that record's maximum.
    memory = StepMemory(device, rm.phases, step=request.warmup_steps + request.measure_steps - 1)
    try:
        for step in range(request.warmup_steps + request.measure_steps):
            step_state["step"] = step
            batch = rank_batch(rm, step)
            if step == memory.step:
                memory.start()
            measure.start_barrier(device)
            t0 = time.perf_counter()
            _inject_before_step(options, step, rank, device)
            if sleep_s:
                time.sleep(sleep_s)
            local_loss = train_step(rm, *batch, grad_norms=grad_norms)
            measure.synchronize(device)
            if min_step_s and step >= request.warmup_steps:  # pad a timed step to its floor: its time is
                # then the floor, whatever the machine's load, as long as the compute fits in it
                time.sleep(max(0.0, min_step_s - (time.perf_counter() - t0)))
            local = time.perf_counter() - t0
            if step == memory.step:  # after the clock: joining the sampler is not the step's time
                memory.stop()
            elapsed = measure.agreed_max(local, device)
            compute = rm.timer.take()
            value = global_loss(rm, local_loss)
            losses.append(value)
            if not math.isfinite(value):
                raise NonFiniteLoss(step, value)
            if step < request.warmup_steps:
                warm_times.append(elapsed)
            else:
                step_times.append(elapsed)
                compute_times.append(compute)
        memory.finish()
    finally:
        memory.close()  # a failed step leaves no sampler thread in the reused rank process
    timeline = memory.timeline()
    return RankReport(
        rank=rank,
        world_size=world,
        pp_stage=min(rm.stage_ids) if layout.pp > 1 else None,
        losses=losses,
        step_times_s=step_times,
        stage_compute_s=compute_times,
        peak_memory_bytes=timeline["peak_bytes"],
        peak_reserved_bytes=timeline.get("peak_reserved_bytes"),
        memory_measure=memory.measure,
        tokens_per_step=training.global_batch * spec.seq_len,
        warmup_times_s=warm_times,
        grad_norms=grad_norms or [],
        dtype=str(rm.dtype).removeprefix("torch."),
        device=str(device),
        notes=notes,
        memory_timeline=timeline,
    )
