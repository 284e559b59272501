"""Raw probe timings made from known figures (what workers/probe.py would report on a cluster whose
figures they are), for the tests of tuner/_probe.py ``derive`` and of the store/engine paths, and a
backend whose ``run_program`` answers the probe's programs with them."""

from __future__ import annotations

import dataclasses
from typing import Any

from tuner import CalibrationFactors, LayerFigure, LinkFigure, ProbedFigures
from tuner._figures import OPS
from tuner._probe import FORMULAS
from tuner._timing import mesh_time
from workers.ray_backend import GangRun

SIZES = (256, 256 * 1024, 2 * 1024 * 1024)
ENV = {"torch": "2.13.0+cpu", "device_kind": "cpu", "device_name": "Test CPU", "cuda": None, "nccl": None,
       "driver": None, "host": "h", "python": "3", "meshtune": None, "platform": "p"}


def truth(*, layers: tuple[LayerFigure, ...] = (), step_s: float = 0.004, step_layer_s: float = 0.001,
          link: tuple[float, float] = (1e9, 3e-4)) -> ProbedFigures:
    """Figures of a made-up CPU cluster: every collective on the node at ``link`` (bw, latency)."""
    bw, lat = link
    return ProbedFigures(matmul_flops=1.2e11, attention_flops=1.5e10, compute_sharing=2.0,
                         links=tuple(LinkFigure("intra", op, bw * (1 + i / 10), lat * (1 + i), 4)
                                     for i, op in enumerate(OPS)),
                         layers=layers or (LayerFigure(1, False, 0.006, 0.0015, 0.003, 0.0005),
                                           LayerFigure(2, False, 0.02, 0.002, 0.01, 0.001),
                                           LayerFigure(2, True, 0.03, 0.001, 0.012, 0.0)),
                         recompute=(("full", 1.8),),
                         step_s=step_s, step_layer_s=step_layer_s, dp_overlap=0.25, fsdp_unit_s=0.002,
                         memory_overhead_bytes=300 * 2**20, allocator_overhead=0.05, dtype="float32")


def raw_of(figures: ProbedFigures, *, model: Any, cluster: Any, training: Any, seqs: tuple[int, int] = (1, 4),
           depths: tuple[int, int] = (1, 4)) -> dict[str, Any]:
    """What the rank program reports on a cluster of ``figures``: each time as the time model
    composes it from them (the inverse ``derive`` must undo)."""
    world = cluster.devices
    links = [{"tier": x.tier, "op": x.op, "group": 2 if x.op == "send_recv" else x.group, "sizes": list(SIZES),
              "times_s": [FORMULAS[x.op](s, 2 if x.op == "send_recv" else x.group, x.bandwidth, x.latency)
                          for s in SIZES]} for x in figures.links]
    gemm_flops, attn_flops = 1.0e9, 2.0e8
    base = dataclasses.replace(figures, layers=(), step_s=None, step_layer_s=None, dp_overlap=None,
                               grad_sync_unit_s=None, fsdp_unit_s=None, compute_sharing=None, recompute=())
    probed = dataclasses.replace(cluster, probed=base)
    f = CalibrationFactors()

    def modelled(layers: int, tp: int, dp: int, sp: bool, n: int, ac: str = "none") -> tuple[float, float, float]:
        mt = mesh_time(dataclasses.replace(model, layers=layers), probed, training, f, tp, 1, 1, dp, 1, 1)
        (c1, c0), (t1, t0), _, _ = mt.per_mb[ac, sp]
        return n * (c1 + t1) + c0 + t0, mt.dp[0][0], mt.dp[3][2]

    rows = []
    for x in figures.layers:
        dp = world // x.tp
        def fb(ac: str, factor: float, x: LayerFigure = x, dp: int = dp) -> list[list[float]]:
            return [[modelled(d, x.tp, dp, x.sp, n, ac)[0] + d * (x.layer_s + n * x.layer_per_seq_s) * factor
                     + x.ends_s + n * x.ends_per_seq_s for d in depths] for n in seqs]

        rows.append({"tp": x.tp, "dp": dp, "sp": x.sp, "layers": list(depths), "seqs": list(seqs), "fb_s": fb("none", 1)})
        if (x.tp, x.sp) == (1, False):
            rows[-1]["recompute_fb_s"] = {ac: fb(ac, r) for ac, r in figures.recompute}
    lo, hi = depths
    _, sync, zero3 = modelled(hi, 1, world, False, 1)
    nosync, hidden = 0.05, 1 - figures.dp_overlap
    units = hi + 1
    steps = {"layers": [lo, hi], "dp": world, "seqs": 1,
             "optimizer_s": [figures.step_s + d * figures.step_layer_s for d in depths],
             "step_nosync_s": nosync, "step_sync_s": nosync + hidden * sync + units * (figures.grad_sync_unit_s or 0),
             "step_zero3_s": nosync + hidden * (zero3 + 3 * units * figures.fsdp_unit_s)}
    live = 64 * 2**20
    return {"version": 1, "dtype": figures.dtype, "world": world, "device": "cpu", "notes": [],
            "memory": {"baseline_bytes": figures.memory_overhead_bytes, "live_bytes": live,
                       "held_bytes": int(live * (1 + figures.allocator_overhead))},
            "links": links, "gemm": {"flops": gemm_flops, "time_s": gemm_flops / figures.matmul_flops,
                                     "busy_s": 0.05 * (figures.compute_sharing or 1), "alone_s": 0.05},
            "attention": {"flops": attn_flops, "time_s": attn_flops / figures.attention_flops},
            "layers": rows, "steps": steps, "wall_s": 1.5, "env": dict(ENV)}


