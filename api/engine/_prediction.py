"""What the analytical model predicts for a layout under a calibration's weights: the prior's (all
parts weighted 1, no per-step constant) or those a stored calibration recorded as in force
(api.engine._model.SweepModel fits them; api.engine._calibrate names the parts), on the cluster with
the probed figures the sweep used (``cluster_under``). ``predict_under`` re-predicts stored rows
under one calibration, so a ranking's errors never mix versions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

import tuner
from api.engine import _calibrate as cal
from tuner import ClusterSpec, Layout, ModelSpec, TrainingSpec

PRIOR_TIME_W = np.array([1.0, 1.0, 1.0, 1.0, 0.0])
PRIOR_MEM_W = np.array([1.0, 1.0, 1.0])


@dataclass(frozen=True)
class Prediction:
    memory_bytes: int
    step_time_s: float | None
    tokens_per_s_per_device: float | None
    useful_fraction: float | None
    fits: bool
    prune_cause: str | None
    calibration_version: int = 0  # the calibration the prediction was made under (0: the prior)

    def columns(self) -> dict[str, Any]:
        return {
            "calibration_version": self.calibration_version,
            "predicted_memory_bytes": self.memory_bytes,
            "predicted_step_time_s": self.step_time_s,
            "predicted_tokens_per_s_per_device": self.tokens_per_s_per_device,
            "useful_fraction": self.useful_fraction,
        }


def weights_in_force(calibration: dict[str, Any] | None) -> tuple[np.ndarray, np.ndarray]:
    """The time and memory weights a stored calibration predicts with (the prior's when it has none)."""
    calibration = calibration or {}
    force = calibration.get("in_force") or {
        k: calibration[k]["weights"] for k in ("time", "memory") if k in calibration}  # before "in_force"
    time_w = np.array([force["time"][k] for k in cal.TIME_PARTS]) if "time" in force else PRIOR_TIME_W.copy()
    mem_w = np.array([force["memory"][k] for k in cal.MEMORY_PARTS]) if "memory" in force else PRIOR_MEM_W.copy()
    return time_w, mem_w


def cluster_under(calibration: dict[str, Any] | None, cluster: ClusterSpec) -> ClusterSpec:
    """``cluster`` with the figures of the probe the calibration's sweep used (``calibration["probe"]``,
    api/probes/service.py ``record_of``); as it is when the sweep used the datasheet."""
    figures = ((calibration or {}).get("probe") or {}).get("figures")
    return tuner.with_probe(cluster, figures) if figures else cluster


def predict_under(calibration: dict[str, Any] | None, layouts: dict[str, Layout], *, model: ModelSpec,
                  cluster: ClusterSpec, training: TrainingSpec) -> dict[str, tuple[float | None, int | None]]:
    """key -> (predicted tokens/s per device, predicted peak bytes per device) of each layout under one stored
    calibration: what the ranking's "pred err" compares with, so that no two rows' errors mix
    calibrations (the rows' own stored predictions were made under whichever version was in force
    when each trial started)."""
    time_w, mem_w = weights_in_force(calibration)
    cluster = cluster_under(calibration, cluster)
    tokens = training.global_batch * model.seq_len
    out: dict[str, tuple[float | None, int | None]] = {}
    for key, layout in layouts.items():
        est = tuner.estimate_time(layout, model=model, cluster=cluster, training=training)
        mem = tuner.estimate_memory(layout, model=model, cluster=cluster, training=training)
        step = float(np.dot(cal.time_parts(est.breakdown), time_w))
        tps = tokens / step / layout.world_size if step > 0 else None
        out[key] = (tps, math.ceil(float(np.dot(cal.memory_parts(mem), mem_w))))
    return out
