"""A backend that answers trials from a benchmark ground truth (benchmarks/truths), with noise.

Like workers/simulate.py but the numbers come from a model meshtune did not write: the layout is
checked as a real backend checks it, the truth gives the noise-free step time and peak memory, each
measured step gets the truth's run noise, and an over-memory layout is an ``oom`` reported the way
CUDA's caching allocator reports it: the one allocation that failed and what was in use then, never
the layout's peak (``cuda_oom``). Every result is ``simulated=True`` (backend "truth:<name>"): a
simulation, never a measurement.
"""

from __future__ import annotations

import hashlib
import random
import statistics
import time

from benchmarks.truths import GiB
from tuner import check_layout
from workers._contract import TrialError, TrialRequest, TrialResult

MiB = 1 << 20


def cuda_oom(peak: float, capacity: int, rng: random.Random) -> tuple[int, int]:
    """(bytes of the failing allocation, bytes in use when it failed) of a layout whose peak exceeds
    ``capacity``: the allocations before it filled the device to within a little of its capacity
    (0.2-3% free), then one tensor (5-95% of what was still to come) did not fit. Both are lower
    bounds: in use + requested stays strictly below the peak, and in use below the capacity."""
    if peak <= capacity:
        raise ValueError(f"peak {peak} fits capacity {capacity}: no out-of-memory to report")
    free = int(capacity * rng.uniform(0.002, 0.03))
    in_use = capacity - free
    remaining = peak - in_use  # what the step still had to allocate, more than what was free
    requested = free + 1 + int((remaining - free - 1) * rng.uniform(0.05, 0.95))
    return requested, in_use


def _size(nbytes: float) -> str:
    # torch's format_size (c10/cuda/CUDACachingAllocator.cpp): MiB under 1 GiB, else GiB, 2 decimals
    return f"{nbytes / MiB:.2f} MiB" if nbytes < GiB else f"{nbytes / GiB:.2f} GiB"


def cuda_oom_message(requested: int, in_use: int, capacity: int) -> str:
    """The message torch.OutOfMemoryError carries on a CUDA device (torch 2.x wording)."""
    free = capacity - in_use
    reserved_free = int(in_use * 0.02)
    return (f"CUDA out of memory. Tried to allocate {_size(requested)}. GPU 0 has a total capacity of "
            f"{_size(capacity)} of which {_size(free)} is free. Including non-PyTorch memory, this process has "
            f"{_size(in_use)} memory in use. Of the allocated memory {_size(in_use - reserved_free)} is allocated "
            f"by PyTorch, and {_size(reserved_free)} is reserved by PyTorch but unallocated. If reserved but "
            "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
            "fragmentation.  See documentation for Memory Management  "
            "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")


class TruthBackend:
    def __init__(self, truth, *, seed: int = 0) -> None:
        self.truth, self.seed = truth, seed
        self.name = f"truth:{truth.name}"

    def capacity(self) -> int:
        return 1_000_000

    def close(self) -> None:
        return None

    def run(self, request: TrialRequest) -> TrialResult:
        t0 = time.perf_counter()
        model, cluster, training, layout = request.model, request.cluster, request.training, request.layout
        check_layout(layout, model=model, cluster=cluster, training=training)
        env = self.truth.env()
        out = self.truth.answer(layout, model, cluster, training)
        key = f"{self.seed}|{request.seed}|{layout.key}|{request.trial_id}|{model.name}"
        rng = random.Random(int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big"))
        if out.step_s is None:
            requested, in_use = cuda_oom(out.peak_bytes, cluster.device_memory, rng)
            return TrialResult(
                status="oom", backend=self.name, simulated=True, peak_memory_bytes=in_use, env=env,
                memory_measure="truth", error=TrialError(
                    kind="oom", message=cuda_oom_message(requested, in_use, cluster.device_memory),
                    exception_type="torch.OutOfMemoryError", bytes_requested=requested),
                wall_s=time.perf_counter() - t0, device_seconds=60.0 * layout.world_size,  # a start-up's worth
            )
        run = self.truth.run_noise(rng)  # one run's luck (host load), shared by its steps
        steps = [out.step_s * run * rng.lognormvariate(0.0, 0.005) for _ in range(request.measure_steps)]
        step = statistics.median(steps)
        tokens = training.global_batch * model.seq_len
        return TrialResult(
            status="completed", backend=self.name, simulated=True, step_times_s=steps, step_time_s=step,
            tokens_per_s=tokens / step, tokens_per_s_per_device=tokens / step / layout.world_size,
            peak_memory_bytes=out.peak_bytes, memory_measure="truth", env=env, wall_s=time.perf_counter() - t0,
            device_seconds=(request.warmup_steps + request.measure_steps) * step * layout.world_size,
        )
