"""One export's job: the numbers every export format needs (micro-batches, the frameworks' data size,
the stage partition, what the model trains as), derived once from a layout and its problem."""

from __future__ import annotations

from dataclasses import dataclass

from tuner._export_model import TrainedModel, trained_model
from tuner._layout import Layout, check_layout
from tuner._partition import partition_stages
from tuner._specs import ClusterSpec, ModelSpec, TrainingSpec


@dataclass(frozen=True)
class ExportJob:
    """The numbers every format needs, derived once from the layout and the problem."""

    layout: Layout
    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    microbatches: int  # per data rank and step
    data: int  # dp*ep: the frameworks' data-parallel size
    stage_layers: tuple[int, ...]  # meshtune's partition of the layers, stage s on pp rank s % pp
    trained: TrainedModel  # what the model trains as beyond its shape (tuner/_export_model.py)

    @property
    def local_batch(self) -> int:
        return self.training.global_batch // self.data

    @property
    def bf16(self) -> bool:
        return self.training.precision == "bf16"


def export_job(layout: Layout, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec) -> ExportJob:
    m = check_layout(layout, model=model, cluster=cluster, training=training)
    stages = partition_stages(model, layout.stages).layers_per_stage if layout.pp > 1 else (model.layers,)
    return ExportJob(layout, model, cluster, training, m, layout.dp * layout.ep, stages, trained_model(model))
