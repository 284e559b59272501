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
from tuner._export import FORMATS as EXPORT_FORMATS
from tuner._export import Export, check_format, export_layout
from tuner._formulas import (
    korthikanti_layer_activation_bytes,
    microbatches_in_flight,
    model_flops_per_token,
    pipeline_bubble_fraction,
    useful_fraction,
    zero_model_state_bytes,
)
from tuner._hf import (
    SUPPORTED_MODEL_TYPES,
    load_hf_config,
    model_arg,
    model_from_hf_config,
)
from tuner._layout import (
    AXES,
    CHECKPOINTING,
    SCHEDULES,
    Layout,
    canonical_layout,
    canonical_zero,
    check_layout,
    degree_violation,
    layout_violation,
    microbatches,
    twin_note,
)
from tuner._memory import (
    MEMORY_HEADROOM,
    OVERHEAD_BYTES,
    MemoryEstimate,
    estimate_memory,
    layer_activation_bytes,
    usable_memory,
)
from tuner._partition import EMBEDDING_COST, StagePartition, equal_count_split, partition_stages
from tuner._placement import AxisPlacement, Placement, place
from tuner._plan import R_MEMORY, R_TP_NODES, Plan, PlannedLayout, plan, plan_one
from tuner._presets import CLUSTER_PRESETS, MODEL_PRESETS, cluster_spec, model_spec, training_spec
from tuner._probe import FigureRow, LayerFigure, LinkFigure, ProbedFigures, figure_rows, with_probe
from tuner._references import REFERENCE_LAYOUTS, ReferenceLayout
from tuner._space import Enumeration, SearchSpace, divisors, enumerate_layouts
from tuner._specfile import Problem, load_problem, problem_from_mapping, read_spec_file
from tuner._specs import PRECISIONS, ClusterSpec, ModelSpec, TrainingSpec, to_dict
from tuner._stack import DEFAULT_STACK, STACKS, Stack
from tuner._timing import (
    CalibrationFactors,
    TimeEstimate,
    estimate_time,
)

__all__ = [
    "AXES",
    "CHECKPOINTING",
    "CLUSTER_PRESETS",
    "EMBEDDING_COST",
    "EXPORT_FORMATS",
    "MEMORY_HEADROOM",
    "MODEL_PRESETS",
    "OVERHEAD_BYTES",
    "PRECISIONS",
    "REFERENCE_LAYOUTS",
    "R_MEMORY",
    "R_TP_NODES",
    "SCHEDULES",
    "DEFAULT_STACK",
    "STACKS",
    "SUPPORTED_MODEL_TYPES",
    "AxisPlacement",
    "BackendError",
    "CalibrationFactors",
    "ClusterSpec",
    "ConflictError",
    "Enumeration",
    "Export",
    "FigureRow",
    "Layout",
    "LayerFigure",
    "LayoutError",
    "LinkFigure",
    "MemoryEstimate",
    "MeshtuneError",
    "ModelSpec",
    "NotFoundError",
    "Placement",
    "Plan",
    "PlannedLayout",
    "ProbedFigures",
    "Problem",
    "ReferenceLayout",
    "SearchSpace",
    "Stack",
    "SpecError",
    "StagePartition",
    "TimeEstimate",
    "TrainingSpec",
    "UnknownPresetError",
    "canonical_layout",
    "canonical_zero",
    "check_format",
    "check_layout",
    "cluster_spec",
    "degree_violation",
    "divisors",
    "enumerate_layouts",
    "equal_count_split",
    "estimate_memory",
    "estimate_time",
    "export_layout",
    "figure_rows",
    "korthikanti_layer_activation_bytes",
    "layer_activation_bytes",
    "layout_violation",
    "load_hf_config",
    "load_problem",
    "microbatches",
    "microbatches_in_flight",
    "model_arg",
    "model_flops_per_token",
    "model_from_hf_config",
    "model_spec",
    "partition_stages",
    "pipeline_bubble_fraction",
    "place",
    "plan",
    "plan_one",
    "problem_from_mapping",
    "read_spec_file",
    "to_dict",
    "training_spec",
    "twin_note",
    "usable_memory",
    "useful_fraction",
    "with_probe",
    "zero_model_state_bytes",
]
