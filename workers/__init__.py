"""Everything torch: the model, parallelisation, measurement, Ray execution, backends.

Importing ``workers`` does not import torch: this face re-exports the light names other packages
use (the trial contract, choosing a backend). The torch and Ray parts are imported from their
public modules where they are needed (``workers.ray_backend``, ``workers.reshard``, ``workers.probe``).
"""

from workers._contract import (
    DIAGNOSTIC_OPTIONS,
    TRIAL_STATUSES,
    Backend,
    BackendUnavailable,
    TrialError,
    TrialRequest,
    TrialResult,
    TrialStatus,
    timeline_max,
)
from workers.backends import BUILTIN_BACKENDS, get_backend, resolve_backend

__all__ = [
    "BUILTIN_BACKENDS",
    "DIAGNOSTIC_OPTIONS",
    "TRIAL_STATUSES",
    "Backend",
    "BackendUnavailable",
    "TrialError",
    "TrialRequest",
    "TrialResult",
    "TrialStatus",
    "get_backend",
    "resolve_backend",
    "timeline_max",
]
