"""One truth for every layout: what the tuner calls valid the workers run, once per program.

- No two entries of ``meshtune plan --json`` run the same program: entries are canonical layouts
  with distinct keys, and every pair of space combinations that realise the same program (the
  tuner's ``Realisation``, where it has landed) shares one canonical key.
- Static: every canonical valid layout of mixtral-8x7b on 32 GPUs and llama3-405b on 16,384 passes
  the workers' own pre-launch check (the function ``parallelize_model`` calls, not a copy).
- Runtime: >= 40 distinct canonical layouts of tiny and tiny-moe drawn at random (fixed seed, every
  mesh at least once) run for real on 4 CPU ranks: 0 crashes.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import json
import random

import pytest

from api.cli import main
from tuner import (
    Layout,
    Problem,
    TrainingSpec,
    canonical_layout,
    check_layout,
    cluster_spec,
    divisors,
    enumerate_layouts,
    layout_violation,
    model_spec,
    training_spec,
    twin_note,
)


def _realise():
    """tuner's ``realise`` (the workers' realisation of a layout), or None before it lands."""
    try:
        return importlib.import_module("tuner._realise").realise
    except (ImportError, AttributeError):
        return None


# --- canonical keys ------------------------------------------------------------------------------


def test_plan_json_entries_are_distinct_programs(capsys: pytest.CaptureFixture[str]) -> None:
    """tiny on cpu-local, batch 16 (the issue's case): 1,392 space combinations, of which 528 are a
    twin of another (zero 1-3 with dp*cp*ep = 1; ZeRO-1 with one micro-batch, where its single
    reduce-scatter is ZeRO-2's), so 690 valid programs + 174 rejected ones; the JSON lists each
    program once. ZeRO-1 and ZeRO-2 under pp > 1 are distinct programs: the workers' pipeline stage
    reduce-scatters every micro-batch for ZeRO-2 and once per step for ZeRO-1 (tuner._realise)."""
    assert main(["plan", "--model", "tiny", "--cluster", "cpu-local", "--json", "--top", "100000"]) == 0
    data = json.loads(capsys.readouterr().out)
    model, training = model_spec("tiny"), training_spec(data["training"])
    layouts = [Layout(**e["layout"]) for e in data["entries"]]
    assert len(layouts) == data["feasible"]
    assert all(canonical_layout(x, training=training) == x for x in layouts)
    assert len({x.key for x in layouts}) == len(layouts)
    assert data["feasible"] + data["infeasible"] + sum(v for k, v in data["rejected"].items()
                                                       if k != "memory exceeds device") + data["twins"] == 1392
    assert data["twins"] == 528 and data["feasible"] + data["infeasible"] == 690
    realise = _realise()
    if realise is not None:
        cluster = cluster_spec("cpu-local")
        programs = [realise(x, model, cluster, training) for x in layouts]
        assert len(set(map(repr, programs))) == len(programs)


def _raw_space(model, cluster):
    """Every (tp, cp, ep, dp, pp, schedule, vpp, zero, mbs, ac, sp) combination of the default space,
    twins included, as Layouts (mesh degrees whose product is the device count)."""
    world = cluster.devices
    for tp in divisors(world):
        for cp in divisors(world // tp):
            rest = world // (tp * cp)
            for ep in divisors(rest) if model.is_moe else (1,):
                for pp in divisors(rest // ep):
                    dp = rest // (ep * pp)
                    scheds = [("gpipe", 1), ("1f1b", 1)] + ([("interleaved", 2), ("interleaved", 4)] if pp > 1 else [])
                    for (sched, vpp), zero, mbs, ac, sp in itertools.product(
                        scheds, (0, 1, 2, 3), (1, 2, 4, 8), ("none", "selective", "full"), (False, True)
                    ):
                        if not (sp and tp == 1):
                            yield Layout(tp=tp, cp=cp, ep=ep, dp=dp, pp=pp, zero=zero, mbs=mbs, ac=ac, sp=sp,
                                         schedule=sched, vpp=vpp)


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_twins_share_one_key_brute_force(preset: str) -> None:
    """Over the whole raw space (gpipe at pp = 1 included): the canonical form is idempotent, keeps
    the verdict, is what enumeration lists, and the user is told why a twin was renamed; where the
    Realisation has landed, equal realisations <=> one canonical key."""
    model, cluster = model_spec(preset), cluster_spec("cpu-local")
    training = training_spec({"global_batch": 16})
    enum = enumerate_layouts(problem=Problem(model=model, cluster=cluster, training=training))
    listed = set(enum.valid)
    realise = _realise()
    by_program: dict[str, set[str]] = {}
    by_key: dict[str, set[str]] = {}
    for raw in _raw_space(model, cluster):
        canon = canonical_layout(raw, training=training)
        assert canonical_layout(canon, training=training) == canon
        note = twin_note(raw, canon)
        assert (note is None) == (raw == canon) and (note is None or canon.key in note)
        if layout_violation(raw, model=model, cluster=cluster, training=training):
            continue
        assert canon in listed, (raw.key, canon.key)
        if realise is not None:
            program = repr((realise(raw, model, cluster, training), raw.mbs, raw.ac, raw.sp, canon.schedule, raw.vpp))
            by_program.setdefault(program, set()).add(canon.key)
            by_key.setdefault(canon.key, set()).add(program)
    if realise is not None:
        assert all(len(keys) == 1 for keys in by_program.values())  # same program -> one key
        assert all(len(progs) == 1 for progs in by_key.values())  # one key -> one program


def test_user_twin_is_reported_under_its_canonical_key() -> None:
    training = training_spec({"global_batch": 8})
    given = Layout(tp=2, pp=2, zero=2, schedule="gpipe")  # dp*cp*ep = 1: nothing to shard
    canon = canonical_layout(given, training=training)
    assert canon == Layout(tp=2, pp=2, zero=0, schedule="gpipe")
    assert twin_note(given, canon) == (
        "zero=2 runs the zero=0 program (no data axis: dp*cp*ep=1*1*1=1): reported as "
        "tp2-cp1-ep1-dp1-pp2-z0-mbs1-ac_none-gpipe")
    # One micro-batch without pipelining: ZeRO-1's single reduce-scatter is ZeRO-2's.
    assert canonical_layout(Layout(dp=4, zero=1, mbs=2), training=training).zero == 2
    assert canonical_layout(Layout(dp=4, zero=1, mbs=1), training=training).zero == 1  # 2 micro-batches
    assert canonical_layout(Layout(dp=4, schedule="gpipe"), training=training).schedule == "1f1b"


def test_user_layouts_enter_as_their_canonical_twin(capsys: pytest.CaptureFixture[str]) -> None:
    """run-trial runs and reports the canonical key with a note; search.layouts lists twins once."""
    from api.spec import SweepSpec

    argv = ["run-trial", "--model", "tiny", "--cluster", "cpu-local", "--layout", "tp=2,pp=2,zero=2",
            "--global-batch", "8", "--backend", "simulate", "--warmup", "0", "--measure", "1"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "layout tp2-cp1-ep1-dp1-pp2-z0-mbs1-ac_none-1f1b" in out
    assert "note: zero=2 runs the zero=0 program (no data axis: dp*cp*ep=1*1*1=1)" in err
    tiny = {"model": "tiny", "cluster": "cpu-local", "training": {"global_batch": 8}}
    listed = SweepSpec.model_validate({**tiny, "search": {"layouts": [{"tp": 4, "zero": 3}, {"dp": 4}]}})
    assert [x.key for x in listed.listed_layouts()] == ["tp4-cp1-ep1-dp1-pp1-z0-mbs1-ac_none-nopp",
                                                        "tp1-cp1-ep1-dp4-pp1-z0-mbs1-ac_none-nopp"]
    twins = [{"dp": 4, "mbs": 2, "zero": 1}, {"dp": 4, "mbs": 2, "zero": 2}]  # batch 8: one micro-batch
    with pytest.raises(ValueError, match=r"search.layouts\[1\]='tp1-cp1-ep1-dp4-pp1-z2-mbs2-ac_none-nopp' repeats "
                       r"search.layouts\[0\] \(the same program: zero=1 runs the zero=2 program \(one micro-batch"):
        SweepSpec.model_validate({**tiny, "search": {"layouts": twins}})


# --- static: valid layouts pass the workers' own pre-launch check ---------------------------------


def _workers_check():
    """The pre-launch check ``parallelize_model`` itself calls (asserted from its source, so the
    test can never check a copy): ``check_supported`` where the workers export it."""
    par = importlib.import_module("workers.parallelize")
    source = inspect.getsource(par.parallelize_model)
    for name in ("check_supported", "check_tp_supported"):
        fn = getattr(par, name, None)
        if fn is not None and f"{name}(" in source:
            params = list(inspect.signature(fn).parameters)
            return (lambda layout, spec, f=fn: f(layout, spec)) if params[0] == "layout" else (
                lambda layout, spec, f=fn: f(spec, layout))
    raise AssertionError("parallelize_model calls no exported pre-launch check")


@pytest.mark.parametrize(
    ("preset", "cluster", "batch_tokens"),
    [("mixtral-8x7b", {"preset": "h100-sxm", "nodes": 4}, 4 * 2**20),
     ("llama3-405b", {"preset": "h100-sxm", "nodes": 2048}, 16 * 2**20)],
)
def test_no_valid_layout_is_refused_by_the_workers(preset: str, cluster: dict, batch_tokens: int) -> None:
    from tuner import LayoutError

    model, c = model_spec(preset), cluster_spec(cluster)
    training = training_spec({"global_batch_tokens": batch_tokens}, seq_len=model.seq_len)
    enum = enumerate_layouts(problem=Problem(model=model, cluster=c, training=training))
    check, realise = _workers_check(), _realise()
    refused = []
    # Every canonical valid layout (mixtral: ~1.8 x 10^4, llama: ~4.5 x 10^4; the check is cheap).
    for layout in enum.valid:
        try:
            check(layout, model)
            if realise is not None:
                realise(layout, model, c, training)
        except LayoutError as exc:
            refused.append(f"{layout.key}: {exc}")
    assert not refused, f"{len(refused)} of {len(enum.valid)} valid layouts refused, e.g. {refused[:3]}"
    assert len({(x.tp, x.cp, x.ep, x.dp, x.pp) for x in enum.valid}) > 20  # many meshes covered


# --- runtime: random valid layouts run on 4 CPU ranks ----------------------------------------------

RUNTIME_BATCH = 8  # the smallest batch that leaves pp=4 schedules (m >= 4 at dp = 1) and mbs 2 valid


def draw_layouts(preset: str, n: int, seed: int) -> list[Layout]:
    """``n`` distinct canonical valid layouts: one per mesh (tp, cp, ep, dp, pp) first, then the rest
    at random, all from a seeded shuffle of the enumeration."""
    enum = enumerate_layouts(problem=Problem(model=model_spec(preset), cluster=cluster_spec("cpu-local"),
                                             training=training_spec({"global_batch": RUNTIME_BATCH})))
    pool = list(enum.valid)
    random.Random(seed).shuffle(pool)
    picked, meshes = [], set()
    for layout in pool:
        mesh = (layout.tp, layout.cp, layout.ep, layout.dp, layout.pp)
        if mesh not in meshes:
            meshes.add(mesh)
            picked.append(layout)
    rest = [x for x in pool if x not in set(picked)]
    return (picked + rest)[:max(n, len(picked))]


RUNTIME_DRAWS = {"tiny": 18, "tiny-moe": 22}  # 40 in all; every mesh of both (10 dense + 15 MoE) included


@pytest.mark.parametrize("preset", sorted(RUNTIME_DRAWS))
def test_random_valid_layouts_run(preset: str, ray_backend) -> None:
    from workers import TrialRequest

    model, cluster = model_spec(preset), cluster_spec("cpu-local")
    training: TrainingSpec = training_spec({"global_batch": RUNTIME_BATCH})
    layouts = draw_layouts(preset, RUNTIME_DRAWS[preset], seed=12)
    assert len(set(layouts)) == len(layouts) >= RUNTIME_DRAWS[preset]
    failed = []
    for layout in layouts:
        check_layout(layout, model=model, cluster=cluster, training=training)
        result = ray_backend.run(TrialRequest(model=model, cluster=cluster, training=training, layout=layout,
                                              warmup_steps=1, measure_steps=1, step_timeout_s=120))
        if result.status != "completed":
            failed.append(f"{layout.key}: {result.status} {result.error.message if result.error else ''}"[:300])
    assert not failed, f"{len(failed)} of {len(layouts)} failed:\n" + "\n".join(failed)