class ProbingBackend:
    """A backend whose ranks answer the probe's programs (workers/probe.py) with ``raw_of`` timings and
    run no trial: ``calls`` counts what each program was asked; ``fail`` makes the probe's ranks
    fail (a TrialError) or its gang not start (an exception)."""

    name = "ray"

    def __init__(self, figures: ProbedFigures, *, model: Any, cluster: Any, training: Any, env: dict | None = None,
                 fail: Any = None) -> None:
        self.raw = raw_of(figures, model=model, cluster=cluster, training=training)
        self.env = dict(env or ENV)
        self.fail = fail
        self.calls: list[str] = []

    def run_program(self, request: Any, program: Any = None) -> GangRun:
        from workers import TrialError

        name = getattr(program, "__name__", "?")
        self.calls.append(name)
        if name == "probe_rank" and isinstance(self.fail, BaseException):
            raise self.fail
        if name == "probe_rank" and self.fail is not None:
            return GangRun(reports=[], error=TrialError(**self.fail), hosts=["h"], wall_s=1.0)
        report = {"env": dict(self.env)} if name == "environment_rank" else {**self.raw, "env": dict(self.env)}
        return GangRun(reports=[report] * request.layout.world_size, error=None, hosts=["h"], wall_s=1.0)

    def capacity(self) -> int:
        return 4

    def close(self) -> None:
        pass


def store_probe(sessions: Any, figures: ProbedFigures, *, model: Any, cluster: Any, training: Any,
                backend: str = "ray") -> int:
    """A finished probe of ``cluster`` and ``model`` whose figures are ``figures``, stored as a row
    directly (api/probes/service.py ``save``), as a probe of that cluster would store it: no rank runs."""
    from api import store
    from api.probes import service as probes
    from tuner import PROBE_VERSION, to_dict

    hw = probes.hardware(cluster)
    fields = {"key": probes.probe_key(cluster=cluster, model=model, training=training, backend=backend),
              "env_fingerprint": "test", "version": PROBE_VERSION, "backend": backend, "cluster": to_dict(hw),
              "model": to_dict(model), "dtype": figures.dtype or probes.compute_dtype(cluster, training),
              "figures": figures.to_dict(), "raw": {}, "env": dict(ENV), "wall_s": 1.5}
    with store.session_scope(sessions) as s:
        return probes.save(s, fields).id
