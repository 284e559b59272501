"""One planning problem: what is trained (model, training), on what (cluster), over which layouts
(space) and by which workload (capabilities). Built once per entry point (a spec file, a sweep's
``SweepSpec.to_problem``, a plan request) and handed whole to ``enumerate_layouts``, ``plan``,
``plan_one`` and ``plan_sizes``; per-layout estimators (``estimate_memory``, ``estimate_time``)
take the specs. Design: docs/tuner.md, "Problem".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tuner._realise import Capabilities
from tuner._space import SearchSpace
from tuner._specs import ClusterSpec, ModelSpec, TrainingSpec


@dataclass(frozen=True)
class Problem:
    """``space``: the layouts considered (default: every one); ``capabilities``: what the trial's
    workload realises (None: the built-in model, which realises every layout of this model)."""

    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    space: SearchSpace = field(default_factory=SearchSpace)
    capabilities: Capabilities | None = None

    def __post_init__(self) -> None:
        for name, kind in (("model", ModelSpec), ("cluster", ClusterSpec), ("training", TrainingSpec),
                           ("space", SearchSpace)):
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"Problem.{name} must be a {kind.__name__}, got {getattr(self, name)!r}")
        if self.capabilities is not None and not isinstance(self.capabilities, Capabilities):
            raise TypeError(f"Problem.capabilities must be a Capabilities or None, got {self.capabilities!r}")
