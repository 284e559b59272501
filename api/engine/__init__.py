"""The sweep engine: Optuna ask-and-tell over a sweep's valid layouts, pruning by the memory model,
warm start, budgets, concurrent trials and restart recovery.

``SweepRunner`` runs the stored sweeps (a coordinator's background loop, or ``run_sweep`` for the
CLI), one ``SweepLoop`` per sweep; ``Problem`` is a sweep's model (valid layouts, predictions,
calibration); ``check_runnable`` and ``check_backend`` are what submission checks. The trials table
is the one source of truth: each sweep's ``optuna.Study`` lives in memory, rebuilt from it on start.

The design (where Optuna's state lives and why, the restart rule, claims, sharing the cluster, lost
nodes, outages, failures): docs/engine.md.
"""

from api.engine._model import Prediction, Problem, check_backend, check_runnable
from api.engine._runner import SweepRunner
from api.engine._space import LayoutSpace

__all__ = ["LayoutSpace", "Prediction", "Problem", "SweepRunner", "check_backend", "check_runnable"]
