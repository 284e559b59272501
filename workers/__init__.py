"""Everything torch: the model, parallelisation, measurement, Ray execution, backends.

Importing ``workers`` does not import torch; the contract types are light so the coordinator can
use them without paying for torch at start-up.
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
)

__all__ = ["DIAGNOSTIC_OPTIONS", "TRIAL_STATUSES", "Backend", "BackendUnavailable", "TrialError", "TrialRequest", "TrialResult", "TrialStatus"]
