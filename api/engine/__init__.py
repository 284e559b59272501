"""The sweep engine: Optuna ask-and-tell over a sweep's valid layouts, pruning by the memory model,
warm start, budgets, concurrent trials and restart recovery.

``SweepRunner`` runs the stored sweeps (a coordinator's background loop, or ``run_sweep`` for the
CLI), one ``SweepLoop`` per sweep; ``SweepModel`` is a sweep's model over its ``tuner.Problem``
(valid layouts, predictions, calibration); ``check_runnable`` and ``check_backend`` are what
submission checks (the tuner's analysis only, no SweepModel). The trials table is the one source
of truth: each sweep's ``optuna.Study`` lives in memory, rebuilt from it on start.

The design (where Optuna's state lives and why, the restart rule, claims, sharing the cluster, lost
nodes, outages, failures): docs/engine.md.
"""

from api.engine._model import Prediction, SweepModel
from api.engine._prediction import predict_under
from api.engine._runner import SweepRunner
from api.engine._space import LayoutSpace
from api.engine._submission import check_backend, check_runnable

__all__ = [
    "LayoutSpace", "Prediction", "SweepModel", "SweepRunner", "check_backend", "check_runnable", "predict_under",
]
