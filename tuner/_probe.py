"""Figures measured on a cluster (``meshtune probe``) and how the time and memory models read them.

A probe (workers/probe.py runs it on the trials' own rank processes) times microbenchmarks: the
model's GEMMs and attention in the training dtype, each collective at each tier of links it can
reach, real layers and steps of the training loop, and the allocator. ``derive`` turns those raw
timings into ``ProbedFigures``; a ``ClusterSpec`` carrying them (``with_probe``) makes the one time
model (tuner/_timing.py) and memory model (tuner/_memory.py) use the measured figure wherever there
is one and the datasheet's everywhere else. ``figure_rows`` lists both, figure by figure, with
their ratio (``meshtune probe --show``, ``meshtune plan``, the dashboard). What each figure means: docs/tuner.md (tuner/_figures.py holds them).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tuner._figures import OPS, TIERS, LayerFigure, LinkFigure, ProbedFigures
from tuner._formulas import allgather_time, allreduce_time, alltoall_time

# Bump when what the probe measures or how ``derive`` reads it changes: older probes are re-run.
PROBE_VERSION = 1
TIER_NAMES = {"intra": "within a node", "domain": "fast domain", "inter": "network"}


def send_recv_time(nbytes: float, n: int, bw: float, lat: float) -> float:
    """One point-to-point message of ``nbytes`` (a pipeline stage's send): latency + bytes / bw."""
    return nbytes / bw + lat


# The formula each collective is costed by (tuner/_formulas.py; reduce-scatter moves what an
# all-gather does, Thakur et al. 2005): the fit below reads its bandwidth and latency factors from it.
FORMULAS = {"all_reduce": allreduce_time, "all_gather": allgather_time, "reduce_scatter": allgather_time,
            "all_to_all": alltoall_time, "send_recv": send_recv_time}


def with_probe(cluster: Any, probed: ProbedFigures | Mapping[str, Any] | None) -> Any:
    """``cluster`` with ``probed`` figures (a mapping is validated), or as it is for None."""
    if probed is None:
        return cluster
    return dataclasses.replace(cluster, probed=ProbedFigures.from_dict(probed) if isinstance(probed, Mapping)
                               else probed)


# --- from raw timings to figures --------------------------------------------------------------------


def fit_link(op: str, n: int, sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """(bandwidth, latency) of ``op`` on ``n`` ranks from times at payloads ``sizes`` (bytes, what the
    formula calls ``nbytes``): least squares of t = a x bytes / bw + h x lat, where a and h are the
    formula's own bandwidth and latency factors, with bw and lat kept positive. Bandwidth from the
    spread of the times over the sizes, latency from what is left at the smallest."""
    formula = FORMULAS[op]
    a = formula(1.0, n, 1.0, 0.0)  # seconds per byte at 1 B/s
    h = formula(0.0, n, 1.0, 1.0)  # latency steps
    xs = [a * s for s in sizes]
    if len(xs) >= 2 and max(xs) > min(xs):
        mx, my = statistics.fmean(xs), statistics.fmean(times)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, times, strict=True)) / sum((x - mx) ** 2 for x in xs)
    else:
        slope = 0.0
    big = max(range(len(xs)), key=lambda i: xs[i])
    # A flat or falling curve (noise, or a latency-bound link at these sizes): the largest payload's
    # time, all of it bandwidth, bounds the bandwidth from below.
    floor = times[big] / xs[big] if xs[big] > 0 else 0.0
    per_byte = slope if slope > 0 else floor
    per_byte = max(per_byte, 1e-30)
    small = min(range(len(xs)), key=lambda i: xs[i])
    lat = max(0.0, (times[small] - per_byte * xs[small]) / h) if h > 0 else 0.0
    return 1.0 / per_byte, lat


