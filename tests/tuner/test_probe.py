"""The cluster probe's pure logic (tuner/_probe.py): reading figures from timings, and the one time and
memory model using each probed figure in place of the datasheet's."""

from __future__ import annotations

import dataclasses

import pytest

import tuner
from tests.helpers.probe_raw import SIZES, raw_of, truth
from tuner import (
    CalibrationFactors,
    LayerFigure,
    Layout,
    ProbedFigures,
    SpecError,
    estimate_memory,
    estimate_time,
)
from tuner._figures import OPS
from tuner._formulas import allgather_time, allreduce_time
from tuner._probe import FORMULAS, derive, figure_rows, fit_link, probe_targets, summary, with_probe

MODEL = tuner.model_spec("tiny")
CLUSTER = tuner.cluster_spec("cpu-local")
TRAINING = tuner.training_spec({"global_batch": 16, "precision": "fp32"})


@pytest.mark.parametrize("op", OPS)
def test_fit_link_reads_back_the_bandwidth_and_latency_of_each_collective(op):
    n = 2 if op == "send_recv" else 4
    times = [FORMULAS[op](s, n, 2.5e9, 4e-4) for s in SIZES]
    bw, lat = fit_link(op, n, SIZES, times)
    assert bw == pytest.approx(2.5e9, rel=1e-9) and lat == pytest.approx(4e-4, rel=1e-9)


def test_fit_link_of_a_flat_curve_is_a_lower_bound_on_bandwidth_and_no_negative_latency():
    bw, lat = fit_link("all_reduce", 4, SIZES, [1e-3, 1e-3, 0.9e-3])  # noise: the largest is the fastest
    assert bw == pytest.approx(2 * 3 / 4 * SIZES[-1] / 0.9e-3) and lat >= 0


def test_derive_reads_back_the_figures_that_made_the_timings():
    want = truth()
    got = derive(raw_of(want, model=MODEL, cluster=CLUSTER, training=TRAINING), model=MODEL, cluster=CLUSTER,
                 training=TRAINING)
    assert got.matmul_flops == pytest.approx(want.matmul_flops) and got.attention_flops == pytest.approx(want.attention_flops)
    assert got.compute_sharing == pytest.approx(want.compute_sharing)
    for w, g in zip(want.links, got.links, strict=True):
        assert (g.tier, g.op) == (w.tier, w.op)
        assert g.bandwidth == pytest.approx(w.bandwidth, rel=1e-6) and g.latency == pytest.approx(w.latency, rel=1e-6)
    for w, g in zip(want.layers, got.layers, strict=True):
        assert (g.tp, g.sp) == (w.tp, w.sp)
        for f in ("layer_s", "layer_per_seq_s", "ends_s", "ends_per_seq_s"):
            assert getattr(g, f) == pytest.approx(getattr(w, f), abs=1e-9), f
    assert got.step_s == pytest.approx(want.step_s) and got.step_layer_s == pytest.approx(want.step_layer_s)
    assert [ac for ac, _ in got.recompute] == ["full"] and got.recompute[0][1] == pytest.approx(1.8)
    assert got.dp_overlap == pytest.approx(want.dp_overlap) and got.fsdp_unit_s == pytest.approx(want.fsdp_unit_s)
    assert got.grad_sync_unit_s == 0.0
    assert got.memory_overhead_bytes == want.memory_overhead_bytes
    assert got.allocator_overhead == pytest.approx(want.allocator_overhead, rel=1e-3)


def test_the_datasheet_s_own_figures_as_probed_predict_what_the_datasheet_does():
    """Every term alike, but one: a probed cluster pays the data-parallel latency once per FSDP unit
    (as the workers issue it), the datasheet once per collective. Without latency the two predict
    the same step; with it, every part of the step but the exposed data-parallel time."""
    f = CalibrationFactors()
    for latency in (0.0, CLUSTER.intra_node_latency):
        cluster = dataclasses.replace(CLUSTER, intra_node_latency=latency)
        sheet = ProbedFigures(matmul_flops=CLUSTER.peak_flops * f.compute_efficiency,
                              attention_flops=CLUSTER.peak_flops * min(f.attention_efficiency, f.compute_efficiency),
                              links=tuple(tuner.LinkFigure("intra", op, CLUSTER.intra_node_bandwidth
                                                           * f.intra_bw_efficiency, latency, 4) for op in OPS))
        for layout in (Layout(dp=4), Layout(tp=2, dp=2, sp=True), Layout(pp=2, dp=2, mbs=2), Layout(tp=4, ac="full")):
            a = estimate_time(layout, model=MODEL, cluster=cluster, training=TRAINING)
            b = estimate_time(layout, model=MODEL, cluster=with_probe(cluster, sheet), training=TRAINING)
            if latency == 0.0:
                assert b.step_time_s == pytest.approx(a.step_time_s, rel=1e-12), layout
            for part, value in a.breakdown.items():
                if latency == 0.0 or part != "dp_comm_exposed":
                    assert b.breakdown[part] == pytest.approx(value, rel=1e-12, abs=1e-18), (layout, part)


