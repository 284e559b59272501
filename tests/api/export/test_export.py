"""Exports of a layout (tuner/_export.py) read back by each framework's own configuration classes
(tests/helpers/frameworks.py: torchtitan's JobConfig and ParallelDims, megatron-core's configs from
Megatron-LM's flags, DeepSpeedConfig, the megatron-core classes Megatron-Bridge subclasses), each
read-back shown to be a real check by a wrong export it refuses; the caveats, bad input, and the
export of a stored sweep's ranked layouts by the API, the CLI, the dashboard and the README's line.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers.frameworks import (
    check_deepspeed_export,
    check_megatron_export,
    check_nemo_export,
    check_torchtitan_export,
    deepspeed_config,
    export_case,
    megatron_core,
    megatron_flags,
    service_header,
    titan_model_of,
    torchtitan_config,
    transformer_config,
)
from tuner import (
    EXPORT_FORMATS,
    MODEL_PRESETS,
    Layout,
    LayoutError,
    SpecError,
    TrainingSpec,
    cluster_spec,
    export_layout,
    load_hf_config,
    model_from_hf_config,
    partition_stages,
)

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
# megatron-core warns about Transformer Engine features (CUDA graphs, fused attention) on CPU.
pytestmark = pytest.mark.filterwarnings(r"ignore::UserWarning:megatron\.core\..*")

def _hf(name):
    return model_from_hf_config(load_hf_config(EXAMPLES / "hf" / f"{name}.json"), name=name, seq_len=4096)


H100x32 = cluster_spec({"preset": "h100-sxm", "nodes": 4})
CPU = cluster_spec("cpu-local")
GB64 = TrainingSpec(global_batch=64)

# (name, model, cluster, training, layout): pp with virtual stages, ZeRO-3, ep, cp, gpipe, ZeRO-0 + ep.
CASES = [
    ("pp4-interleaved-v2-z1-sp", MODEL_PRESETS["llama3-8b"], H100x32, GB64,
     Layout(tp=2, pp=4, dp=4, zero=1, ac="selective", sp=True, schedule="interleaved", vpp=2)),
    ("moe-tp2-cp2-ep2-pp2-z3-v2", MODEL_PRESETS["mixtral-8x7b"], H100x32, GB64,
     Layout(tp=2, pp=2, dp=2, cp=2, ep=2, zero=3, ac="full", sp=True, schedule="interleaved", vpp=2)),
    ("tp8-pp2-gpipe-z2-mbs2", MODEL_PRESETS["llama3-8b"], H100x32, GB64,
     Layout(tp=8, pp=2, dp=2, zero=2, mbs=2, ac="full", schedule="gpipe")),
    ("cp4-dp8-z0", MODEL_PRESETS["llama3-8b"], H100x32, GB64, Layout(cp=4, dp=8)),
    ("tiny-moe-ep2-dp2-z0-mbs2", MODEL_PRESETS["tiny-moe"], CPU, TrainingSpec(global_batch=8),
     Layout(ep=2, dp=2, mbs=2)),
    ("tp4-dp8-z0", MODEL_PRESETS["llama3-8b"], H100x32, GB64, Layout(tp=4, dp=8)),
    # Hugging Face configs (examples/hf): explicit head_dim and qk_norm; shared expert, gate, q/k/v bias.
    ("qwen3-moe-tp4-ep8-z1", _hf("qwen3-30b-a3b"), H100x32, GB64, Layout(tp=4, ep=8, zero=1, ac="full")),
    ("qwen1.5-moe-tp2-ep4-dp4-z3", _hf("qwen1.5-moe-a2.7b"), H100x32, GB64, Layout(tp=2, ep=4, dp=4, zero=3, mbs=2)),
    ("moe-dense-layer0-ep2-pp2", dataclasses.replace(MODEL_PRESETS["tiny-moe"], dense_layers=(0,)), CPU,
     TrainingSpec(global_batch=8), Layout(ep=2, pp=2, schedule="gpipe")),
]
IDS = [c[0] for c in CASES]


# --- torchtitan ------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_torchtitan_job_config_is_read_by_torchtitan(case, tmp_path):
    check_torchtitan_export(case, tmp_path)


def test_torchtitan_refuses_a_field_it_does_not_have(tmp_path):
    """The read-back is a real check: torchtitan rejects a TOML field outside its JobConfig."""
    config, _ = torchtitan_config()
    path = tmp_path / "bad.toml"
    path.write_text(export_case(CASES[0], "torchtitan").text + "not_a_field = 1\n")
    assert "[model]" in path.read_text()
    with pytest.raises(ValueError, match="not_a_field"):
        config.ConfigManager().parse_args(["--job.config_file", str(path)])


# --- Megatron-LM -----------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_megatron_args_build_megatron_core_configs(case):
    check_megatron_export(case)


def test_megatron_core_refuses_a_wrong_layout():
    """The read-back is a real check: TransformerConfig refuses a pipeline layout that loses a layer."""
    torch, TransformerConfig, _, _ = megatron_core()
    case = CASES[0]
    args = megatron_flags(export_case(case, "megatron").settings)
    args["pipeline_model_parallel_layout"] = args["pipeline_model_parallel_layout"].replace("tL", "L")
    with pytest.raises(AssertionError, match="31 ?must match num_layers 32"):
        transformer_config(TransformerConfig, torch, args, bf16=True)


def test_megatron_exports_the_split_its_stack_is_predicted_with():
    """llama3-8b's head costs 2.4 layers: on 32 stages of its 32 layers the megatron stack balances it
    alone on the last stage (Megatron's layout takes a loss-only stage; megatron-core reads it back),
    where meshtune's workers give every stage a layer; the export says so, torchtitan's keeps theirs."""
    case = ("pp8-interleaved-v4", MODEL_PRESETS["llama3-8b"], H100x32, GB64,
            Layout(pp=8, dp=4, schedule="interleaved", vpp=4))
    check_megatron_export(case)
    out = export_case(case, "megatron")
    stages = megatron_flags(out.settings)["pipeline_model_parallel_layout"].split("|")
    ends = partition_stages(MODEL_PRESETS["llama3-8b"], 32, end_stages=True).layers_per_stage
    assert stages[-1] == "L" and [st.count("t") for st in stages] == list(ends)
    assert ends != partition_stages(MODEL_PRESETS["llama3-8b"], 32).layers_per_stage
    assert sum("meshtune's workers ran" in c for c in out.caveats) == 1
    assert not any("meshtune's workers ran" in c for c in export_case(case, "torchtitan").caveats)


# --- DeepSpeed -------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_deepspeed_json_is_read_by_deepspeed(case, monkeypatch):
    check_deepspeed_export(case, monkeypatch)


def test_deepspeed_refuses_the_wrong_data_parallel_size(monkeypatch):
    """The read-back is a real check: DeepSpeed refuses the batch triple on a dp that ignores ep."""
    case = CASES[1]  # ep=2
    out = export_case(case, "deepspeed")
    with pytest.raises(AssertionError, match="train_batch_size"):
        deepspeed_config(monkeypatch, out.settings, case[4].dp)


# --- NeMo / Megatron-Bridge ------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_nemo_overrides_build_the_configs_bridge_subclasses(case):
    check_nemo_export(case)


# --- caveats and bad input -------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", EXPORT_FORMATS)
def test_every_output_states_that_dp_excludes_ep(fmt):
    out = export_case(CASES[1], fmt)
    assert any("excludes ep=2" in c and "dp*ep=4" in c for c in out.caveats)
    assert any("excludes ep=2" in line for line in out.notes)  # stderr / --caveats of the CLI
    if fmt not in ("megatron", "nemo"):  # argument lists hold only the arguments
        assert "excludes ep=2" in out.text  # in the file itself, not only beside it


def test_what_has_no_equivalent_is_said_not_dropped():
    gpipe = CASES[2]
    assert any("gpipe has no Megatron equivalent" in c for c in export_case(gpipe, "megatron").caveats)
    assert any("sp=false" in c for c in export_case(gpipe, "torchtitan").caveats)  # tp=8 without sp
    ds = export_case(gpipe, "deepspeed").caveats
    assert any("ZeRO stage 0 or 1 only" in c for c in ds) and any("'gpipe' has no equivalent" in c for c in ds)
    moe = export_case(CASES[1], "deepspeed").caveats
    assert any("ep_size=2" in c for c in moe) and any("Ulysses" in c for c in moe)
    z0_ep = export_case(CASES[4], "torchtitan")
    assert z0_ep.settings["parallelism"]["data_parallel_shard_degree"] == 2
    assert any("zero=0 with ep=2" in c for c in z0_ep.caveats)
    assert any("measured on CPU ranks" in c for c in z0_ep.caveats)
    z0_tp = export_case(CASES[5], "torchtitan")
    assert z0_tp.settings["parallelism"]["data_parallel_shard_degree"] == 8
    assert any("DDP runs only without other parallelism" in c for c in z0_tp.caveats)


def test_bad_format_and_layout_name_the_field():
    _, model, cluster, training, lay = CASES[0]
    with pytest.raises(SpecError, match=r"^format='yaml' is not an export format \(one of torchtitan, "):
        export_layout(lay, model=model, cluster=cluster, training=training, format="yaml")
    with pytest.raises(LayoutError, match=r"=48 does not equal the device count 32"):
        export_layout(lay.with_(tp=3), model=model, cluster=cluster, training=training, format="megatron")


# --- CLI, API and dashboard on a stored sweep (seeded through the store, no Ray) -------------------

@pytest.fixture(scope="module")
def export_store(tmp_path_factory):
    from api import store
    from api.ranking import service as rankings
    from api.spec import SweepSpec
    from api.sweeps import service as sweeps_service
    from tests.helpers.dashboard_seed import SPEC, seed_sweep

    url = f"sqlite:///{tmp_path_factory.mktemp('export') / 'meshtune.db'}"
    engine, sessions = store.open_store(url)
    sid = seed_sweep(sessions, n_trials=8, name="export sweep")
    with store.session_scope(sessions) as session:  # queued: no trial has completed
        empty = sweeps_service.create_sweep(session, spec=SweepSpec.model_validate(SPEC | {"name": "empty"}),
                                            owner="alice").id
    with sessions() as session:
        rows = rankings.ranking(session, sweep_id=sid).rows
    yield {"url": url, "sid": sid, "empty": empty, "rows": rows}
    engine.dispose()


@pytest.fixture(scope="module")
def export_client(export_store):
    from fastapi.testclient import TestClient

    from api.main import create_app
    from api.settings import Settings

    with TestClient(create_app(Settings(database_url=export_store["url"]), run_engine=False)) as c:
        yield c


def _expected(export_store, rank, fmt, header=()):
    """What tuner.export_layout writes for the ranked row (the service adds only the header)."""
    from api.spec import SweepSpec
    from tests.helpers.dashboard_seed import SPEC

    problem = SweepSpec.model_validate(SPEC).to_problem()
    model, cluster, training = problem.model, problem.cluster, problem.training
    row = export_store["rows"][rank - 1]
    return export_layout(Layout(**row.layout), model=model, cluster=cluster, training=training, format=fmt,
                         header=header)


@pytest.mark.parametrize("fmt", EXPORT_FORMATS)
def test_api_exports_a_ranked_layout_by_rank_or_key(export_client, export_store, fmt):
    sid, rows = export_store["sid"], export_store["rows"]
    assert len(rows) >= 2
    r = export_client.get(f"/api/sweeps/{sid}/export", params={"format": fmt})
    assert r.status_code == 200, r.text
    notes = json.loads(r.headers["x-meshtune-notes"])
    header = service_header(notes)
    assert header[0].startswith(f"sweep {sid} (export sweep), rank 1 of {len(rows)}") and "simulated" in header[0]
    # Exactly what tuner.export_layout writes with the service's header; the notes are its own.
    want = _expected(export_store, 1, fmt, header)
    assert r.text == want.text and notes == list(want.notes)
    assert r.headers["content-type"].startswith(want.media_type)
    assert f"rank-1-{want.filename}" in r.headers["content-disposition"]
    by_key = export_client.get(f"/api/sweeps/{sid}/export", params={"format": fmt, "layout": rows[1].layout_key})
    by_rank = export_client.get(f"/api/sweeps/{sid}/export", params={"format": fmt, "rank": 2})
    assert by_key.status_code == by_rank.status_code == 200 and by_key.text == by_rank.text != r.text


@pytest.mark.parametrize(("query", "status", "line"), [
    ({"format": "yaml"}, 422, "format='yaml' is not an export format (one of torchtitan, torchtitan-launch, megatron, megatron-launch, deepspeed, nemo)"),
    ({"format": "nemo", "rank": 99}, 404, "rank=99 is not in sweep {sid}'s ranking"),
    ({"format": "nemo", "layout": "tp9"}, 404, "layout='tp9' is not a measured layout of sweep {sid}"),
    ({"format": "nemo", "rank": 1, "layout": "tp9"}, 422, "rank=1 and layout='tp9': give one of them, not both"),
    ({"format": "megatron", "sweep": "empty"}, 409, "sweep {empty} has no completed trial to export"),
    ({"format": "megatron", "sweep": 424242}, 404, "sweep 424242 does not exist"),
])
def test_api_bad_export_is_one_line(export_client, export_store, query, status, line):
    query = dict(query)
    sweep = query.pop("sweep", "sid")
    sid = export_store[sweep] if isinstance(sweep, str) else sweep
    r = export_client.get(f"/api/sweeps/{sid}/export", params=query)
    assert r.status_code == status
    assert r.json()["detail"].startswith(line.format(sid=sid, empty=export_store["empty"]))


def test_cli_export_prints_writes_and_refuses_with_exit_2(export_store, export_client, monkeypatch, capsys, tmp_path):
    from api.cli import main

    monkeypatch.setenv("MESHTUNE_DATABASE_URL", export_store["url"])
    sid = export_store["sid"]
    assert main(["export", str(sid), "--format", "megatron"]) == 0
    printed = capsys.readouterr()
    answer = export_client.get(f"/api/sweeps/{sid}/export", params={"format": "megatron"})
    assert printed.out == answer.text  # only the arguments on stdout
    assert printed.err.splitlines() == json.loads(answer.headers["x-meshtune-notes"])  # notes on stderr
    out = tmp_path / "ds.json"
    assert main(["export", str(sid), "--layout", export_store["rows"][1].layout_key, "--format", "deepspeed",
                 "--out", str(out)]) == 0
    assert json.loads(out.read_text())["train_batch_size"] == 64
    assert f"wrote {out}" in capsys.readouterr().err
    for argv, line in (
        (["--format", "toml"], "format='toml' is not an export format"),
        (["--rank", "0", "--format", "nemo"], "rank must be a positive integer, got 0"),
        (["--rank", "50", "--format", "nemo"], f"rank=50 is not in sweep {sid}'s ranking"),
    ):
        assert main(["export", str(sid), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"meshtune export: error: {line}") and err.count("\n") == 1, err
    assert main(["export", str(export_store["empty"]), "--format", "nemo"]) == 2
    assert f"sweep {export_store['empty']} has no completed trial to export" in capsys.readouterr().err


def test_dashboard_ranked_rows_link_each_format(export_client, export_store):
    import html
    import re

    sid, rows = export_store["sid"], export_store["rows"]
    page = export_client.get(f"/sweeps/{sid}")
    assert page.status_code == 200
    links = [html.unescape(h) for h in re.findall(r'href="(/sweeps/\d+/export\?[^"]+)"', page.text)]
    for row in rows:
        for fmt in EXPORT_FORMATS:
            assert f"/sweeps/{sid}/export?format={fmt}&layout={row.layout_key}" in links
    got = export_client.get(links[0])
    assert got.status_code == 200 and "attachment" in got.headers["content-disposition"]
    assert got.text == export_client.get(f"/api/sweeps/{sid}/export", params={"format": "torchtitan"}).text
    bad = export_client.get(f"/sweeps/{sid}/export", params={"format": "xml", "layout": rows[0].layout_key})
    assert bad.status_code == 422 and bad.text.startswith("format='xml' is not an export format")


def test_exports_follow_the_read_rule(export_store):
    """With reads behind a token: the API wants the bearer token, the dashboard link the cookie."""
    from fastapi.testclient import TestClient

    from api.dashboard.router import COOKIE
    from api.main import create_app
    from api.settings import Settings

    settings = Settings(database_url=export_store["url"], api_tokens={"alice": "tok-export"}, read_requires_auth=True)
    sid, key = export_store["sid"], export_store["rows"][0].layout_key
    with TestClient(create_app(settings, run_engine=False)) as c:
        assert c.get(f"/api/sweeps/{sid}/export", params={"format": "nemo"}).status_code == 401
        ok = c.get(f"/api/sweeps/{sid}/export", params={"format": "nemo"},
                   headers={"Authorization": "Bearer tok-export"})
        assert ok.status_code == 200
        assert c.get(f"/sweeps/{sid}/export", params={"format": "nemo", "layout": key}).status_code == 401
        c.cookies.set(COOKIE, "tok-export")
        assert c.get(f"/sweeps/{sid}/export", params={"format": "nemo", "layout": key}).text == ok.text


# --- pasteable: the README's shell line, the launch scripts ------------------------------------------

README = Path(__file__).resolve().parents[3] / "README.md"


def _meshtune_on_path(tmp_path):
    """A ``meshtune`` command running this tree's CLI, first on PATH (as the installed entry point)."""
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / "meshtune"
    exe.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m api.cli \"$@\"\n")
    exe.chmod(0o755)
    root = str(Path(__file__).resolve().parents[3])
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _bash(script, env, cwd):
    import subprocess

    done = subprocess.run(["bash", "-c", script], env=env, cwd=cwd, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()
    return done


def test_the_readme_line_gives_pretrain_gpt_the_exported_argv(export_store, tmp_path):
    """The README's own shell line, run by bash, yields exactly the exported arguments (quoting of
    the pipeline layout's | included), with the header and caveats on stderr, none on stdout."""
    line = next(x.strip() for x in README.read_text().splitlines() if x.strip().startswith('eval "LAYOUT_ARGS=('))
    assert export_store["sid"] == 1 and "meshtune export 1 " in line
    env = _meshtune_on_path(tmp_path) | {"MESHTUNE_DATABASE_URL": export_store["url"]}
    done = _bash(line + '\nprintf "%s\\0" "${LAYOUT_ARGS[@]}"', env, tmp_path)
    got = done.stdout.decode().split("\0")[:-1]
    want = _expected(export_store, 1, "megatron")
    assert got == want.settings
    assert any("|" in w for w in got)  # a word that needed quoting went through
    assert "caveat: meshtune's dp=" in done.stderr.decode()


def _stub_torchrun(tmp_path):
    """A ``torchrun`` on PATH that records its argv (NUL-separated) and environment."""
    import os

    bin_dir = tmp_path / "stub"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text('#!/usr/bin/env bash\nprintf "%s\\0" "$@" > "$ARGV_OUT"\nenv > "$ENV_OUT"\n')
    (bin_dir / "torchrun").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "ARGV_OUT": str(tmp_path / "argv"),
            "ENV_OUT": str(tmp_path / "env")}