def derive(raw: Mapping[str, Any], *, model: Any, cluster: Any, training: Any) -> ProbedFigures:
    """The figures of one probe's ``raw`` timings (workers/probe.py ``probe_rank``'s report).

    Compute and links are read directly; the layer and step figures are what the real layers and
    steps took beyond what the time model, given the measured compute and links, says they take
    (tuner/_timing.py's own terms: nothing is costed twice)."""
    from tuner._timing import CalibrationFactors, mesh_time

    notes = list(raw.get("notes", []))
    gemm, attn = raw.get("gemm") or {}, raw.get("attention") or {}
    matmul = gemm["flops"] / gemm["time_s"] if gemm.get("time_s") else None
    sharing = None
    if gemm.get("alone_s") and gemm.get("busy_s") and int(raw.get("world", 1)) > 1:
        sharing = min(float(cluster.devices_per_node), max(1.0, gemm["busy_s"] / gemm["alone_s"]))
    attention = attn["flops"] / attn["time_s"] if attn.get("time_s") else None
    links = []
    for x in raw.get("links", []):
        bw, lat = fit_link(x["op"], int(x["group"]), x["sizes"], x["times_s"])
        links.append(LinkFigure(tier=x["tier"], op=x["op"], bandwidth=bw, latency=lat, group=int(x["group"])))
    base = ProbedFigures(matmul_flops=matmul, attention_flops=attention, links=tuple(links))  # what layers read
    probed_cluster = dataclasses.replace(cluster, probed=base)
    f = CalibrationFactors()

    def modelled(layers: int, tp: int, dp: int, sp: bool, seqs: int, ac: str = "none") -> float:
        """Compute + TP collectives of one micro-batch of ``seqs`` sequences of the model cut to
        ``layers`` layers under (tp, dp) on one stage, as the time model costs them."""
        mt = mesh_time(dataclasses.replace(model, layers=layers), probed_cluster, training, f, tp, 1, 1, dp, 1, 1)
        (c1, c0), (t1, t0), _, _ = mt.per_mb[ac, sp]
        return seqs * (c1 + t1) + c0 + t0

    def extra(fb: list[list[float]], seqs: list[int], tp: int, dp: int, sp: bool, lo: int, hi: int,
              ac: str = "none") -> dict[int, tuple[float, float]]:
        """Per micro-batch size: (a layer's, the ends') time beyond the model's, from two depths."""
        out = {}
        for n, (t_lo, t_hi) in zip(seqs, fb, strict=True):
            m_lo, m_hi = modelled(lo, tp, dp, sp, n, ac), modelled(hi, tp, dp, sp, n, ac)
            layer = max(0.0, ((t_hi - m_hi) - (t_lo - m_lo)) / (hi - lo))
            out[int(n)] = (layer, max(0.0, (t_lo - m_lo) - lo * layer))
        return out

    layer_figs, recompute = [], []
    for x in raw.get("layers", []):
        tp, dp, sp = int(x["tp"]), int(x["dp"]), bool(x["sp"])
        lo, hi = int(x["layers"][0]), int(x["layers"][1])
        per_seq = extra(x["fb_s"], x["seqs"], tp, dp, sp, lo, hi)
        (s1, (l1, e1)), (s2, (l2, e2)) = sorted(per_seq.items())[0], sorted(per_seq.items())[-1]
        dl = max(0.0, (l2 - l1) / (s2 - s1)) if s2 > s1 else 0.0
        de = max(0.0, (e2 - e1) / (s2 - s1)) if s2 > s1 else 0.0
        layer_figs.append(LayerFigure(tp=tp, sp=sp and tp > 1, layer_s=max(0.0, l1 - dl * s1), layer_per_seq_s=dl,
                                      ends_s=max(0.0, e1 - de * s1), ends_per_seq_s=de))
        for ac, fb in (x.get("recompute_fb_s") or {}).items():
            # a layer's extra under checkpointing against without, over the micro-batch sizes probed
            under = extra(fb, x["seqs"], tp, dp, sp, lo, hi, ac)
            plain = sum(per_seq[n][0] for n in under)
            if plain > 0:
                recompute.append((ac, max(1.0, sum(v[0] for v in under.values()) / plain)))

    step_s = step_layer = overlap = unit = fsdp = None
    st = raw.get("steps")
    if st:
        lo, hi = (int(v) for v in st["layers"])
        o_lo, o_hi = st["optimizer_s"]
        step_layer = max(0.0, (o_hi - o_lo) / (hi - lo)) if hi > lo else 0.0
        step_s = max(0.0, o_lo - lo * step_layer)
        # Real steps of the hi-layer model with one micro-batch, gradients synced and not: what the
        # sync added against the modelled all-reduce is what the step did not hide; beyond all of
        # it, a cost per FSDP unit. The same against ZeRO-3's modelled gathers and reduce-scatters.
        if st.get("step_sync_s") is not None:
            dp = int(st["dp"])
            mt = mesh_time(dataclasses.replace(model, layers=hi), probed_cluster, training, f, 1, 1, 1, dp, 1, 1)
            units = hi + 1  # workers/_data_parallel.py: one per block, one for the rest of the model
            sync, zero3 = mt.dp[0][0], mt.dp[3][2]
            exposed = max(0.0, st["step_sync_s"] - st["step_nosync_s"])
            if sync > 0:
                overlap = min(1.0, max(0.0, 1.0 - exposed / sync))
                unit = max(0.0, exposed - sync) / units
            if st.get("step_zero3_s") is not None and overlap is not None and overlap < 1:
                extra = max(0.0, st["step_zero3_s"] - st["step_nosync_s"]) / (1 - overlap) - zero3
                fsdp = max(0.0, extra) / (3 * units)  # two gathers and a reduce-scatter per unit
    mem = raw.get("memory") or {}
    overhead = int(mem["baseline_bytes"]) if mem.get("baseline_bytes") is not None else None
    alloc = None
    if mem.get("live_bytes"):
        alloc = max(0.0, (mem["held_bytes"] - mem["live_bytes"]) / mem["live_bytes"])
    return dataclasses.replace(base, compute_sharing=sharing, layers=tuple(layer_figs), recompute=tuple(recompute),
                               step_s=step_s,
                               step_layer_s=step_layer,
                               dp_overlap=overlap, grad_sync_unit_s=unit, fsdp_unit_s=fsdp,
                               memory_overhead_bytes=overhead, allocator_overhead=alloc,
                               dtype=str(raw.get("dtype", "")), notes=tuple(notes))


