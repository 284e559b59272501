"""Device presets (each validates and cites its datasheet) and the three-tier topology (node, fast
domain, network): placement and the time model's link choice, on GB200 NVL72's 72-GPU NVLink domain
over trays of 4. Pure tuner, no Ray."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest

import tuner._presets as presets
from tuner import (
    Layout,
    LayoutError,
    Problem,
    SpecError,
    cluster_spec,
    estimate_time,
    model_spec,
    place,
    plan,
    training_spec,
)
from tuner._placement import _place
from tuner._timing import CalibrationFactors, _link

REQUIRED = ("a100-40g", "a100-80g", "h100-sxm", "h100-pcie", "h200", "b200", "gb200-nvl72", "mi300x", "l40s",
            "cpu-local")


@pytest.mark.parametrize("name", REQUIRED)
def test_preset_validates_and_cites_its_datasheet(name):
    c = presets.CLUSTER_PRESETS[name]
    assert c.name == name
    assert presets.ClusterSpec(**dataclasses.asdict(c)) == c  # every field passes __post_init__ again
    assert c.domain_devices % c.devices_per_node == 0
    if name == "cpu-local":
        return
    # The comment right above the preset names its source and the figures it took from it.
    source = inspect.getsource(presets)
    at = source.index(f'ClusterSpec("{name}"')
    comment = " ".join(line.strip().lstrip("#") for line in source[:at].splitlines()[-4:] if line.strip().startswith("#"))
    assert re.search(r"\d[\d.,]* [TP]FLOP/s bf16 dense", comment), comment
    assert re.search(r"\d+ ?GB", comment) and ("Gb/s" in comment), comment
    flops = float(re.search(r"(\d[\d.,]*) ([TP])FLOP/s bf16 dense", comment)[1].replace(",", ""))
    unit = 1e12 if re.search(r"\d[\d.,]* ([TP])FLOP/s bf16 dense", comment)[1] == "T" else 1e15
    assert c.peak_flops == pytest.approx(flops * unit, rel=0.01), (name, c.peak_flops, flops)


def test_datasheet_figures_of_a_few_presets():
    p = presets.CLUSTER_PRESETS
    assert p["h100-sxm"].peak_flops == 989e12 and p["h100-sxm"].intra_node_bandwidth == 450e9
    assert p["a100-40g"].device_memory == 40 * 2**30 and p["a100-80g"].device_memory == 80 * 2**30
    assert p["mi300x"].device_memory == 192 * 2**30 and p["l40s"].device_memory == 48 * 2**30
    nvl = p["gb200-nvl72"]
    assert (nvl.nodes, nvl.devices_per_node, nvl.domain_devices, nvl.devices) == (18, 4, 72, 72)
    assert nvl.domain_bandwidth == 900e9 > nvl.inter_node_bandwidth
    # Presets without a fast domain keep two tiers: the domain is the node.
    h = p["h100-sxm"]
    assert (h.domain_devices, h.domain_bandwidth, h.domain_latency) == (8, h.intra_node_bandwidth, h.intra_node_latency)


@pytest.mark.parametrize(("override", "field"), [
    ({"fast_domain_devices": 70}, "cluster.fast_domain_devices=70"),  # not whole trays of 4
    ({"fast_domain_devices": 0}, "cluster.fast_domain_devices"),
    ({"fast_domain_bandwidth": 1e9}, "cluster.fast_domain_bandwidth=1e+09"),  # slower than the network
    ({"fast_domain_latency": -1.0}, "cluster.fast_domain_latency"),
    ({"price_per_device_hour": -2.5}, "cluster.price_per_device_hour"),
    ({"price_per_device_hour": "cheap"}, "cluster.price_per_device_hour"),
])
def test_bad_cluster_values_name_field_and_value(override, field):
    with pytest.raises(SpecError, match=re.escape(field)):
        cluster_spec({"preset": "gb200-nvl72", **override})


def test_bad_train_tokens_names_field():
    with pytest.raises(SpecError, match="training.train_tokens"):
        training_spec({"global_batch": 8, "train_tokens": 0})
    assert training_spec({"global_batch": 8, "train_tokens": 1.5e13}).train_tokens == 1.5e13


def test_nvl72_tp8_crosses_trays_on_nvlink_and_the_network_only_between_racks():
    c = cluster_spec({"preset": "gb200-nvl72", "nodes": 36})  # two racks, 144 GPUs
    f = CalibrationFactors()
    p = place(Layout(tp=8, dp=18), c)  # tp groups span 2 trays of 4 inside one rack
    tp, dp = p.axes["tp"], p.axes["dp"]
    assert (tp.intra_node, tp.in_domain, tp.nodes, tp.link) == (False, True, 2, "domain")
    assert (dp.in_domain, dp.domains, dp.link) == (False, 2, "inter")
    assert _link(p, ("tp",), c, f) == (900e9 * f.intra_bw_efficiency, 7e-6)  # NVLink, across trays
    assert _link(p, ("dp",), c, f) == (50e9 * f.inter_bw_efficiency, 2e-5)  # leaves the rack: network
    assert p.summary == "tp:domain dp:inter"

    # The same hardware seen as plain 4-GPU nodes puts tp=8 on the network: slower TP.
    flat = dataclasses.replace(c, fast_domain_devices=None, fast_domain_bandwidth=None, fast_domain_latency=None)
    with pytest.raises(LayoutError, match="cross nodes"):
        place(Layout(tp=8, dp=18), flat)
    m, t = model_spec("llama3-70b"), training_spec({"global_batch": 144})
    fast = estimate_time(Layout(tp=8, dp=18), model=m, cluster=c, training=t)
    slow = estimate_time(Layout(tp=8, dp=18), model=m, cluster=flat, training=t)
    # 18x the bandwidth (720 vs 40 GB/s achieved); latencies 7 vs 20 us.
    assert 10 * fast.breakdown["tp_comm"] < slow.breakdown["tp_comm"] < 18 * fast.breakdown["tp_comm"]
    assert fast.tokens_per_s > slow.tokens_per_s


def test_chattiest_axis_on_the_fastest_link_at_every_tier():
    c = cluster_spec({"preset": "gb200-nvl72", "nodes": 36})
    p = place(Layout(tp=4, dp=18, pp=2), c)
    assert [p.axes[a].link for a in ("tp", "dp", "pp")] == ["intra", "domain", "inter"]
    f = CalibrationFactors()
    bws = [_link(p, (a,), c, f)[0] for a in ("tp", "dp", "pp")]
    assert bws == sorted(bws, reverse=True) and bws[1] == 900e9 * f.intra_bw_efficiency
    # A group over several axes takes the slowest tier any of them reaches.
    assert _link(p, ("tp", "dp"), c, f)[0] == bws[1] and _link(p, ("dp", "pp"), c, f)[0] == bws[2]


def test_tp_may_leave_a_tray_but_never_the_domain():
    c = cluster_spec({"preset": "gb200-nvl72", "nodes": 36})
    assert _place((16, 1, 1, 9, 1), ("tp", "cp", "ep", "dp", "pp"), 4, 72).axes["tp"].in_domain is False  # 72 % 16
    with pytest.raises(LayoutError, match="fast_domain_devices=72"):
        place(Layout(tp=16, dp=9), c)
    result = plan(problem=Problem(model=model_spec("llama3-8b"), cluster=c,
                                  training=training_spec({"global_batch": 144})))
    tps = {e.layout.tp for e in result.entries}
    assert 8 in tps and 16 not in tps
    assert result.rejected.get("tp crosses nodes", 0) > 0  # tp=16 (and others) leave the domain


def test_default_domain_is_the_node_everywhere():
    c = cluster_spec({"preset": "h100-sxm", "nodes": 4})
    p = place(Layout(tp=8, dp=4), c)
    assert (p.axes["dp"].in_domain, p.axes["dp"].link, p.devices_per_domain) == (False, "inter", 0)
    assert p.summary == "tp:intra dp:inter"


def test_a_cluster_smaller_than_its_domain_is_one_domain_and_a_partial_rack_is_its_own():
    small = cluster_spec({"preset": "gb200-nvl72", "nodes": 4})  # 16 GPUs of one rack
    p = place(Layout(tp=8, dp=2), small)
    assert [p.axes[a].link for a in ("tp", "dp")] == ["domain", "domain"]
    partial = cluster_spec({"preset": "gb200-nvl72", "nodes": 32})  # a full rack (72) and 56 GPUs of another
    p = place(Layout(tp=8, dp=16), partial)
    assert p.axes["tp"].in_domain and p.axes["dp"].link == "inter"
    assert {r // 72 for r in p.group("tp", 72)} == {1}  # the first group of the second rack stays in it