def _probed(**changes) -> tuner.ClusterSpec:
    none = ProbedFigures(matmul_flops=1e11, attention_flops=1e10)
    return with_probe(CLUSTER, dataclasses.replace(none, **changes))


def test_layer_overheads_count_per_micro_batch_and_layer_and_recompute_repeats_the_forward_s_share():
    layout = Layout(dp=4, mbs=1)  # 4 sequences per rank: 4 micro-batches of 4 layers
    def busy(cluster: tuner.ClusterSpec) -> float:  # a longer micro-batch also hides more of the all-reduce
        t = estimate_time(layout, model=MODEL, cluster=cluster, training=TRAINING)
        return t.step_time_s - t.breakdown["dp_comm_exposed"]

    layer = LayerFigure(1, False, layer_s=0.01, layer_per_seq_s=0.002, ends_s=0.003, ends_per_seq_s=0.001)
    assert busy(_probed(layers=(layer,))) - busy(_probed()) == pytest.approx(4 * (4 * (0.01 + 0.002) + 0.003 + 0.001))
    full = estimate_time(Layout(dp=4, ac="full"), model=MODEL, cluster=_probed(layers=(layer,)), training=TRAINING)
    base_full = estimate_time(Layout(dp=4, ac="full"), model=MODEL, cluster=_probed(), training=TRAINING)
    assert full.step_time_s - base_full.step_time_s == pytest.approx(4 * (4 * 0.012 * (1 + 1 / 3) + 0.004), rel=1e-6)
    probed = estimate_time(Layout(dp=4, ac="full"), model=MODEL, training=TRAINING,
                           cluster=_probed(layers=(layer,), recompute=(("full", 2.0),)))
    assert probed.step_time_s - base_full.step_time_s == pytest.approx(4 * (4 * 0.012 * 2.0 + 0.004), rel=1e-6)


def test_a_pipeline_splits_the_ends_overhead_by_their_flops_and_the_optimiser_by_the_stage_s_layers():
    layer = LayerFigure(1, False, layer_s=0.0, layer_per_seq_s=0.0, ends_s=0.01, ends_per_seq_s=0.0)
    layout = Layout(pp=2, dp=2, schedule="gpipe")
    base = estimate_time(layout, model=MODEL, cluster=_probed(), training=TRAINING)
    est = estimate_time(layout, model=MODEL, cluster=_probed(layers=(layer,), step_s=0.002, step_layer_s=0.001),
                        training=TRAINING)
    last = 0.01 / (1 + tuner.EMBEDDING_COST)  # the head and loss's share: the slowest stage
    m = tuner.microbatches(layout, TRAINING)
    assert est.step_time_s - base.step_time_s == pytest.approx((m + 1) * last + 0.002 + 2 * 0.001, rel=1e-6)