# --- probed vs datasheet --------------------------------------------------------------------------


@dataclass(frozen=True)
class FigureRow:
    """One figure of the models: the datasheet's value (with the default efficiency factors), the
    probed one, their ratio, and which one the models use."""

    name: str
    unit: str
    datasheet: float | None
    probed: float | None
    source: str  # "probed" or "datasheet"
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.probed is None or not self.datasheet:
            return None
        return self.probed / self.datasheet

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "ratio": self.ratio}


def _tier_present(cluster: Any, tier: str) -> bool:
    if tier == "intra":
        return cluster.devices_per_node > 1
    if tier == "domain":
        return cluster.domain_devices > cluster.devices_per_node and cluster.devices > cluster.devices_per_node
    return cluster.devices > cluster.domain_devices


def figure_rows(cluster: Any, probed: ProbedFigures | None = None) -> list[FigureRow]:
    """Every figure the models read, datasheet beside probed (``probed`` defaults to the cluster's)."""
    from tuner._memory import OVERHEAD_BYTES
    from tuner._timing import CalibrationFactors

    p = probed if probed is not None else getattr(cluster, "probed", None)
    f = CalibrationFactors()
    rows: list[FigureRow] = []

    def row(name: str, unit: str, datasheet: float | None, value: float | None, note: str = "") -> None:
        rows.append(FigureRow(name, unit, datasheet, value, "probed" if value is not None else "datasheet", note))

    row("matmul FLOP/s per device", "FLOP/s", cluster.peak_flops * f.compute_efficiency, p and p.matmul_flops,
        f"datasheet: peak x compute efficiency {f.compute_efficiency:g}")
    row("compute slowdown when all of a node's devices compute", "x", 1.0, p and p.compute_sharing,
        "datasheet: devices of their own")
    row("attention FLOP/s per device", "FLOP/s", cluster.peak_flops * min(f.attention_efficiency, f.compute_efficiency),
        p and p.attention_flops, f"datasheet: peak x attention efficiency {f.attention_efficiency:g}")
    sheet = {"intra": (cluster.intra_node_bandwidth * f.intra_bw_efficiency, cluster.intra_node_latency),
             "domain": (cluster.domain_bandwidth * f.intra_bw_efficiency, cluster.domain_latency),
             "inter": (cluster.inter_node_bandwidth * f.inter_bw_efficiency, cluster.inter_node_latency)}
    for tier in TIERS:
        if not _tier_present(cluster, tier):
            continue
        for op in OPS:
            link = p.link(tier, op) if p else None
            note = f"group of {link.group}" if link else ("" if p is None else "not probed: no group of this tier")
            bw, lat = sheet[tier]
            row(f"{op} bandwidth ({TIER_NAMES[tier]})", "B/s", bw, link and link.bandwidth, note)
            row(f"{op} latency ({TIER_NAMES[tier]})", "s", lat, link and link.latency, note)
    for x in (p.layers if p else ()):
        what = f"tp={x.tp}{' sp' if x.sp else ''}"
        row(f"layer fwd+bwd beyond the model, per micro-batch ({what})", "s", 0.0, x.layer_s)
        row(f"layer fwd+bwd beyond the model, per sequence ({what})", "s", 0.0, x.layer_per_seq_s)
        row(f"embedding+head+loss beyond the model, per micro-batch ({what})", "s", 0.0, x.ends_s)
        row(f"embedding+head+loss beyond the model, per sequence ({what})", "s", 0.0, x.ends_per_seq_s)
    for ac in ("selective", "full"):
        got = dict(p.recompute).get(ac) if p else None
        if got is not None:
            row(f"layer's extra under ac={ac}, vs without", "x", None, got,
                "datasheet: 1 + the repeated forward's share of the FLOPs")
    row("optimiser step, fixed per step", "s", 0.0, p and p.step_s)
    row("optimiser step, per layer", "s", 0.0, p and p.step_layer_s)
    row("data-parallel overlap", "", f.dp_overlap, p and p.dp_overlap)
    row("gradient all-reduce per FSDP unit, beyond the link (ZeRO-0)", "s", 0.0, p and p.grad_sync_unit_s)
    row("all-gather or reduce-scatter per FSDP unit, beyond the link (ZeRO-1-3)", "s", 0.0, p and p.fsdp_unit_s)
    row("memory held before the model, per device", "B", float(OVERHEAD_BYTES[cluster.device_kind]),
        None if p is None or p.memory_overhead_bytes is None else float(p.memory_overhead_bytes))
    row("allocator overhead over live tensors", "", 0.0, p and p.allocator_overhead)
    return rows


