"""The ``simulate`` backend: answers a trial from the tuner's analytical model, with seeded noise.

For planning beyond the hardware at hand (a 70B model on 64 GPUs from a laptop). It starts no
process and imports no torch. Every result is ``simulated=True`` with ``backend="simulate"``: a
prediction, never a measurement. The layout is validated as a real backend does; a predicted peak
above the device's memory is an ``oom``; otherwise each step is the predicted step time times
seeded lognormal noise. Diagnostic options (``fail``, ``memory_cap_bytes``, ...) are honoured as
the real rank program honours them; ``devices`` and ``pace`` make it a simulated cluster for the
coordinators' queue. How a result is made: docs/workers.md, "Simulate backend".
"""

from __future__ import annotations

import hashlib
import random
import statistics
import time

import tuner
from tuner import check_layout
from workers._contract import TrialError, TrialRequest, TrialResult
from workers.failures import timeout_error

MEMORY_MEASURE = "simulate.estimate_memory"


class SimulateBackend:
    """``Backend`` answering from ``tuner.estimate_time``/``tuner.estimate_memory`` with noise."""

    name = "simulate"

    def __init__(self, *, seed: int = 0, noise: float = 0.03, factors: object | None = None,
                 devices: int | None = None, pace: float = 0.0) -> None:
        if isinstance(noise, bool) or not isinstance(noise, (int, float)) or noise < 0:
            raise ValueError(f"simulate noise must be a non-negative number, got {noise!r}")
        if devices is not None and (isinstance(devices, bool) or not isinstance(devices, int) or devices < 1):
            raise ValueError(f"simulate devices must be a positive integer, got {devices!r}")
        if isinstance(pace, bool) or not isinstance(pace, (int, float)) or not 0 <= pace <= 1000:
            raise ValueError(f"simulate pace must be a number of wall seconds per simulated second in [0, 1000], "
                             f"got {pace!r}")
        self.seed = seed
        self.noise = float(noise)
        self.factors = factors  # tuner.CalibrationFactors, or None for the tuner's defaults
        self.devices, self.pace = devices, float(pace)

    def capacity(self) -> int:
        # Unbounded unless a simulated cluster's size is given: nothing real is held.
        return self.devices or 1_000_000

    def close(self) -> None:
        return None

    def _rng(self, request: TrialRequest) -> random.Random:
        key = f"{self.seed}|{request.seed}|{request.layout.key}|{request.trial_id}|{request.model.name}"
        return random.Random(int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big"))

    def run(self, request: TrialRequest) -> TrialResult:
        t0 = time.perf_counter()
        model, cluster, training, layout = request.model, request.cluster, request.training, request.layout
        check_layout(layout, model=model, cluster=cluster, training=training)
        env = {"backend": "simulate", "source": "tuner analytical model", "noise_sigma": self.noise}
        if self.pace:
            env["pace"] = self.pace  # wall seconds per simulated second: the wall time is made up too

        options = request.options
        memory = tuner.estimate_memory(layout, model=model, cluster=cluster, training=training)
        peak = int(memory.total)
        capacity = min(cluster.device_memory, int(options.get("memory_cap_bytes") or cluster.device_memory))
        if peak > capacity:
            return TrialResult(
                status="oom",
                backend=self.name,
                simulated=True,
                peak_memory_bytes=peak,
                memory_measure=MEMORY_MEASURE,
                env=env,
                error=TrialError(
                    kind="oom",
                    message=(
                        f"predicted peak memory {peak} bytes exceeds device_memory={capacity}"
                        f" bytes of cluster {cluster.name!r}"
                        + (" (options.memory_cap_bytes)" if capacity < cluster.device_memory else "") + " (simulated)"
                    ),
                    bytes_requested=peak,
                ),
                wall_s=time.perf_counter() - t0,
                device_seconds=0.0,
            )

        kwargs = {} if self.factors is None else {"factors": self.factors}
        est = tuner.estimate_time(layout, model=model, cluster=cluster, training=training, **kwargs)
        rng = self._rng(request)
        # lognormvariate(0, s) has median 1: the noisy median stays centred on the model's figure.
        steps = [est.step_time_s * rng.lognormvariate(0.0, self.noise) for _ in range(request.measure_steps)]
        sleep, floor = float(options.get("sleep_per_step_s", 0.0)), float(options.get("min_step_s", 0.0))
        steps = [max(t + sleep, floor) for t in steps]
        warmup = [est.step_time_s + sleep] * request.warmup_steps  # not measured: the model's time, no noise
        failed = _injected_failure(request, warmup + steps, peak=peak, env=env, t0=t0, backend=self.name)
        if failed is not None:
            return failed
        step = statistics.median(steps)
        tokens = training.global_batch * model.seq_len
        mfu = None
        if cluster.device_kind == "cuda" and est.mfu is not None:
            mfu = est.mfu * est.step_time_s / step
        run_s = (request.warmup_steps + request.measure_steps) * step
        if self.pace:  # hold the devices for the run's time, scaled
            time.sleep(max(0.0, self.pace * run_s - (time.perf_counter() - t0)))
        return TrialResult(
            status="completed",
            backend=self.name,
            simulated=True,
            step_times_s=steps,
            step_time_s=step,
            tokens_per_s=tokens / step,
            tokens_per_s_per_device=tokens / step / layout.world_size,
            mfu=mfu,
            peak_memory_bytes=peak,
            memory_measure=MEMORY_MEASURE,
            env=env,
            wall_s=time.perf_counter() - t0,
            device_seconds=run_s * layout.world_size,
        )


def _injected_failure(request: TrialRequest, steps: list[float], *, peak: int, env: dict, t0: float,
                      backend: str) -> TrialResult | None:
    """The result of ``options.fail`` as the rank program would produce it (workers/train.py
    ``_inject_before_step``), or None when no failure is asked or its rank/step does not exist."""
    options = request.options
    fail = options.get("fail")
    rank, step = int(options.get("fail_rank", 0)), int(options.get("fail_step", 1))
    if fail is None or rank >= request.layout.world_size or step >= len(steps):
        return None
    done = sum(steps[:step])  # the steps that ran before it failed
    world = request.layout.world_size
    if fail == "crash":
        error = TrialError(kind="crash", message=f"injected crash on rank {rank} at step {step} (simulated)",
                           rank=rank, exception_type="builtins.RuntimeError")
    elif fail == "hang":
        error = timeout_error(rank=rank, seconds=request.step_timeout_s, what=f"step {step}", steps_done=step)
        done += request.step_timeout_s
    elif fail == "oom":
        nbytes = 2**50  # the rank program's 1 PiB allocation
        error = TrialError(kind="oom", message=f"injected out-of-memory on rank {rank} at step {step}: tried to "
                           f"allocate {nbytes} bytes (simulated)", rank=rank, bytes_requested=nbytes)
    elif fail == "nan":
        error = TrialError(kind="nan", message=f"non-finite loss at step {step}: inf (injected, simulated)", rank=rank)
    else:
        raise ValueError(f"options.fail must be one of crash, hang, oom, nan; got {fail!r}")
    return TrialResult(
        status=error.kind, backend=backend, simulated=True, peak_memory_bytes=peak if fail != "oom" else None,
        memory_measure=MEMORY_MEASURE, env=env, error=error, wall_s=time.perf_counter() - t0,
        device_seconds=done * world,
    )
