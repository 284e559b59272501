"""A backend that answers trials from a benchmark ground truth (benchmarks/truths), with noise.

Like workers/simulate.py but the numbers come from a model meshtune did not write: the layout is
checked as a real backend checks it, the truth gives the noise-free step time and peak memory, each
measured step gets the truth's run noise, and an over-memory layout is an ``oom`` with its bytes.
Every result is ``simulated=True`` (backend "truth:<name>"): a simulation, never a measurement.
"""

from __future__ import annotations

import hashlib
import random
import statistics
import time

from tuner import check_layout
from workers._contract import TrialError, TrialRequest, TrialResult


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
        if out.step_s is None:
            return TrialResult(
                status="oom", backend=self.name, simulated=True, peak_memory_bytes=out.peak_bytes, env=env,
                memory_measure="truth", error=TrialError(kind="oom", message=(
                    f"truth {self.truth.name}: {out.peak_bytes} bytes exceed device_memory={cluster.device_memory}"),
                    bytes_requested=out.peak_bytes),
                wall_s=time.perf_counter() - t0, device_seconds=60.0 * layout.world_size,  # a start-up's worth
            )
        key = f"{self.seed}|{request.seed}|{layout.key}|{request.trial_id}|{model.name}"
        rng = random.Random(int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big"))
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
