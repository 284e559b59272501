"""The same trial under plain ``torchrun`` (no Ray): the baseline of benchmarks/bench_ray_overhead.py.

    torchrun --standalone --nproc-per-node 4 -m workers.torchrun_main \\
        --model tiny --cluster cpu-local --layout tp=2,dp=2 --global-batch 8 --out-dir /tmp/t

Every rank runs ``workers._launch.run_rank`` — the code path of a Ray actor, with torchrun's
rendezvous (``env://``) instead of a fresh port — and writes its outcome to ``OUT_DIR/rank<r>.json``;
rank 0 then waits for all of them, merges them with ``workers.aggregate`` and prints the
``TrialResult`` JSON on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from workers._contract import TrialError, TrialResult
from workers.cli_request import build_request


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m workers.torchrun_main")
    p.add_argument("--model", default="tiny")
    p.add_argument("--cluster", default="cpu-local")
    p.add_argument("--layout", required=True)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--measure", type=int, default=3)
    p.add_argument("--step-timeout", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--option", action="append", default=[])
    p.add_argument("--out-dir", default=None, help="shared directory for the ranks' outcomes")
    p.add_argument("--collect-timeout", type=float, default=300.0)
    return p


def main(argv: list[str] | None = None) -> int:
    t0 = time.monotonic()
    args = _parser().parse_args(argv)
    request = build_request(args)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    out = Path(args.out_dir or Path(tempfile.gettempdir()) / f"meshtune-torchrun-{run_id}-{os.environ['MASTER_PORT']}")
    out.mkdir(parents=True, exist_ok=True)

    import gc

    import workers.train  # noqa: F401 - imported before the freeze, as a Ray rank process does
    from workers._launch import run_rank

    gc.collect()
    gc.freeze()  # the trial's garbage collections then skip torch's objects (workers/_gangs.py)
    device = f"cuda:{local}" if request.cluster.device_kind == "cuda" else "cpu"
    outcome = run_rank(
        request,
        rank=rank,
        world_size=world,
        local_rank=local,
        master_addr=os.environ["MASTER_ADDR"],
        master_port=int(os.environ["MASTER_PORT"]),
        device=device,
        init_method="env://",
    )
    tmp = out / f".rank{rank}.json"
    tmp.write_text(json.dumps(outcome))
    tmp.rename(out / f"rank{rank}.json")  # atomic: rank 0 never reads a half-written file
    if rank != 0:
        return 0

    deadline = time.monotonic() + args.collect_timeout
    files = [out / f"rank{r}.json" for r in range(world)]
    while not all(f.exists() for f in files) and time.monotonic() < deadline:
        time.sleep(0.02)
    outcomes = [json.loads(f.read_text()) for f in files if f.exists()]
    errors = [TrialError(**o["error"]) for o in outcomes if "error" in o]
    wall = time.monotonic() - t0
    if errors or len(outcomes) < world:
        error = errors[0] if errors else TrialError(kind="timeout", message="not every rank reported")
        result = TrialResult(status=error.kind, backend="torchrun", error=error, wall_s=wall)
    else:
        from workers.aggregate import aggregate

        result = aggregate([o["report"] for o in outcomes], request, backend="torchrun", wall_s=wall)
    json.dump(result.to_dict(), sys.stdout)
    sys.stdout.write("\n")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
