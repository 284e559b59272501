"""The sweep template the schedule tests fire: the tiny model on the simulate backend, a few trials."""

SIM_TEMPLATE = {
    "name": "nightly-sim", "model": "tiny", "cluster": "cpu-local", "training": {"global_batch": 8},
    "search": {"sampler": "random", "max_trials": 4, "repeats": 3, "remeasure_top_k": 1, "warm_start_top_k": 0},
    "trial": {"warmup_steps": 1, "measure_steps": 3}, "backend": "simulate",
}