def test_megatron_launch_runs_torchrun_on_the_layouts_world(tmp_path):
    _, model, cluster, training, lay = CASES[0]  # 4 nodes x 8, tp=2: Megatron-LM asks CUDA_DEVICE_MAX_CONNECTIONS=1
    out = export_case(CASES[0], "megatron-launch")
    argv = export_case(CASES[0], "megatron").settings
    script = tmp_path / "train.sh"
    script.write_text(out.text)
    env = _stub_torchrun(tmp_path) | {"NODE_RANK": "3", "MASTER_ADDR": "10.0.0.7", "MEGATRON_LM": "/opt/Megatron-LM"}
    env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    _bash(f"bash {shlex.quote(str(script))} --log-interval 1", env, tmp_path)
    got = (tmp_path / "argv").read_text().split("\0")[:-1]
    assert got == ["--nnodes", "4", "--nproc-per-node", "8", "--node-rank", "3", "--master-addr", "10.0.0.7",
                   "--master-port", "29500", "/opt/Megatron-LM/pretrain_gpt.py", *argv, "--train-iters", "100",
                   "--lr", f"{training.lr:g}", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
                   str(model.vocab - 1), "--log-interval", "1"]
    assert cluster.nodes * cluster.devices_per_node == lay.world_size
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in (tmp_path / "env").read_text().splitlines()
    assert out.text.startswith("#!/usr/bin/env bash\n# meshtune layout ") and "# caveat: " in out.text