def test_stages_idle_in_the_bubble_lend_their_share_of_shared_cores_but_the_work_still_takes_its_time():
    layer = LayerFigure(1, False, layer_s=0.02, layer_per_seq_s=0.0, ends_s=0.0, ends_per_seq_s=0.0)
    for pp, m_bs in ((4, 4), (2, 1)):
        layout = Layout(pp=pp, dp=4 // pp, mbs=m_bs, schedule="1f1b")
        own = estimate_time(layout, model=MODEL, cluster=_probed(layers=(layer,)), training=TRAINING).breakdown
        shared = estimate_time(layout, model=MODEL, cluster=_probed(layers=(layer,), compute_sharing=2.0),
                               training=TRAINING).breakdown
        m = tuner.microbatches(layout, TRAINING)
        busy = own["compute"]
        assert own["pp_bubble"] == pytest.approx(busy * (pp - 1) / m)  # idle stages: the bubble as it is
        assert shared["pp_bubble"] == pytest.approx(max(0.0, (busy + own["pp_bubble"]) / 2 - busy))
    assert estimate_time(Layout(dp=4), model=MODEL, cluster=_probed(compute_sharing=2.0), training=TRAINING
                         ).step_time_s == estimate_time(Layout(dp=4), model=MODEL, cluster=_probed(),
                                                        training=TRAINING).step_time_s  # nobody idles


def test_sequence_parallelism_is_costed_on_the_probed_all_gather_and_reduce_scatter():
    slow_rs = (tuner.LinkFigure("intra", "all_reduce", 1e9, 1e-4, 4), tuner.LinkFigure("intra", "all_gather", 1e9, 1e-4, 4),
               tuner.LinkFigure("intra", "reduce_scatter", 1e9, 1e-3, 4))
    cl = _probed(links=slow_rs)
    plain = estimate_time(Layout(tp=2, dp=2), model=MODEL, cluster=cl, training=TRAINING).breakdown["tp_comm"]
    sp = estimate_time(Layout(tp=2, dp=2, sp=True), model=MODEL, cluster=cl, training=TRAINING).breakdown["tp_comm"]
    m = tuner.microbatches(Layout(tp=2, dp=2), TRAINING)
    per = 4 * MODEL.layers + 2  # 4 per layer, the embedding's and the head's
    assert sp - plain == pytest.approx(m * per * (allgather_time(0, 2, 1e9, 1e-3) - allgather_time(0, 2, 1e9, 1e-4)),
                                       rel=1e-6)


def test_gradient_sync_pays_the_probed_latency_once_per_fsdp_unit_and_the_probed_overlap():
    link = (tuner.LinkFigure("intra", "all_reduce", 1e20, 1e-3, 4),)  # latency only
    est = estimate_time(Layout(dp=4, mbs=4), model=MODEL, cluster=_probed(links=link, dp_overlap=0.0),
                        training=TRAINING)
    assert est.breakdown["dp_comm_exposed"] == pytest.approx((MODEL.layers + 1) * allreduce_time(0, 4, 1e20, 1e-3))


def test_a_sync_slower_than_its_links_is_a_cost_per_unit_of_every_layout_s_program():
    """A real step's gradient sync beyond the modelled all-reduce (nothing hidden) is paid once per
    FSDP unit, as ZeRO-3's is per unit gather and reduce-scatter, on any data-parallel degree."""
    want = dataclasses.replace(truth(), dp_overlap=0.0, grad_sync_unit_s=0.003)
    got = derive(raw_of(want, model=MODEL, cluster=CLUSTER, training=TRAINING), model=MODEL, cluster=CLUSTER,
                 training=TRAINING)
    assert got.dp_overlap == 0.0 and got.grad_sync_unit_s == pytest.approx(0.003)
    assert got.fsdp_unit_s == pytest.approx(want.fsdp_unit_s)
    none = dataclasses.replace(got, grad_sync_unit_s=0.0, fsdp_unit_s=0.0)
    for layout, per_unit in ((Layout(pp=2, dp=2, mbs=4), 0.003), (Layout(dp=4, zero=3, mbs=4), 3 * 0.002)):
        a = estimate_time(layout, model=MODEL, cluster=with_probe(CLUSTER, got), training=TRAINING)
        b = estimate_time(layout, model=MODEL, cluster=with_probe(CLUSTER, none), training=TRAINING)
        units = MODEL.layers // layout.pp + 1
        m = tuner.microbatches(layout, TRAINING)
        times = m if layout.zero == 3 else 1
        assert a.breakdown["dp_comm_exposed"] - b.breakdown["dp_comm_exposed"] == pytest.approx(times * units * per_unit)


def test_probed_memory_overhead_and_allocator_share_enter_the_memory_model():
    layout = Layout(dp=4)
    sheet = estimate_memory(layout, model=MODEL, cluster=CLUSTER, training=TRAINING)
    mem = estimate_memory(layout, model=MODEL, cluster=_probed(memory_overhead_bytes=100 * 2**20,
                                                              allocator_overhead=0.5), training=TRAINING)
    tensors = mem.params + mem.grads + mem.optimizer + mem.activations + mem.buffers
    assert tensors == sheet.total - sheet.overhead
    assert mem.overhead == 100 * 2**20 + int(0.5 * tensors) and mem.total == tensors + mem.overhead


def test_figure_rows_show_datasheet_beside_probed_with_their_ratio():
    rows = {r.name: r for r in figure_rows(CLUSTER, truth())}
    mm = rows["matmul FLOP/s per device"]
    assert mm.source == "probed" and mm.ratio == pytest.approx(1.2e11 / (CLUSTER.peak_flops * 0.6))
    assert rows["all_reduce latency (within a node)"].ratio == pytest.approx(3e-4 / CLUSTER.intra_node_latency)
    assert rows["optimiser step, fixed per step"].ratio is None  # nothing on the datasheet to compare with
    sheet = figure_rows(CLUSTER)
    assert all(r.source == "datasheet" and r.probed is None for r in sheet)
    assert "fast domain and network: none on this cluster" in summary(CLUSTER, truth())


def test_on_several_nodes_an_unprobed_tier_stays_the_datasheet_s_and_says_so():
    two = dataclasses.replace(CLUSTER, nodes=2)
    rows = [r for r in figure_rows(two, truth()) if "(network)" in r.name]
    assert rows and all(r.source == "datasheet" and "not probed" in r.note for r in rows)
    assert "datasheet for network" in summary(two, truth())
    est = estimate_time(Layout(dp=8), model=MODEL, cluster=with_probe(two, truth()), training=TRAINING)
    assert est.breakdown["dp_comm_exposed"] > 0  # over the network: the datasheet's link
    assert probe_targets(two, [(2, True)]).tiers == {"intra": [0, 1, 2, 3], "inter": [0, 4]}
    assert tuner.unprobed_tiers(two, truth()) == ["inter"] and tuner.unprobed_tiers(CLUSTER, truth()) == []
    # A probe of one NVL72 tray (its node) reaches neither the fast domain of 18 trays nor the network past it.
    nvl = tuner.cluster_spec("gb200-nvl72")
    tray = tuner.ProbedFigures(links=(tuner.LinkFigure("intra", "all_reduce", 7e11, 5e-6, 4),))
    assert tuner.unprobed_tiers(dataclasses.replace(nvl, nodes=1), tray) == []
    assert tuner.unprobed_tiers(nvl, tray) == ["domain"]
    assert tuner.unprobed_tiers(dataclasses.replace(nvl, nodes=36), tray) == ["domain", "inter"]
    assert tuner.unprobed_tiers(nvl) == ["intra", "domain"]  # no probe at all: every tier it has


def test_a_cluster_spec_takes_probed_figures_as_a_mapping_and_refuses_bad_ones():
    cl = tuner.cluster_spec({"preset": "cpu-local", "probed": truth().to_dict()})
    assert cl.probed == truth() and hash(cl)  # hashable: the time model caches per cluster
    with pytest.raises(SpecError, match="probed.links.bandwidth must be a positive number"):
        tuner.cluster_spec({"preset": "cpu-local", "probed": {"links": [
            {"tier": "intra", "op": "all_reduce", "bandwidth": 0, "latency": 1e-4, "group": 4}]}})
    with pytest.raises(SpecError, match="probed.speed is not a known field"):
        tuner.cluster_spec({"preset": "cpu-local", "probed": {"speed": 1}})
    with pytest.raises(SpecError, match=r"probed.dp_overlap must be within \[0, 1\]"):
        ProbedFigures(dp_overlap=2.0)


@pytest.mark.parametrize("name", ["tiny-moe-cpu-fp32", "dense-shapes-mi300x"])
def test_a_probed_plan_costs_every_layout_as_the_per_layout_estimators_do(name):
    """The plan's array path reads every probed term as the single-layout path does: per-op links (sp
    apart from no sp), layer and ends overheads, recompute, compute sharing in the bubble, the
    optimiser's constant, per-unit sync, the baseline and the allocator's share. The same numbers."""
    from tests.helpers import plan_golden as golden

    problem, opts = golden.problem(name)
    model, sheet, training = problem.model, problem.cluster, problem.training
    layers = tuple(tuner.LayerFigure(tp, sp, 0.002 * tp, 0.0004 * tp, 0.001, 0.0002 * (1 + sp))
                   for tp in (1, 2, 4, 8) for sp in ((False, True) if tp > 1 else (False,)))
    cluster = with_probe(sheet, truth(layers=layers))
    p = tuner.plan(problem=dataclasses.replace(problem, cluster=cluster), **opts)
    entries = list(p.entries) + list(p.infeasible)
    kw = {"model": model, "cluster": cluster, "training": training}
    for i, e in enumerate(entries):
        memory = estimate_memory(e.layout, **kw)
        assert e.memory == memory and memory.fits == (i < len(p.entries)), e.layout  # judged on the same total
        assert e.time == estimate_time(e.layout, placement=e.placement, **kw), e.layout
    # the probed terms are there to read: SP under TP, a pipeline bubble, the measured constants
    assert any(e.layout.sp and e.layout.tp > 1 for e in entries) and any(e.layout.pp > 1 for e in entries)
    first = entries[0].layout
    assert entries[0].time != estimate_time(first, placement=entries[0].placement, **{**kw, "cluster": sheet})
    assert entries[0].memory != estimate_memory(first, **{**kw, "cluster": sheet})
