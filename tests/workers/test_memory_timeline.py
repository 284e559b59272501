"""Memory timelines, unit level: the recorder on real memory of this process (CPU), its downsampling,
and the memory model's per-rank parts. The real trials' timelines (stored, drawn per rank on the
trial page, their maximum equal to the trial's peak) are checked in test_api_e2e.py, on the session's
one real sweep."""

from __future__ import annotations

import time

import pytest
import torch

from tuner import Layout, cluster_spec, estimate_memory, model_spec, training_spec
from tuner._memory_parts import PARTS, memory_parts
from workers import timeline_max
from workers._memory_timeline import MAX_POINTS, Phases, StepMemory, downsample

MiB = 2**20


def test_the_peak_is_the_timelines_maximum_and_falls_in_the_phase_that_allocated_it():
    """A real 96 MiB transient allocated and freed inside one phase, on this process: the high-water
    mark catches it whether or not the sampler saw it, the phase in force when it rose is named, and
    the reported peak is the timeline's maximum."""
    phases = Phases()
    memory = StepMemory(torch.device("cpu"), phases, step=3)
    memory.start()
    phases.mark("forward", 0, 0)
    small = torch.ones(1024)
    phases.mark("backward", 0, 1)
    big = torch.ones(96 * MiB // 4)  # touched: resident
    time.sleep(0.01)  # a few samples see it (not needed for the mark, which the kernel keeps)
    del big
    phases.mark("optimizer")
    del small
    memory.stop()
    memory.finish()
    tl = memory.timeline()
    start_rss = tl["bytes"][0]
    assert tl["step_peak_bytes"] - start_rss >= 90 * MiB
    assert tl["peak"]["where"] == "step" and not tl["peak"]["held_from_start"]
    assert (tl["peak"]["phase"], tl["peak"]["stage"], tl["peak"]["micro_batch"]) == ("backward", 0, 1)
    lo, hi = tl["peak"]["between_ms"]
    marks = {p[1]: p[0] for p in tl["phases"]}
    assert marks["backward"] <= lo <= hi <= marks["optimizer"] + 1e-6
    # by construction: the reported peak is the timeline's maximum, and every sample is below it
    assert tl["peak_bytes"] == timeline_max(tl) == max(tl["before_bytes"], max(tl["bytes"]), tl["after_bytes"])
    assert max(tl["bytes"]) == tl["step_peak_bytes"]
    assert tl["step"] == 3 and tl["series"] == "cpu.VmRSS" and tl["peak_measure"] == "cpu.VmHWM"
    # what malloc had handed out: the 96 MiB in the phase that held it, whatever the resident set did
    assert tl["live_measure"] == "cpu.malloc_in_use" and len(tl["live"]) == len(tl["bytes"])
    assert (tl["live_peak"]["phase"], tl["live_peak"]["micro_batch"]) == ("backward", 1)
    assert tl["live_peak"]["bytes"] - tl["live"][0] >= 90 * MiB
    assert len(tl["t_ms"]) == len(tl["bytes"]) <= MAX_POINTS + 1


def test_a_failed_step_leaves_no_sampler_thread():
    import threading

    memory = StepMemory(torch.device("cpu"), Phases(), step=0)
    memory.start()
    assert any(t.name == "meshtune-memory" for t in threading.enumerate())
    memory.close()  # what train_trial's finally does when the step raised
    memory.close()  # idempotent
    assert not any(t.name == "meshtune-memory" for t in threading.enumerate())


def test_downsampling_keeps_every_extreme_and_the_ends():
    series = [(i * 0.001, 1000 + (i % 7)) for i in range(5000)]
    series[2345] = (2.345, 10_000)  # one spike
    series[3000] = (3.0, 1)  # one dip
    out = downsample(series, MAX_POINTS)
    assert len(out) <= MAX_POINTS and out[0] == series[0] and out[-1] == series[-1]
    assert (2.345, 10_000) in out and (3.0, 1) in out
    two = [(t, v, 50 if i != 1234 else 999) for i, (t, v) in enumerate(series)]  # a second column's spike too
    out2 = downsample(two, MAX_POINTS)
    assert len(out2) <= MAX_POINTS and two[1234] in out2 and (2.345, 10_000, 50) in out2
    assert [t for t, _ in out] == sorted(t for t, _ in out)
    assert downsample(series[:10], MAX_POINTS) == series[:10]


@pytest.mark.parametrize("layout", [
    Layout(pp=2, dp=2, schedule="1f1b"), Layout(tp=2, dp=2), Layout(pp=4, mbs=2, schedule="gpipe"),
    Layout(pp=2, dp=2, vpp=2, schedule="interleaved", zero=3, ac="full"), Layout(dp=4, zero=1, mbs=2),
], ids=lambda lay: lay.key)
def test_parts_per_pp_rank_add_up_to_the_memory_model(layout):
    model, cluster = model_spec("tiny"), cluster_spec("cpu-local")
    training = training_spec({"global_batch": 16, "precision": "fp32"}, seq_len=model.seq_len)
    parts = memory_parts(layout, model=model, cluster=cluster, training=training)
    assert [p["stage"] for p in parts] == list(range(layout.pp))
    for p in parts:
        assert p["total"] == sum(p[k] for k in PARTS)
        assert p["activations"] == pytest.approx(p["per_micro_batch"] * p["in_flight"], abs=1)
    est = estimate_memory(layout, model=model, cluster=cluster, training=training)
    costliest = max(parts, key=lambda p: p["total"])
    assert (costliest["total"], costliest["stage"]) == (est.total, est.stage)
    assert parts[-1]["logits"] > 0 and all(p["logits"] == 0 for p in parts[:-1])
    if layout.pp > 1 and layout.schedule == "1f1b":  # the first stage holds the most micro-batches
        assert parts[0]["in_flight"] > parts[-1]["in_flight"]


def test_cuda_history_is_summed_into_allocated_bytes():
    """The CUDA series (not run here: no GPU) from a snapshot's trace as torch writes it: alloc adds,
    free_requested subtracts, segment events are the reserve, not allocations; times on the wall
    clock, or spread in order when the entries carry none."""
    memory = StepMemory(torch.device("cpu"), Phases(), step=0)
    memory.cuda, memory.start_allocated, memory.epoch0, memory.t0 = True, 1000, 100.0, 5.0
    memory.samples.add(5.0, 1000, 1000, -1)
    memory.samples.add(5.010, 1000, 1600, -1)
    memory.trace = [{"action": "segment_alloc", "size": 2 ** 21, "time_us": 100_000_500},
                    {"action": "alloc", "size": 600, "time_us": 100_001_000},
                    {"action": "free_requested", "size": 600, "time_us": 100_004_000},
                    {"action": "free_completed", "size": 600, "time_us": 100_004_100},
                    {"action": "alloc", "size": 200, "time_us": 100_006_000}]
    assert memory._series() == [(0.0, 1000, None), (pytest.approx(0.001), 1600, None),
                                (pytest.approx(0.004), 1000, None), (pytest.approx(0.006), 1200, None)]
    for e in memory.trace:
        e.pop("time_us")
    assert [b for _, b, _ in memory._series()] == [1000, 1600, 1000, 1200]
    assert [t for t, _, _ in memory._series()] == pytest.approx([0.0, 0.0025, 0.005, 0.0075])


def test_the_recorder_does_not_grow_the_memory_it_measures():
    """A step that allocates nothing: thousands of readings later the resident set has not grown
    (readings go to arrays written before the window opens; the sampler's stack is warm before it)."""
    phases = Phases()
    memory = StepMemory(torch.device("cpu"), phases, step=0, sample_s=0.0005)
    memory.start()
    for i in range(2000):
        phases.mark("forward" if i % 2 else "backward", 0, i)
    time.sleep(0.05)
    memory.stop()
    memory.finish()
    tl = memory.timeline()
    assert memory.marks.n == 2000 and memory.samples.n > 10
    # no growth beyond a few pages of allocator noise (a list-of-tuples recorder grew it by 434 kB here)
    assert tl["step_peak_bytes"] - tl["bytes"][0] <= 16 * 1024, tl["step_peak_bytes"] - tl["bytes"][0]


def test_readings_halve_when_full():
    from workers._memory_timeline import _Readings

    r = _Readings(8)
    for i in range(20):
        r.add(float(i), i, i, i)
    times = [t for t, *_ in r.rows()]  # halved at the 9th, 13th and 17th reading
    assert r.stride == 8 and r.n == 8 and times == sorted(times) and times[0] == 0.0 and times[-1] == 19.0
    marks = _Readings(4, drop_when_full=True)
    for i in range(6):
        marks.add(float(i), i, i, i, 0, 0, i)
    assert marks.n == 4 and marks.dropped == 2 and marks.rows()[-1][-1] == 3