def test_torchtitan_launch_writes_the_job_config_and_flavour_and_runs_torchtitan(tmp_path):
    config, _ = torchtitan_config()
    case = ("mistral", _hf("mistral-7b"), H100x32, GB64, Layout(tp=4, dp=8, zero=1))  # a registered flavour
    out, toml = export_case(case, "torchtitan-launch"), export_case(case, "torchtitan")
    script, where = tmp_path / "titan.sh", tmp_path / "configs"
    where.mkdir()
    script.write_text(out.text)
    env = _stub_torchrun(tmp_path) | {"CONFIG_DIR": str(where)}
    _bash(f"bash {shlex.quote(str(script))} --training.steps 10", env, tmp_path)
    job_file = where / toml.filename
    assert job_file.read_text() == toml.text and (where / "meshtune_flavor.py").read_text() == toml.files["meshtune_flavor.py"]
    got = (tmp_path / "argv").read_text().split("\0")[:-1]
    assert got[-6:] == ["-m", "torchtitan.train", "--job.config_file", str(job_file), "--training.steps", "10"]
    pythonpath = next(x for x in (tmp_path / "env").read_text().splitlines() if x.startswith("PYTHONPATH="))
    assert pythonpath.removeprefix("PYTHONPATH=").split(":")[0] == str(where)
    job = config.ConfigManager().parse_args(["--job.config_file", str(job_file)])
    _, args = titan_model_of(job, where)
    assert (args.dim, args.n_layers, args.rope_theta) == (4096, 32, 10_000.0)


