"""Budget and cluster size: the pure budget formulas, ``plan_sizes`` over node counts,
``meshtune plan --nodes 1,2,4`` (table, JSON, plotly HTML) and its one-line errors. Analytical only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from api import format as fmt
from api.cli import main
from tuner import (
    Problem,
    SearchSpace,
    SpecError,
    check_node_counts,
    cluster_spec,
    model_spec,
    plan_sizes,
    sizes_figure,
    training_budget,
    training_spec,
)
from tuner._formulas import (
    cost_per_token,
    device_hours,
    time_to_train_s,
    useful_fraction,
    useful_tokens_per_s,
)


def test_budget_formulas():
    assert time_to_train_s(1e12, 2e6) == 5e5
    assert device_hours(8, 7200) == 16
    assert cost_per_token(3.6, 10, 100.0) == pytest.approx(1e-4)
    b = training_budget(2e6, devices=8, train_tokens=1e12, price_per_device_hour=2.0)
    assert (b.time_to_train_s, b.device_hours, b.cost) == (5e5, 8 * 5e5 / 3600, 2.0 * 8 * 5e5 / 3600)
    assert b.cost_per_token == pytest.approx(b.cost / 1e12)
    nothing = training_budget(2e6, devices=8, train_tokens=None, price_per_device_hour=None)
    assert (nothing.time_to_train_s, nothing.cost, nothing.cost_per_token) == (None, None, None)
    free = training_budget(2e6, devices=8, train_tokens=1e12, price_per_device_hour=0.0)
    assert free.cost == 0.0


def test_useful_tokens_are_capped_by_the_critical_batch():
    # McCandlish et al. 2018 Eq. 2.11: E = E_min (1 + B / B_crit).
    assert useful_tokens_per_s(1000.0, 64, None) == 1000.0
    assert useful_tokens_per_s(1000.0, 64, 64) == 500.0
    # Far above B_crit a step of B sequences is worth ~B_crit: useful tokens per step level off.
    per_step = [useful_fraction(b, 64) * b for b in (64, 640, 6400, 64000)]
    assert per_step == sorted(per_step) and per_step[-1] < 64 and per_step[-1] > 0.99 * 64


@pytest.mark.parametrize(("value", "message"), [
    ("4,0", "nodes=4,0: 0 is not a positive integer"),
    ("4,x", "nodes=4,x: 'x' is not a positive integer"),
    ("4,8,4", "nodes=4,8,4: 4 is given twice"),
    ([4, 2.5], "nodes=4,2.5: 2.5 is not a positive integer"),
    ([4, True], "nodes=4,True: True is not a positive integer"),
    ([], "nodes must name at least one node count"),
])
def test_bad_node_counts_name_field_and_value(value, message):
    with pytest.raises(SpecError, match="^" + message.replace("(", r"\(")):
        check_node_counts(value)


def test_plan_sizes_fixed_and_scaled_batch():
    m, c = model_spec("tiny"), cluster_spec("cpu-local")
    t = training_spec({"global_batch": 16, "critical_batch": 16, "train_tokens": 1e9}, seq_len=m.seq_len)
    c = cluster_spec({"preset": "cpu-local", "price_per_device_hour": 0.5})
    fixed = plan_sizes(problem=Problem(model=m, cluster=c, training=t), nodes=[1, 2, 4])
    assert [p.devices for p in fixed] == [4, 8, 16] and {p.global_batch for p in fixed} == {16}
    for p in fixed:
        assert p.layout is not None and p.budget is not None and p.feasible > 0
        assert p.budget.time_to_train_s == pytest.approx(1e9 / p.tokens_per_s)
        assert p.budget.cost == pytest.approx(p.devices * p.budget.time_to_train_s / 3600 * 0.5)
        assert p.useful_tokens_per_s == pytest.approx(p.tokens_per_s / 2)  # B = B_crit
    scaled = plan_sizes(problem=Problem(model=m, cluster=c, training=t), nodes=[1, 2, 4], scale_batch=True)
    assert [p.global_batch for p in scaled] == [16, 32, 64]
    share = [p.useful_tokens_per_s / p.tokens_per_s for p in scaled]
    assert share == sorted(share, reverse=True) and share[-1] == pytest.approx(1 / 5)
    fig = sizes_figure(scaled, title="t")
    assert [d["name"] for d in fig["data"]] == ["tokens/s", "useful tokens/s (critical batch)", "MFU",
                                                "cost per 1M tokens"]
    assert fig["data"][0]["x"] == [4, 8, 16]


def test_a_size_where_nothing_fits_says_why():
    m = model_spec("tiny")
    t = training_spec({"global_batch": 2}, seq_len=m.seq_len)
    space = SearchSpace.from_mapping({"tp": [1], "cp": [1], "pp": [1]})  # dp only: 16 ranks, batch 2
    points = plan_sizes(problem=Problem(model=m, cluster=cluster_spec("cpu-local"), training=t,
                                        space=space), nodes=[1, 4])
    assert points[0].layout is None and points[1].layout is None  # 4 and 16 data ranks, 2 sequences
    assert points[1].why.startswith("no layout fits: batch") and points[1].budget is None


def test_cli_plan_nodes_list_table_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--nodes", "1,2,4", "--train-tokens", "1e9", "--price-per-device-hour", "0.5",
            "--global-batch", "16"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for column in ("nodes", "devices", "best layout", "tok/s/dev", "MFU", "useful tok/s", "time to train",
                   "cost / 1M tok", "total cost", "analytical model, not measured"):
        assert column in out
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    sizes = data["sizes"]
    assert [s["nodes"] for s in sizes] == [1, 2, 4] and data["cluster"]["price_per_device_hour"] == 0.5
    for s in sizes:
        assert s["budget"]["time_to_train_s"] == pytest.approx(1e9 / s["tokens_per_s"])
        assert fmt.budget_cells(s["budget"])["time"] in out
    assert main([*argv, "--json", "--critical-batch-tokens", "1024"]) == 0  # 16 sequences of 64 = the batch
    for s in json.loads(capsys.readouterr().out)["sizes"]:
        assert s["useful_tokens_per_s"] == pytest.approx(s["tokens_per_s"] / 2)
    plot = tmp_path / "sizes.html"
    assert main([*argv, "--plot", str(plot)]) == 0
    html = plot.read_text()
    assert "plotly" in html.lower() and "useful tokens\\u002fs (critical batch)" in html and "cost per 1M tokens" in html
    # A single size keeps today's layout table, with the budget columns once a budget is given.
    assert main(["plan", "--nodes", "1", "--train-tokens", "1e9", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "Top 2 of" in out and "time to train" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["--nodes", "4,0"], "--nodes=4,0: 0 is not a positive integer"),
    (["--nodes", "4,8,4"], "--nodes=4,8,4: 4 is given twice"),
    (["--price-per-device-hour", "-1"], "cluster.price_per_device_hour must be a non-negative number, got -1.0"),
    (["--train-tokens", "0"], "training.train_tokens must be a positive number, got 0.0"),
    (["--nodes", "1,2", "--plot", "/nonexistent-dir/x.html"], "--plot='/nonexistent-dir/x.html': cannot write it"),
])
def test_cli_budget_errors_are_one_line_exit_2(argv, message, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshtune plan: error: ") and message in err and "\n" not in err


def test_cli_nodes_not_an_integer_is_argparse_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--nodes", "4,x"])
    assert exc.value.code == 2 and "'x' is not a whole number of nodes" in capsys.readouterr().err


NOKV_SPEC = "model: tiny\ncluster: cpu-local\nworkload: tests.helpers.workloads:NOKV\ntraining: {global_batch: 16}\n"


def test_sizes_plan_only_what_the_workload_runs():
    """The size comparison applies the workload's capabilities as a single plan does (one code path):
    tests/helpers/workloads.py's NOKV refuses tp that does not divide kv_heads (tiny: 2), which no space limit
    expresses, so only ``check_supported`` in the enumeration keeps tp=4 out."""
    from tuner import plan
    from workers.workload_registry import check_workload

    m, c = model_spec("tiny"), cluster_spec("cpu-local")
    t = training_spec({"global_batch": 16}, seq_len=m.seq_len)
    caps = check_workload("tests.helpers.workloads:NOKV", m, t)
    points = plan_sizes(problem=Problem(model=m, cluster=c, training=t, capabilities=caps), nodes=[1, 2])
    bare = plan_sizes(problem=Problem(model=m, cluster=c, training=t), nodes=[1, 2])
    for p, b in zip(points, bare, strict=True):
        single = plan(problem=Problem(model=m,
                                      cluster=cluster_spec({"preset": "cpu-local", "nodes": p.nodes}),
                                      training=t, capabilities=caps))
        assert p.feasible == len(single.entries) and p.layout_key == single.best.layout.key
        assert all(e.layout.tp != 4 for e in single.entries)
        assert b.feasible > p.feasible  # the built-in model runs tp=4 on tiny: the workload's refusal cut it


def test_cli_sizes_of_a_workload_refusing_the_whole_space(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """``--nodes 1,2`` and ``--plot`` with a spec whose workload refuses every layout of its space:
    no size has a best layout, each says why, as ``meshtune plan`` of one size refuses it."""
    spec = tmp_path / "s.yaml"
    spec.write_text(NOKV_SPEC + "space: {tp: [4]}\n")
    html = tmp_path / "sizes.html"
    assert main(["plan", str(spec), "--nodes", "1,2", "--plot", str(html), "--json"]) == 0
    sizes = json.loads(capsys.readouterr().out)["sizes"]
    assert [p["layout"] for p in sizes] == [None, None] and html.stat().st_size > 0
    assert all(p["why"].startswith("no layout fits: not realised by the workload (") for p in sizes), sizes
    assert main(["plan", str(spec), "--nodes", "1"]) == 2
    assert "not realised by the workload" in capsys.readouterr().err
