"""meshtune's pure logic: specs, layouts, placement, memory/time model, partitioner, search space.

Public names are re-exported here from private modules (Optuna's convention); import from ``tuner``.
This package imports neither torch.distributed nor the database.
"""

from tuner._errors import (
    BackendError,
    ConflictError,
    LayoutError,
    MeshtuneError,
    NotFoundError,
    SpecError,
    UnknownPresetError,
)
from tuner._layout import AXES, CHECKPOINTING, SCHEDULES, Layout, check_layout, microbatches
from tuner._specs import (
    CLUSTER_PRESETS,
    MODEL_PRESETS,
    ClusterSpec,
    ModelSpec,
    TrainingSpec,
    cluster_spec,
    model_spec,
    to_dict,
    training_spec,
)

__all__ = [
    "AXES",
    "CHECKPOINTING",
    "CLUSTER_PRESETS",
    "MODEL_PRESETS",
    "SCHEDULES",
    "BackendError",
    "ClusterSpec",
    "ConflictError",
    "Layout",
    "LayoutError",
    "MeshtuneError",
    "ModelSpec",
    "NotFoundError",
    "SpecError",
    "TrainingSpec",
    "UnknownPresetError",
    "check_layout",
    "cluster_spec",
    "microbatches",
    "model_spec",
    "to_dict",
    "training_spec",
]