# --- which layout, and how sure ------------------------------------------------------------------------

def _row(rank, n, median, low, high, layout):
    return SimpleNamespace(rank=rank, n=n, median=median, low=low, high=high, layout=layout.__dict__ | {},
                           layout_key=layout.key)


def test_the_header_names_the_tied_layouts_or_a_single_run():
    from api.export.service import how_sure

    a, b, c = Layout(dp=8), Layout(tp=2, dp=4), Layout(pp=2, dp=4)
    rows = [_row(1, 3, 100, 95, 105, a), _row(2, 3, 98, 94, 103, b), _row(3, 1, 60, 55, 65, c)]
    lines = how_sure(rows[0], rows, sweep_id=7)
    assert lines[0] == "tied with 1 other layout (95% intervals overlap, so measurement cannot order them): #2 tp2 dp4"
    assert lines[-1].startswith("another ranked layout: meshtune export 7 --rank N, or --layout KEY|SHORT")
    once = how_sure(rows[2], rows, sweep_id=7)
    assert once[0].startswith("measured once: this rank rests on a single run (re-measure it")
    alone = [_row(1, 1, 100, None, None, a)]
    assert "has no interval" in how_sure(alone[0], alone, sweep_id=7)[0]


def test_cli_layout_by_short_form_caveats_file_and_companion_module(export_store, monkeypatch, capsys, tmp_path):
    from api.cli import main
    from api.format import layout_text

    monkeypatch.setenv("MESHTUNE_DATABASE_URL", export_store["url"])
    sid, row = export_store["sid"], export_store["rows"][1]
    assert main(["export", str(sid), "--rank", "2", "--format", "megatron"]) == 0
    by_rank = capsys.readouterr()
    caveats = tmp_path / "caveats.txt"
    assert main(["export", str(sid), "--layout", layout_text(row.layout), "--format", "megatron",
                 "--caveats", str(caveats)]) == 0
    by_short = capsys.readouterr()
    assert by_short.out == by_rank.out and by_short.err == "" and caveats.read_text() == by_rank.err
    assert f"rank 2 of {len(export_store['rows'])}" in caveats.read_text()
    job = tmp_path / "job.toml"
    assert main(["export", str(sid), "--format", "torchtitan", "--out", str(job)]) == 0
    err = capsys.readouterr().err
    assert (tmp_path / "meshtune_flavor.py").is_file() and f"wrote {job} and {tmp_path / 'meshtune_flavor.py'}" in err
    assert main(["export", str(sid), "--layout", "dp99 z9", "--format", "nemo"]) == 2
    assert "layout='dp99 z9' is not a measured layout" in capsys.readouterr().err


# --- re-run at size --------------------------------------------------------------------------------

def test_run_trial_takes_nodes_and_devices_per_node_for_any_preset(capsys):
    from api.cli import main

    argv = ["run-trial", "--model", "llama3-8b", "--cluster", "h100-sxm", "--layout", "tp=8,dp=2",
            "--global-batch", "64", "--backend", "simulate", "--json"]
    assert main(argv) == 2  # 16 ranks on the preset's one node
    assert "does not equal the device count 8" in capsys.readouterr().err
    assert main([*argv, "--nodes", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["status"] == "completed" and result["simulated"]
    assert main([*argv[:-1], "--nodes", "4", "--devices-per-node", "4", "--layout", "tp=4,dp=4"]) == 0
    assert "(4 x 4)" in capsys.readouterr().out
    for option, value in (("--nodes", "2.5"), ("--nodes", "0"), ("--devices-per-node", "-8")):
        assert main([*argv, option, value]) == 2
        err = capsys.readouterr().err
        assert err == f"meshtune run-trial: error: {option} must be a positive integer, got '{value}'\n", err
