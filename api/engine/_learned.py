"""What earlier sweeps on the same cluster learned, for a new sweep to start from.

The cluster fingerprint is what the trials' environment says about the machine and its software
stack (workers/env.py: device, torch, CUDA, NCCL, backend). From each earlier sweep of the same
fingerprint (newest first, at most ``LIMIT``) a new sweep takes its calibration and the residuals of
its measured layouts under it; ``search.learn_from`` chooses (auto, none, or sweep ids). What is
inherited is weighed and re-checked: api.engine._recheck.

The design (the fingerprint before the first measurement, why residuals transfer):
docs/engine.md#learning-from-earlier-sweeps.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from typing import Any

import numpy as np

from api import store
from api.engine import _calibrate as cal
from api.engine._prediction import cluster_under
from api.spec import SweepSpec
from tuner import Layout

FINGERPRINT_FIELDS = ("backend", "device_kind", "device_name", "torch", "cuda", "nccl", "driver")
LIMIT = 5
MAX_RESIDUALS = 200  # per earlier sweep: the newest measurements
log = logging.getLogger("meshtune.engine")


def fingerprint(env: dict[str, Any] | None, backend: str) -> str | None:
    if not env:
        return None
    picked = {k: env.get(k) for k in FINGERPRINT_FIELDS if k != "backend"}
    picked["backend"] = backend
    return hashlib.sha256(json.dumps(picked, sort_keys=True, default=str).encode()).hexdigest()[:16]


def earlier(session: Any, *, fingerprint: str, sweep_id: int, scaled: Any,
            probe_id: int | None = None, sweep_ids: list[int] | None = None) -> list[dict[str, Any]]:
    """Per earlier sweep on ``fingerprint`` (``sweep_ids``: those sweeps instead, the spec's
    ``search.learn_from``, checked on submission) that modelled the cluster with probe ``probe_id``
    (None: the datasheet; a calibration is relative to the figures it was fitted on), newest first:
    id, calibration and (scaled features, residual) pairs; ``scaled(layout)`` maps a layout to the
    new sweep's feature space."""
    out = []
    if sweep_ids is not None:
        sweeps = [sw for sw in (store.get_sweep(session, sweep_id=i) for i in sorted(sweep_ids, reverse=True))
                  if sw is not None]
    else:
        sweeps = store.sweeps_on_fingerprint(session, fingerprint=fingerprint, before_id=sweep_id, limit=LIMIT)
    for sw in sweeps:
        if ((sw.calibration or {}).get("probe") or {}).get("id") != probe_id:
            continue
        try:
            problem = SweepSpec.model_validate(sw.spec).to_problem()
            model, cluster, training = problem.model, problem.cluster, problem.training
            cluster = cluster_under(sw.calibration, cluster)
        except Exception as exc:  # an old spec this version no longer reads: skip it, say so
            log.warning("sweep %s: earlier sweep %s not learned from (%s)", sweep_id, sw.id, exc)
            continue
        calibration = sw.calibration or {}
        weights = np.array([calibration.get("time", {}).get("weights", {}).get(k, w)
                            for k, w in zip(cal.TIME_PARTS, (1.0, 1.0, 1.0, 1.0, 0.0), strict=True)])
        rows = [t for t in store.all_trials(session, sweep_id=sw.id)
                if t.status == "completed" and t.step_time_s and t.phase == "search"][-MAX_RESIDUALS:]
        residuals = []
        import tuner

        for t in rows:
            layout = Layout(**t.layout)
            try:
                est = tuner.estimate_time(layout, model=model, cluster=cluster, training=training)
            except Exception:  # noqa: BLE001 - a layout this version refuses: nothing to learn from it
                continue
            pred = float(np.dot(cal.time_parts(est.breakdown), weights))
            if pred > 0:
                residuals.append((scaled(layout), math.log(pred / t.step_time_s)))
        out.append({"sweep_id": sw.id, "calibration": calibration, "residuals": residuals})
    return out
