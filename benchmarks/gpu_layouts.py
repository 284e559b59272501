"""One short, prepared GPU check: real trials of a 1B-class model under a few layouts, measured next to
the tuner's prediction, plus the CUDA paths CI never runs. Written for a lent single H200 (budget:
< 6 minutes of device time), works on N GPUs, and runs on CPU as a smoke test.

    python3 benchmarks/gpu_layouts.py --out $OUT/gpu.json                   # the device machine
    python benchmarks/gpu_layouts.py --model tiny --device cpu --out /tmp/g.json   # smoke, CPU

What runs, in order, under one hard time budget (``--budget-s``; whatever would start past it is
skipped and listed as skipped, never silently dropped):

0. the cluster probe (workers/probe.py, as ``meshtune probe`` runs it, on ``--devices`` fresh rank
   processes): GEMM and attention FLOP/s at the model's shapes in bf16, collectives between the
   GPUs (with two or more), real layers and steps, the allocator; its figures (tuner/_probe.py)
   are printed beside the datasheet's and the predictions below are made with them (the
   datasheet's prediction is kept beside each);
1. the CUDA chunk-attention test of context parallelism (``pytest tests/workers/test_cp_ep.py -k cuda``);
2. world-size-1 layouts of the model (bf16 on CUDA, seq = the preset's, 2048 for ``llama3-1b``)
   with different micro-batch sizes and activation checkpointing. ZeRO is not varied at world
   size 1: with no data-parallel axis there is nothing to shard, the workers apply no FSDP;
3. OOM classification: a layout under a real per-rank memory cap (``memory_cap_bytes``: the CUDA
   caching allocator's per-process fraction) smaller than the model's fp32 weights must come back
   as status ``oom`` with the bytes asked for (CPU smoke mode: a real 1 PiB allocation instead, as
   an RLIMIT_DATA cap small enough for ``tiny`` also starves gloo's thread creation);
4. with >= 2 visible devices: multi-rank layouts (NCCL process group, FSDP/ZeRO-3, TP, PP).

Every trial is the workers' real rank program, ``workers._launch.run_rank`` -> ``train_trial``
(the code a Ray actor or ``torchrun`` rank runs), on ``world`` fresh processes this script starts
itself (rank 0 hosts the TCP store): neither Ray nor the API's packages are needed, so it runs on a
bare image that has torch. A trial that hangs is killed at its timeout (only its own processes).

Printed: the probe's figures beside the datasheet's, then one table, measured beside predicted
(``tuner.estimate_time`` / ``estimate_memory``; "pred" with the probed figures, "sheet" the
datasheet's tokens/s): tokens/s, tokens/s per device, MFU (model FLOPs / the cluster preset's peak), peak memory allocated
and reserved (CUDA caching allocator; CPU: VmHWM), status; then the checks, PASS/FAIL. ``--out``
gets all of it as JSON. Exit status 0 when every check passed and nothing was skipped for the
budget, 1 when a check failed, 3 when all that ran passed but the budget cut the run short.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tuner import (  # noqa: E402
    Layout,
    check_layout,
    cluster_spec,
    estimate_memory,
    estimate_time,
    figure_rows,
    model_spec,
    training_spec,
)
from tuner._probe import summary as probe_summary  # noqa: E402
from workers._contract import TrialError, TrialRequest, TrialResult  # noqa: E402

GiB = 2**30
START_MARGIN_S = 15.0  # do not start a trial with less budget left than this


@dataclass
class Case:
    """One trial to run: a name, a layout, request options, and the status it is expected to end with."""

    name: str
    layout: Layout
    expect: str = "completed"
    options: dict[str, Any] = field(default_factory=dict)


def plan_cases(devices: int, cuda: bool, global_batch: int) -> list[Case]:
    """World-size-1 layouts first (the lent machine has one GPU), the OOM check, then multi-rank ones."""
    cases = [
        Case("ws1-mbs1-ac_none", Layout(mbs=1)),
        Case("ws1-mbs2-ac_none", Layout(mbs=2)),
        Case("ws1-mbs4-ac_selective", Layout(mbs=4, ac="selective")),
        Case("ws1-mbs8-ac_full", Layout(mbs=min(8, global_batch), ac="full")),
    ]
    if cuda:  # a real cap below the fp32 master weights of the model: allocating the weights must fail
        cases.append(Case("oom-memory-cap", Layout(mbs=1), expect="oom", options={"memory_cap_bytes": -1}))
    else:  # CPU caps (RLIMIT_DATA) also starve gloo's threads (EAGAIN): a real 1 PiB allocation instead
        cases.append(Case("oom-huge-alloc", Layout(mbs=1), expect="oom", options={"fail": "oom"}))
    if devices >= 2:
        n = devices
        cases.append(Case(f"dp{n}-zero3", Layout(dp=n, zero=3, mbs=1)))
        cases.append(Case(f"dp{n}-zero0", Layout(dp=n, zero=0, mbs=1)))
        if n % 2 == 0:
            cases.append(Case(f"tp2-dp{n // 2}-sp", Layout(tp=2, dp=n // 2, sp=True, mbs=1)))
            cases.append(Case(f"pp2-dp{n // 2}-1f1b", Layout(pp=2, dp=n // 2, mbs=1, schedule="1f1b")))
    return cases


# --- one trial on fresh processes -------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(request_path: str, out_dir: str) -> int:
    """A rank process: ``run_rank`` on the rendezvous env this script set, outcome -> rank<r>.json.
    A request with ``options["probe"]`` runs the probe's rank program instead of a trial's."""
    from workers._launch import run_rank

    request = TrialRequest.from_dict(json.loads(Path(request_path).read_text()))
    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    device = f"cuda:{local}" if request.cluster.device_kind == "cuda" else "cpu"
    program = None
    if "probe" in request.options:
        from workers.probe import probe_rank as program
    outcome = run_rank(request, rank=rank, world_size=world, local_rank=local, master_addr="127.0.0.1",
                       master_port=int(os.environ["MASTER_PORT"]), device=device, init_timeout_s=60.0,
                       program=program)
    tmp = Path(out_dir) / f".rank{rank}.json"
    tmp.write_text(json.dumps(outcome))
    tmp.rename(Path(out_dir) / f"rank{rank}.json")
    return 0


def run_trial(request: TrialRequest, *, timeout_s: float, work: Path) -> TrialResult:
    """Start one process per rank, wait at most ``timeout_s``, merge the outcomes (workers.aggregate)."""
    from workers.aggregate import aggregate

    outcomes, wall, error = _run_ranks(request, timeout_s=timeout_s, work=work)
    world = request.layout.world_size
    if error is None:
        return aggregate([outcomes[r]["report"] for r in range(world)], request, backend="gpu_layouts", wall_s=wall)
    return TrialResult(status=error.kind, backend="gpu_layouts", error=error, wall_s=wall, device_seconds=wall * world)


def run_probe(model: Any, cluster: Any, training: Any, cases: list[Case], *, timeout_s: float, budget_s: float,
              work: Path) -> dict[str, Any]:
    """The cluster probe on ``cluster.devices`` fresh processes (workers/probe.py), its figures read by
    tuner/_probe.py: ``{"figures", "raw", "wall_s"}``, or ``{"error"}``."""
    from tuner import ProbedFigures
    from tuner._probe import derive
    from workers.probe import probe_request

    tp_sp = sorted({(c.layout.tp, c.layout.sp) for c in cases if c.layout.world_size == cluster.devices})
    request = probe_request(model, cluster, training, tp_sp=tp_sp, max_mbs=max(c.layout.mbs for c in cases),
                            budget_s=budget_s)
    outcomes, wall, error = _run_ranks(request, timeout_s=timeout_s, work=work)
    if error is not None:
        return {"error": f"{error.kind}: {error.message}", "wall_s": wall}
    raw = dict(outcomes[0]["report"])
    env = raw.pop("env", {})
    figures: ProbedFigures = derive(raw, model=model, cluster=cluster, training=training)
    return {"figures": figures, "raw": raw, "env": env, "wall_s": wall}


def _run_ranks(request: TrialRequest, *, timeout_s: float, work: Path) -> tuple[dict[int, Any], float, TrialError | None]:
    """Start one process per rank, wait at most ``timeout_s``: (outcome per rank, wall seconds, the
    error that explains a failure or None)."""
    world = request.layout.world_size
    work.mkdir(parents=True, exist_ok=True)
    (work / "request.json").write_text(json.dumps(request.to_dict()))
    port, t0 = _free_port(), time.monotonic()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_PORT=str(port),
                   PYTHONUNBUFFERED="1")
        if request.cluster.device_kind == "cpu":
            env["OMP_NUM_THREADS"] = "1"
        with open(work / f"rank{rank}.log", "wb") as log:
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "_rank", str(work / "request.json"), str(work)],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT,
            ))
    deadline = t0 + timeout_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.1)
    hung = [r for r, p in enumerate(procs) if p.poll() is None]
    for p in procs:  # only this trial's processes (each leads its own session)
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    wall = time.monotonic() - t0
    outcomes = {r: json.loads((work / f"rank{r}.json").read_text())
                for r in range(world) if (work / f"rank{r}.json").exists()}
    if len(outcomes) == world and all("report" in o for o in outcomes.values()):
        return outcomes, wall, None
    errors = [(o.get("in_collective", False), r, TrialError(**o["error"])) for r, o in outcomes.items() if "error" in o]
    if errors:  # a rank's own failure before its peers' consequences inside collectives
        error = sorted(errors, key=lambda e: (e[2].kind not in ("oom", "nan"), e[0], e[1]))[0][2]
    elif hung:
        error = TrialError(kind="timeout", message=f"ranks {hung} still running after {timeout_s:.0f} s; killed")
    else:
        tail = (work / "rank0.log").read_text(errors="replace")[-2000:]
        error = TrialError(kind="crash", message="a rank exited without an outcome", traceback_tail=tail)
    return outcomes, wall, error


# --- the run ---------------------------------------------------------------------------------------


def _prediction(request: TrialRequest, probed: Any = None) -> dict[str, Any]:
    """The tuner's prediction of the trial, with the probe's figures when there are some (the
    datasheet's beside it, as ``datasheet``)."""
    if probed is not None:
        out = _prediction(replace(request, cluster=replace(request.cluster, probed=probed)))
        return {**out, "figures": "probed", "datasheet": _prediction(request)}
    kw = {"model": request.model, "cluster": request.cluster, "training": request.training}
    try:
        mem = estimate_memory(request.layout, **kw)
        est = estimate_time(request.layout, **kw)
    except ValueError as exc:  # the model's own limits: keep the measurement, say why there is no figure
        return {"error": str(exc)}
    return {"tokens_per_s": est.tokens_per_s, "tokens_per_s_per_device": est.tokens_per_s_per_device,
            "mfu": est.mfu, "step_time_s": est.step_time_s, "peak_memory_bytes": int(mem.total)}


def _cp_cuda_test(timeout_s: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/workers/test_cp_ep.py", "-k", "cuda"]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"ok": False, "detail": f"timed out after {timeout_s:.0f} s", "wall_s": time.monotonic() - t0}
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    summary = lines[-1] if lines else ""
    ok = proc.returncode == 0 and " passed" in summary and "failed" not in summary
    return {"ok": ok, "detail": summary, "returncode": proc.returncode, "wall_s": time.monotonic() - t0,
            "output_tail": "\n".join(lines[-40:]) if not ok else ""}


def _write(path: str | None, report: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=2, default=str))


def _fmt(v: Any, spec: str) -> str:
    width = int(spec.split(".")[0] or 0)
    return "-".rjust(width) if v is None else format(v, spec)


def print_probe(cluster: Any, probed: Any) -> None:
    """The probe's figures beside the datasheet's (as ``meshtune probe`` prints them)."""
    print(f"  {'figure':<64} {'datasheet':>12} {'probed':>12} {'ratio':>8}")
    for r in figure_rows(cluster, probed):
        ratio = "-" if r.ratio is None else f"{r.ratio:.3g}x"
        print(f"  {r.name:<64} {_fmt(r.datasheet, '12.4g')} {_fmt(r.probed, '12.4g')} {ratio:>8}")


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'case':<24} {'layout':<44} {'status':<10} {'tok/s':>9} {'pred':>9} {'sheet':>9} {'tok/s/dev':>9} "
            f"{'MFU':>6} {'pred':>6} {'alloc GiB':>9} {'resv GiB':>8} {'pred GiB':>8} {'step s':>7}")
    print(head)
    print("-" * len(head))
    for row in rows:
        r, p = row.get("result") or {}, row.get("prediction") or {}
        gib = [None if x is None else x / GiB
               for x in (r.get("peak_memory_bytes"), r.get("peak_reserved_bytes"), p.get("peak_memory_bytes"))]
        print(f"{row['case']:<24} {row['layout']:<44} {row['status']:<10} "
              f"{_fmt(r.get('tokens_per_s'), '9.0f')} {_fmt(p.get('tokens_per_s'), '9.0f')} "
              f"{_fmt((p.get('datasheet') or p).get('tokens_per_s'), '9.0f')} "
              f"{_fmt(r.get('tokens_per_s_per_device'), '9.0f')} {_fmt(r.get('mfu'), '6.3f')} {_fmt(p.get('mfu'), '6.3f')} "
              f"{_fmt(gib[0], '9.2f')} {_fmt(gib[1], '8.2f')} {_fmt(gib[2], '8.2f')} {_fmt(r.get('step_time_s'), '7.3f')}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_rank"]:
        return _rank_main(*argv[1:3])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-1b", help="model preset (default llama3-1b)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--devices", type=int, default=None, help="ranks of the multi-rank layouts (default: all visible)")
    ap.add_argument("--global-batch", type=int, default=16, help="sequences per step (default 16)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--measure", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=330.0, help="hard wall budget of the whole run (default 330)")
    ap.add_argument("--trial-timeout-s", type=float, default=150.0, help="per trial, start-up included")
    ap.add_argument("--cases", default=None, help="comma-separated case names to run (default: all planned)")
    ap.add_argument("--skip-pytest", action="store_true", help="skip the CUDA CP attention test")
    ap.add_argument("--skip-probe", action="store_true", help="skip the cluster probe (predictions from the datasheet)")
    ap.add_argument("--probe-budget-s", type=float, default=60.0, help="the probe's own budget on the ranks (default 60)")
    ap.add_argument("--out", default=None, help="write the JSON report here")
    args = ap.parse_args(argv)
    t_start = time.monotonic()

    def left() -> float:
        return args.budget_s - (time.monotonic() - t_start)

    import torch  # the driver only counts devices; ranks create the CUDA contexts

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("no CUDA device visible: run with --device cpu for the smoke mode", file=sys.stderr)
        return 2
    visible = torch.cuda.device_count() if cuda else (os.cpu_count() or 1)
    devices = min(visible, args.devices or visible) if cuda else (args.devices or 1)
    model = model_spec(args.model)
    training = training_spec({"global_batch": args.global_batch, "precision": "bf16"}, seq_len=model.seq_len)
    base_cluster = cluster_spec("h200" if cuda else "cpu-local")
    report: dict[str, Any] = {
        "model": asdict(model), "device": args.device, "visible_devices": visible, "devices_used": devices,
        "torch": torch.__version__, "cuda": torch.version.cuda, "budget_s": args.budget_s,
        "peak_flops_for_mfu": base_cluster.peak_flops, "cluster_preset": base_cluster.name,
        "trials": [], "checks": [], "skipped": [], "over_budget": [],
    }
    print(f"meshtune gpu_layouts: model {model.name} (seq {model.seq_len}), {args.device} x{devices} "
          f"(visible {visible}), torch {torch.__version__} cuda {torch.version.cuda}, budget {args.budget_s:.0f} s")

    def check(name: str, ok: bool, detail: str) -> None:
        report["checks"].append({"name": name, "ok": ok, "detail": detail})
        print(f"  [{'PASS' if ok else 'FAIL'}] {name}: {detail}")

    # 1. The CUDA chunk attention of context parallelism (single process, no collectives).
    if cuda and not args.skip_pytest:
        cp = _cp_cuda_test(timeout_s=max(10.0, min(120.0, left() - 60.0)))
        report["cp_cuda_test"] = cp
        check("cp chunk attention on cuda (pytest tests/workers/test_cp_ep.py -k cuda)", cp["ok"], cp["detail"])
    else:
        report["skipped"].append("cp cuda pytest: " + ("--skip-pytest" if cuda else "no CUDA in --device cpu"))

    # 2.-4. Trials.
    cases = plan_cases(devices, cuda, args.global_batch)
    if args.cases:
        wanted = set(args.cases.split(","))
        unknown = wanted - {c.name for c in cases}
        if unknown:
            print(f"--cases: unknown {sorted(unknown)} (planned: {[c.name for c in cases]})", file=sys.stderr)
            return 2
        cases = [c for c in cases if c.name in wanted]
    rows: list[dict[str, Any]] = []
    probed = None
    with tempfile.TemporaryDirectory(prefix="meshtune-gpu-") as tmp:
        # 0. The probe first: the predictions of the trials are made with its figures.
        probe_cluster = replace(base_cluster, nodes=1, devices_per_node=devices)
        if args.skip_probe:
            report["skipped"].append("probe: --skip-probe")
        elif left() < START_MARGIN_S + args.probe_budget_s:
            report["skipped"].append(f"probe: skipped, over the {args.budget_s:.0f} s budget")
            report["over_budget"].append("probe")
            print(f"  probe: skipped, over the {args.budget_s:.0f} s budget")
        else:
            probe = run_probe(model, probe_cluster, training, cases or plan_cases(devices, cuda, args.global_batch),
                              timeout_s=min(left(), 2 * args.probe_budget_s + 60), budget_s=args.probe_budget_s,
                              work=Path(tmp) / "probe")
            probed = probe.get("figures")
            report["probe"] = {k: (v.to_dict() if k == "figures" else v) for k, v in probe.items()}
            if probed is not None:
                report["probe"]["rows"] = [r.to_dict() for r in figure_rows(probe_cluster, probed)]
                report["probe"]["summary"] = probe_summary(probe_cluster, probed)
            ok = probed is not None
            check("cluster probe (figures for the predictions)", ok,
                  f"{probe_summary(probe_cluster, probed)} in {probe['wall_s']:.1f} s" if ok else probe["error"])
            if ok:
                print_probe(probe_cluster, probed)
            _write(args.out, report)
        for i, case in enumerate(cases):
            if left() < START_MARGIN_S:
                reason = f"{case.name}: skipped, over the {args.budget_s:.0f} s budget"
                report["skipped"].append(reason)
                report["over_budget"].append(case.name)
                print(f"  {reason}")
                continue
            world = case.layout.world_size
            cluster = replace(base_cluster, nodes=1, devices_per_node=world)
            options = dict(case.options)
            if options.get("memory_cap_bytes") == -1:  # half the fp32 weights: cannot even hold the model
                options["memory_cap_bytes"] = max(1, model.params * 4 // 2)
            request = TrialRequest(model=model, cluster=cluster, training=training, layout=case.layout,
                                   warmup_steps=args.warmup, measure_steps=args.measure, step_timeout_s=60.0,
                                   options=options)
            try:
                check_layout(case.layout, model=model, cluster=cluster, training=training)
            except ValueError as exc:  # e.g. a batch that 3 GPUs cannot split: not this machine's layout
                report["skipped"].append(f"{case.name}: not a valid layout here: {exc}")
                print(f"  {case.name}: skipped, not a valid layout here: {exc}")
                continue
            result = run_trial(request, timeout_s=min(args.trial_timeout_s, left()), work=Path(tmp) / str(i))
            row = {"case": case.name, "layout": case.layout.key, "status": result.status, "expect": case.expect,
                   "options": options, "result": result.to_dict(), "prediction": _prediction(request, probed)}
            rows.append(row)
            report["trials"].append(row)
            if result.env.get("device_name") and "env" not in report:
                report["env"] = result.env
            err = result.error
            detail = f"status {result.status} in {result.wall_s:.1f} s"
            if err is not None:
                detail += f" ({err.kind} rank {err.rank}: {err.message[:160]}"
                detail += f"; bytes_requested={err.bytes_requested})" if err.kind == "oom" else ")"
            ok = result.status == case.expect
            if case.expect == "oom":
                ok = ok and err is not None and bool(err.bytes_requested)
            name = f"{case.name} ({'NCCL, ' if cuda and world > 1 else ''}expect {case.expect})"
            check(name, ok, detail)
            _write(args.out, report)  # after every trial: a call cut short still leaves its numbers

    print()
    print_table(rows)
    if report["skipped"]:
        print("skipped: " + "; ".join(report["skipped"]))
    report["elapsed_s"] = time.monotonic() - t_start
    ok = all(c["ok"] for c in report["checks"])
    report["ok"] = ok
    print(f"{sum(c['ok'] for c in report['checks'])}/{len(report['checks'])} checks passed in "
          f"{report['elapsed_s']:.0f} s" + (f"; {len(report['over_budget'])} cases over budget" if report["over_budget"] else ""))
    _write(args.out, report)
    return 1 if not ok else (3 if report["over_budget"] else 0)


if __name__ == "__main__":
    sys.exit(main())
