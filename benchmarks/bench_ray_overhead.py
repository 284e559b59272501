"""Launch overhead of the Ray backend against plain torchrun, same job, same machine, one run.

    python benchmarks/bench_ray_overhead.py [--nproc 4 --layout tp=2,dp=2 --model tiny ...]

1. start a local Ray and run the trial once through ``RayBackend`` (cold: the gang pool starts its
   rank processes and imports torch);
2. run it again and time the whole ``RayBackend.run`` call at the driver (warm pool: the trial as
   a sweep sees it — validation, placement, a fresh process group, the training steps, results);
3. run the same trial under ``torchrun --standalone --nproc-per-node N -m workers.torchrun_main``
   and time the whole command (process start-up, import torch, rendezvous, the same rank program);
4. print both wall times, the steps' median time of each (the training itself should agree), and
   ratio = Ray (warm) / torchrun. Goal: <= 1.10.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GOAL = 1.10


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--model", default="tiny")
    p.add_argument("--cluster", default="cpu-local")
    p.add_argument("--layout", default="tp=2,dp=2")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--measure", type=int, default=5)
    args = p.parse_args()

    import ray

    from workers.cli_request import build_request
    from workers.ray_backend import RayBackend

    ns = argparse.Namespace(model=args.model, cluster=args.cluster, layout=args.layout,
                            global_batch=args.global_batch, warmup=args.warmup, measure=args.measure,
                            step_timeout=120.0, seed=0, option=[])
    request = build_request(ns)
    assert request.layout.world_size == args.nproc, "--nproc must equal the layout's world size"

    ray.init(num_cpus=max(os.cpu_count() or 1, args.nproc), include_dashboard=False, log_to_driver=False)
    backend = RayBackend()
    try:
        t0 = time.perf_counter()
        cold = backend.run(request)
        cold_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        warm = backend.run(request)
        ray_s = time.perf_counter() - t0
    finally:
        backend.close()
        ray.shutdown()
    assert cold.ok and warm.ok, (cold.error, warm.error)

    with tempfile.TemporaryDirectory() as out:
        cmd = [
            "torchrun", "--standalone", "--nproc-per-node", str(args.nproc), "-m", "workers.torchrun_main",
            "--model", args.model, "--cluster", args.cluster, "--layout", args.layout,
            "--global-batch", str(args.global_batch), "--warmup", str(args.warmup),
            "--measure", str(args.measure), "--out-dir", out,
        ]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        torchrun_s = time.perf_counter() - t0
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        return 1
    baseline = json.loads(proc.stdout.strip().splitlines()[-1])

    ratio = ray_s / torchrun_s
    print(f"job: {args.model} on {args.cluster}, layout {request.layout.key}, {args.nproc} ranks, "
          f"{args.warmup}+{args.measure} steps, global batch {args.global_batch}")
    print(f"ray backend, cold pool (first trial): {cold_s:8.2f} s")
    print(f"ray backend, warm pool (second trial): {ray_s:8.2f} s   step median {warm.step_time_s:.4f} s")
    print(f"plain torchrun:                        {torchrun_s:8.2f} s   step median {baseline['step_time_s']:.4f} s")
    print(f"ratio ray(warm) / torchrun = {ratio:.3f}  (goal <= {GOAL:.2f}: {'met' if ratio <= GOAL else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