def unprobed_tiers(cluster: Any, probed: ProbedFigures | None = None) -> list[str]:
    """The tiers of links ``cluster`` has on which ``probed`` (default: the cluster's) timed no
    collective: the time model keeps the datasheet's figures there (tuner/_timing.py ``_link``). A
    probe of fewer nodes than the cluster's reaches fewer tiers (one node: no network)."""
    p = probed if probed is not None else getattr(cluster, "probed", None)
    have = {x.tier for x in (p.links if p else ())}
    return [t for t in TIERS if _tier_present(cluster, t) and t not in have]


def summary(cluster: Any, probed: ProbedFigures | None = None) -> str:
    """One line: how many figures are probed and which tiers fell back to the datasheet."""
    rows = figure_rows(cluster, probed)
    n = sum(r.source == "probed" for r in rows)
    p = probed if probed is not None else getattr(cluster, "probed", None)
    tiers = sorted({x.tier for x in (p.links if p else ())}, key=TIERS.index)
    absent = [TIER_NAMES[t] for t in unprobed_tiers(cluster, p)]
    text = f"{n} of {len(rows)} figures probed"
    if p is not None:
        text += f"; links probed {', '.join(TIER_NAMES[t] for t in tiers) or 'nowhere'}"
        if absent:
            text += f", datasheet for {', '.join(absent)}"
        missing = [TIER_NAMES[t] for t in TIERS if not _tier_present(cluster, t)]
        if missing:
            text += f" ({' and '.join(missing)}: none on this cluster)"
    return text


@dataclass(frozen=True)
class ProbeTargets:
    """What one probe measures: the tiers' groups of ranks and the (tp, sp) configurations of layers."""

    tiers: dict[str, list[int]] = field(default_factory=dict)  # tier -> the ranks of its group
    layers: tuple[tuple[int, bool], ...] = ()


def probe_targets(cluster: Any, tp_sp: Sequence[tuple[int, bool]]) -> ProbeTargets:
    """The group of each tier the cluster has (node: the first node's ranks; fast domain: the first
    rank of each node of the first domain; network: the first rank of each domain) and the sorted
    distinct (tp, sp) the layouts use (tp=1 always: the layer of a layout without TP)."""
    d, dom = cluster.devices_per_node, cluster.domain_devices
    tiers: dict[str, list[int]] = {}
    if d > 1:
        tiers["intra"] = list(range(d))
    if dom > d and cluster.devices > d:
        tiers["domain"] = list(range(0, min(dom, cluster.devices), d))
    if cluster.devices > dom:
        tiers["inter"] = list(range(0, cluster.devices, dom))
    tiers = {k: v for k, v in tiers.items() if len(v) > 1}
    configs = sorted({(1, False), *((int(t), bool(s) and t > 1) for t, s in tp_sp)})
    return ProbeTargets(tiers=tiers, layers=tuple(configs))
