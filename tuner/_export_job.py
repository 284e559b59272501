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
    stage_layers: tuple[int, ...]  # the format's partition of the layers, stage s on pp rank s % pp
    trained: TrainedModel  # what the model trains as beyond its shape (tuner/_export_model.py)
    # the partition meshtune's workers run (differs from ``stage_layers`` only where the format's
    # stack lets the ends be stages of their own: tuner/_stack.py ``end_stages``)
    workers_stage_layers: tuple[int, ...]

    @property
    def local_batch(self) -> int:
        return self.training.global_batch // self.data

    @property
    def bf16(self) -> bool:
        return self.training.precision == "bf16"


def export_job(layout: Layout, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, *,
               end_stages: bool = False) -> ExportJob:
    """The job of ``layout``; ``end_stages``: split the layers as the format's stack is predicted with
    (tuner/_partition.py), the embedding and the loss free to be stages of their own."""
    m = check_layout(layout, model=model, cluster=cluster, training=training)

    def split(ends: bool) -> tuple[int, ...]:
        return partition_stages(model, layout.stages, end_stages=ends).layers_per_stage if layout.pp > 1 else (
            model.layers,)

    return ExportJob(layout, model, cluster, training, m, layout.dp * layout.ep, split(end_stages),
                     trained_model(model), split(False))
