"""Search space and enumeration: counts by hand and against check_layout on every combination."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from tuner import (
    Layout,
    LayoutError,
    Problem,
    SearchSpace,
    SpecError,
    canonical_layout,
    check_layout,
    cluster_spec,
    divisors,
    enumerate_layouts,
    layout_violation,
    model_spec,
    training_spec,
)


def cpu(devices: int, per_node: int | None = None):
    per_node = per_node or devices
    return cluster_spec({"preset": "cpu-local", "nodes": devices // per_node, "devices_per_node": per_node})


ONE_KNOB = SearchSpace(zero=(0,), mbs=(1,), ac=("none",), sp=(False,), schedules=("1f1b",))


def test_hand_counted_six_devices() -> None:
    """small (8 layers, 8 heads, seq 256) on 6 devices, batch 12, one value per knob:
    tp=1: cp=1 x pp in {1,2,3,6} and cp=2 x pp in {1,3} are valid, cp=3 (pp 1,2) and cp=6 are not;
    tp=2: cp=1 x pp in {1,3} valid, cp=3 not; tp=3 (3 meshes) and tp=6 (1) do not divide 8 heads."""
    enum = enumerate_layouts(problem=Problem(model=model_spec("small"), cluster=cpu(6),
                                             training=training_spec({"global_batch": 12}), space=ONE_KNOB))
    got = sorted((x.tp, x.cp, x.dp, x.pp) for x in enum.valid)
    assert got == [(1, 1, 1, 6), (1, 1, 2, 3), (1, 1, 3, 2), (1, 1, 6, 1), (1, 2, 1, 3), (1, 2, 3, 1),
                   (2, 1, 1, 3), (2, 1, 3, 1)]
    assert enum.rejected == {"2*cp does not divide seq_len": 4, "tp does not divide heads": 4}
    assert enum.microbatches == [12 // x.dp for x in enum.valid]


def brute_force(model, cluster, training, space: SearchSpace) -> tuple[set[Layout], Counter, int]:
    """Every combination of the space built as a Layout, put in canonical form and judged by
    check_layout's rules: (valid canonical layouts, distinct canonical layouts rejected per reason,
    combinations that are a twin of another one). Twins share their verdict: same program."""
    world = cluster.devices
    space = space.for_stack(training)  # an unset vpp: the stack's interleavings, as enumeration reads it
    valid, rejected, raw = set(), {}, 0
    for tp in space.tp or divisors(world):
        for cp in space.cp or divisors(world // tp):
            rest = world // (tp * cp)
            for ep in space.ep or (divisors(rest) if model.is_moe else (1,)):
                for pp in space.pp or divisors(rest // ep):
                    dp = rest // (ep * pp)
                    scheds = [("1f1b", 1)] if pp == 1 else (
                        [(s, 1) for s in space.schedules if s != "interleaved"]
                        + ([("interleaved", v) for v in space.vpp] if "interleaved" in space.schedules else []))
                    for (sched, vpp), zero, mbs, ac, sp in itertools.product(
                        scheds, space.zero, space.mbs, space.ac, space.sp
                    ):
                        if sp and tp == 1:
                            continue
                        raw += 1
                        layout = Layout(tp=tp, cp=cp, ep=ep, dp=dp, pp=pp, zero=zero, mbs=mbs, ac=ac, sp=sp,
                                        schedule=sched, vpp=vpp)
                        canon = canonical_layout(layout, training=training)
                        assert canonical_layout(canon, training=training) == canon
                        bad = layout_violation(canon, model=model, cluster=cluster, training=training)
                        assert bad == layout_violation(layout, model=model, cluster=cluster, training=training)
                        if bad:
                            rejected.setdefault(bad[0], set()).add(canon)
                            with pytest.raises(LayoutError):
                                check_layout(layout, model=model, cluster=cluster, training=training)
                        else:
                            valid.add(canon)
    reasons = Counter({r: len(v) for r, v in rejected.items()})
    return valid, reasons, raw - len(valid) - sum(reasons.values())


@pytest.mark.parametrize(
    ("preset", "devices", "batch", "space", "stack"),
    [
        ("small", 12, 24, SearchSpace(zero=(0, 3), mbs=(1, 2, 4), ac=("none", "full")), "meshtune"),  # not 2^k
        ("tiny", 8, 16, SearchSpace(zero=(1,), mbs=(1, 2), ac=("selective",), vpp=(2, 3)), "meshtune"),
        ("tiny-moe", 8, 32, SearchSpace(zero=(0,), mbs=(1, 4), ac=("none",)), "meshtune"),
        # the ends as stages of their own: up to 4 + 2 stages of tiny's 4 layers; the stack's vpp 2, 4, 8
        ("tiny", 8, 32, SearchSpace(zero=(0,), mbs=(1,), ac=("none",), sp=(False,)), "megatron"),
    ],
)
def test_enumeration_agrees_with_check_layout(preset: str, devices: int, batch: int, space: SearchSpace,
                                              stack: str) -> None:
    model, cluster = model_spec(preset), cpu(devices)
    training = training_spec({"global_batch": batch, "stack": stack})
    enum = enumerate_layouts(problem=Problem(model=model, cluster=cluster, training=training, space=space))
    valid, reasons, twins = brute_force(model, cluster, training, space)
    assert len(enum.valid) == len(set(enum.valid)) == len(valid) > 0
    assert set(enum.valid) == valid
    assert Counter(enum.rejected) == reasons
    assert enum.twins == twins
    for layout, m in zip(enum.valid, enum.microbatches, strict=True):
        assert m == check_layout(layout, model=model, cluster=cluster, training=training)
        assert Layout(**layout.__dict__) == layout  # the fast-built Layout passes its own validation
    assert enum.considered == len(valid) + sum(reasons.values())


def test_explicit_degrees_count_world_mismatch_and_ep_on_dense() -> None:
    space = SearchSpace(tp=(3, 2), pp=(1,), ep=(1, 2), zero=(0,), mbs=(1,), ac=("none",), sp=(False,))
    enum = enumerate_layouts(problem=Problem(model=model_spec("tiny"), cluster=cpu(4),
                                             training=training_spec({"global_batch": 8}), space=space))
    # tp=3 does not divide 4 (counted once per explicit ep value: 2); tp=2, cp=2 leaves one device,
    # which ep=2 does not divide (1); tp=2, cp=1, ep=2 fits the devices but the model is dense.
    assert enum.rejected == {"world size mismatch": 3, "ep needs a MoE model": 1}
    assert sorted((x.tp, x.cp, x.dp) for x in enum.valid) == [(2, 1, 2), (2, 2, 1)]


def test_schedule_reasons_and_max_layouts() -> None:
    model, cluster = model_spec("tiny"), cpu(4)
    space = SearchSpace(tp=(1,), cp=(1,), pp=(4,), zero=(0,), mbs=(1, 2), ac=("none",), sp=(False,), vpp=(2,))
    enum = enumerate_layouts(problem=Problem(model=model, cluster=cluster,
                                             training=training_spec({"global_batch": 6}), space=space))
    # pp=4, dp=1: m = 6 (mbs 1) or 3 (mbs 2). 1F1B needs m >= 4; interleaved also needs 4 | m and
    # pp*vpp = 8 > 4 layers; gpipe takes both.
    assert sorted((x.schedule, x.mbs) for x in enum.valid) == [("1f1b", 1), ("gpipe", 1), ("gpipe", 2)]
    assert enum.rejected == {"micro-batches fewer than pp": 1, "stages exceed layers": 2}
    capped = enumerate_layouts(problem=Problem(model=model, cluster=cluster,
                                               training=training_spec({"global_batch": 16}),
                                               space=SearchSpace(max_layouts=10)))
    full = enumerate_layouts(problem=Problem(model=model, cluster=cluster,
                                             training=training_spec({"global_batch": 16})))
    assert len(capped.valid) == 10 == len(capped.microbatches)
    assert capped.rejected["beyond space.max_layouts"] == len(full.valid) - 10


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"tp": [0]}, "space.tp values must be integers >= 1, got 0"),
        ({"tp": "8"}, "space.tp must be a list of integers, got '8'"),
        ({"pp": []}, "space.pp must not be empty"),
        ({"zero": [4]}, r"space.zero values must be among \(0, 1, 2, 3\), got 4"),
        ({"ac": ["some"]}, "space.ac values must be among .*got 'some'"),
        ({"sp": [1]}, r"space.sp values must be among \(False, True\), got 1"),
        ({"schedules": ["zb"]}, "space.schedules values must be among .*got 'zb'"),
        ({"max_layouts": 0}, "space.max_layouts must be a positive integer, got 0"),
        ({"tpp": [1]}, "space.tpp is not a known field"),
        ([1, 2], r"space must be a mapping, got \[1, 2\]"),
    ],
)
def test_space_errors_name_field_and_value(data, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        SearchSpace.from_mapping(data)


def test_space_accepts_scalars_and_lists() -> None:
    space = SearchSpace.from_mapping({"tp": 8, "mbs": [2, 1, 2], "ac": "full", "sp": True})
    assert (space.tp, space.mbs, space.ac, space.sp) == ((8,), (1, 2), ("full",), (True,))
    assert SearchSpace.from_mapping(None) == SearchSpace()
    assert SearchSpace.from_mapping(space.to_dict()) == space


def test_an_unset_vpp_is_the_stacks_and_the_ends_may_be_stages_of_their_own() -> None:
    # The workers (and torchtitan) interleave 2 or 4 virtual stages by default and give every stage a
    # layer; Megatron's recipes also 8, and its layout takes an embedding-only and a loss-only stage.
    space = SearchSpace()
    assert space.vpp is None and space.for_stack(None).vpp == (2, 4)
    assert [space.for_stack(training_spec({"global_batch": 8, "stack": s})).vpp
            for s in ("meshtune", "torchtitan", "megatron")] == [(2, 4), (2, 4), (2, 4, 8)]
    assert SearchSpace(vpp=(3,)).for_stack(training_spec({"global_batch": 8, "stack": "megatron"})).vpp == (3,)
    model, cluster = model_spec("tiny"), cpu(8)
    layout = Layout(pp=2, dp=4, schedule="interleaved", vpp=3)  # 6 stages of tiny's 4 layers
    megatron = training_spec({"global_batch": 32, "stack": "megatron"})
    assert check_layout(layout, model=model, cluster=cluster, training=megatron) == 8
    with pytest.raises(LayoutError, match=r"^pp\*vpp=6 stages exceed layers=4$"):
        check_layout(layout, model=model, cluster=cluster, training=training_spec({"global_batch": 32}))
    with pytest.raises(LayoutError, match=r"^pp\*vpp=8 stages exceed layers=4 \+ 2 \(the embedding and the loss "
                                          r"as stages of their own, stack megatron\)$"):
        check_layout(layout.with_(vpp=4), model=model, cluster=cluster, training=megatron)


def test_tp_across_nodes_is_rejected_per_mesh_unless_allowed() -> None:
    model, cluster, training = model_spec("tiny"), cpu(8, per_node=2), training_spec({"global_batch": 8})
    space = SearchSpace(tp=(4,), cp=(1,), pp=(1,), zero=(0, 1), mbs=(1,), ac=("none",), sp=(False, True))
    enum = enumerate_layouts(problem=Problem(model=model, cluster=cluster, training=training, space=space))
    assert enum.valid == [] and enum.rejected == {"tp crosses nodes": 4}  # 2 zero x 2 sp
    allowed = enumerate_layouts(problem=Problem(model=model, cluster=cluster, training=training,
                                                space=space), allow_tp_across_nodes=True)
    assert len(allowed.valid) == 4 and allowed.rejected == {}
    # The workers place their mesh the same way and refuse such a layout, so layout validation (a
    # run-trial or search.layouts entry) refuses it too, with the same reason, before any process.
    layout = Layout(tp=4, dp=2)
    assert layout_violation(layout, model=model, cluster=cluster, training=training)[0] == "tp crosses nodes"
    with pytest.raises(LayoutError, match=r"tp=4 groups would cross nodes \(devices_per_node=2\)"):
        check_layout(layout, model=model, cluster=cluster, training=training)
    assert check_layout(layout, model=model, cluster=cluster, training=training, allow_tp_across_nodes=True) == 4
    # With dp innermost, tp=4 has stride 2 and still spans nodes; tp=2 with stride 4 would too.
    inner_dp = enumerate_layouts(problem=Problem(model=model, cluster=cluster, training=training,
                                                 space=SearchSpace(tp=(2,), cp=(1,), pp=(1,))),
                                 order=("dp", "tp", "cp", "ep", "pp"))
    assert inner_dp.valid == [] and inner_dp.rejected["tp crosses nodes"] > 0
