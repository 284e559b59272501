"""Device types side by side (tuner/_devices.py, ``meshtune plan --cluster a,b``): parsing the types
and their prices, the fastest and the cheapest, the figure, and the one-line refusals."""

from __future__ import annotations

import json

import pytest

from api.cli import main
from tuner import SpecError, model_spec, training_spec
from tuner._devices import cluster_types, compare_devices, device_prices, devices_figure

MODEL = model_spec("llama3-8b")
TRAINING = training_spec({"global_batch_tokens": 2**20, "train_tokens": 1e12, "stack": "megatron"}, seq_len=8192)


def test_a_cluster_section_names_one_or_several_device_types():
    one = cluster_types({"preset": "h100-sxm", "nodes": 4})
    assert [(c.name, c.nodes) for c in one] == [("h100-sxm", 4)]
    several = cluster_types({"preset": ["h100-sxm", "b200"], "nodes": 2, "price_per_device_hour": {"b200": 5.0}})
    assert [(c.name, c.nodes, c.price_per_device_hour) for c in several] == [("h100-sxm", 2, None), ("b200", 2, 5.0)]
    assert [c.name for c in cluster_types("h100-sxm,mi300x")] == ["h100-sxm", "mi300x"]
    assert [c.price_per_device_hour for c in cluster_types({"preset": "h100-sxm,b200", "price_per_device_hour": 2.0})
            ] == [2.0, 2.0]
    assert cluster_types({"preset": "h100-sxm", "price_per_device_hour": "h100-sxm=2.5"})[0].price_per_device_hour == 2.5
    assert device_prices("h100-sxm=2.5, b200=5", ["h100-sxm", "b200"]) == {"h100-sxm": 2.5, "b200": 5.0}


@pytest.mark.parametrize(("value", "message"), [
    (["h100-sxm", {"preset": "b200"}], r"^cluster\[1\]=\{'preset': 'b200'\}: a list of device types names cluster "
                                       r"presets only"),
    ({"preset": ["h100-sxm", "b200"], "price_per_device_hour": {"b300": 5.0}},
     r"^cluster.price_per_device_hour: b300=5.0 names a device type that is not compared \(compared: h100-sxm, b200\)$"),
    ({"preset": "h100-sxm,b200", "price_per_device_hour": "h100-sxm=2.5,mi300x=3"},
     r"^cluster.price_per_device_hour: mi300x=3.0 names a device type that is not compared"),
    ({"preset": ["h100-sxm", "h100-sxm"]}, r"^cluster.preset=h100-sxm,h100-sxm: h100-sxm is given twice$"),
    ({"preset": ["h100-sxm", "tpu-v5"]}, r"^cluster.preset\[1\]='tpu-v5' is not a known preset"),
    ({"preset": ["h100-sxm", "b200"], "name": "mine"}, r"^cluster.name='mine' cannot name a list of device types"),
    ({"preset": ["h100-sxm", "b200"], "price_per_device_hour": "b200=cheap"}, r"'cheap' is not a price$"),
    ({"preset": ["h100-sxm", "b200"], "price_per_device_hour": {"b200": -1}}, r"b200=-1 is not a non-negative price$"),
])
def test_bad_device_types_are_one_line_naming_the_field(value, message):
    with pytest.raises(SpecError, match=message):
        cluster_types(value)


def test_the_fastest_and_the_cheapest_are_marked():
    clusters = cluster_types({"preset": ["h100-sxm", "b200", "mi300x"],
                              "price_per_device_hour": {"h100-sxm": 2.5, "b200": 5.0, "mi300x": 1.0}})
    points = compare_devices(model=MODEL, clusters=clusters, training=TRAINING, nodes=[1, 2])
    assert [(p.device, p.size.nodes) for p in points] == [(d, n) for d in ("h100-sxm", "b200", "mi300x") for n in (1, 2)]
    fastest = [p for p in points if p.fastest]
    cheapest = [p for p in points if p.cheapest]
    assert len(fastest) == len(cheapest) == 1
    assert fastest[0].size.tokens_per_s == max(p.size.tokens_per_s for p in points)
    assert cheapest[0].size.budget.cost == min(p.size.budget.cost for p in points)
    assert fastest[0].device == "b200" and cheapest[0].device == "mi300x"  # 2.25 PFLOP/s; the lowest price
    fig = devices_figure(points, title="t")
    assert [t["name"] for t in fig["data"][:3]] == ["h100-sxm", "b200", "mi300x"]
    assert fig["data"][0]["x"] == [8, 16] and "xaxis2" in fig["layout"]  # priced: cost against days beside it
    assert fig["data"][-1]["text"] == ["fastest: b200", "cheapest: mi300x"]
    # Unpriced: nothing is the cheapest, and the figure has no cost panel.
    bare = compare_devices(model=MODEL, clusters=cluster_types("h100-sxm,b200"), training=TRAINING, nodes=[1])
    assert not any(p.cheapest for p in bare) and sum(p.fastest for p in bare) == 1
    assert "xaxis2" not in devices_figure(bare, title="t")["layout"]


def test_cli_compares_device_types_as_json_and_plot(tmp_path, capsys):
    out_html = tmp_path / "devices.html"
    argv = ["plan", "--model", "llama3-8b", "--cluster", "h100-sxm,h200,b200,mi300x", "--nodes", "1,2",
            "--global-batch-tokens", str(2**20), "--train-tokens", "1T", "--stack", "megatron",
            "--price-per-device-hour", "h100-sxm=2.5,b200=5.0", "--plot", str(out_html), "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["stack"]["name"] == "megatron" and data["training"]["stack"] == "megatron"
    assert [(d["device"], d["nodes"]) for d in data["devices"]] == [
        (t, n) for t in ("h100-sxm", "h200", "b200", "mi300x") for n in (1, 2)]
    priced = {d["device"] for d in data["devices"] if d["budget"]["cost"] is not None}
    assert priced == {"h100-sxm", "b200"} and sum(d["cheapest"] for d in data["devices"]) == 1
    assert "plotly" in out_html.read_text()[:200_000].lower()
    assert main(argv[:-3]) == 0  # the table
    table = capsys.readouterr().out
    assert "fastest" in table and "cheapest" in table and "predicted for stack megatron" in table


@pytest.mark.parametrize(("argv", "message"), [
    (["--stack", "jax"], "--stack='jax' is not a known stack (known: megatron, meshtune, torchtitan)"),
    (["--cluster", "h100-sxm,b200", "--price-per-device-hour", "b300=5"],
     "cluster.price_per_device_hour: b300=5.0 names a device type that is not compared (compared: h100-sxm, b200)"),
    (["--cluster", "h100-sxm,nope"], "cluster.preset[1]='nope' is not a known preset"),
])
def test_cli_refusals_are_one_line_exit_2(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_a_spec_file_mixing_a_preset_with_a_cluster_mapping_is_refused(tmp_path, capsys):
    spec = tmp_path / "p.yaml"
    spec.write_text("model: tiny\ncluster: [cpu-local, {preset: h100-sxm, nodes: 2}]\ntraining: {global_batch: 16}\n")
    assert main(["plan", str(spec)]) == 2
    err = capsys.readouterr().err.strip()
    assert "cluster.preset[1]={'preset': 'h100-sxm', 'nodes': 2}: a list of device types names cluster presets " \
           "only" in err and len(err.splitlines()) == 1
