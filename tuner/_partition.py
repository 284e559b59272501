"""Split a model's layers over pipeline stages so that every stage does about the same work.

A stage's cost is its layers' training FLOPs per token plus, on the last stage, the output
projection and loss, and on the first stage the embedding. The embedding lookup is nearly free in
FLOPs but not in time (a memory-bound gather forward and a scatter-add into a vocab x hidden
gradient backward), so it is charged as ``embedding_cost`` times the head's FLOPs (an assumption to
be calibrated with measured stage times). With interleaving (``stages = pp * vpp``), stage ``s``
runs on pp rank ``s % pp``. Every stage holds a decoder layer unless ``end_stages`` (a stack whose
runtime can run the embedding and the head with the loss as stages of their own, tuner/_stack.py):
then the first and the last stage may hold none, and up to layers + 2 stages can be filled.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache

from tuner._errors import LayoutError, require_positive_int
from tuner._formulas import head_flops_per_token, layer_flops_per_token
from tuner._specs import ModelSpec

# Embedding lookup + gradient scatter, relative to the output head's FLOPs (same vocab x hidden table,
# memory-bound instead of compute-bound). Llama 3 (Sec. 3.3.2) moved one layer off the first stage.
EMBEDDING_COST = 0.25


def embedding_cost_per_token(model: ModelSpec, embedding_cost: float = EMBEDDING_COST) -> float:
    """FLOP-equivalent cost charged to the first stage for the embedding (see module docstring)."""
    return embedding_cost * head_flops_per_token(model)


@dataclass(frozen=True)
class StagePartition:
    layers_per_stage: tuple[int, ...]
    stage_costs: tuple[float, ...]  # training FLOPs per token of each stage (embedding FLOP-equivalent)
    imbalance: float  # max/mean of stage_costs
    equal_count_layers: tuple[int, ...]
    equal_count_imbalance: float

    @property
    def stages(self) -> int:
        return len(self.layers_per_stage)

    def first_layer(self, stage: int) -> int:
        """Global index of the first layer of ``stage``."""
        return sum(self.layers_per_stage[:stage])

    def layers_of(self, stage: int) -> range:
        start = self.first_layer(stage)
        return range(start, start + self.layers_per_stage[stage])

    def rank_layers(self, pp: int) -> tuple[int, ...]:
        """Layers held by each pp rank (stage s runs on rank s % pp)."""
        out = [0] * pp
        for s, n in enumerate(self.layers_per_stage):
            out[s % pp] += n
        return tuple(out)


def _costs(counts: tuple[int, ...] | list[int], layer: float, emb: float, head: float) -> tuple[float, ...]:
    costs = [n * layer for n in counts]
    costs[0] += emb
    costs[-1] += head
    return tuple(costs)


def _imbalance(costs: tuple[float, ...]) -> float:
    return max(costs) / (sum(costs) / len(costs))


def equal_count_split(layers: int, stages: int) -> tuple[int, ...]:
    """The naive split: layers // stages each, the remainder on the first stages."""
    q, r = divmod(layers, stages)
    return tuple(q + 1 if s < r else q for s in range(stages))


def max_stages(model: ModelSpec, *, end_stages: bool = False) -> int:
    """The most pipeline stages ``model`` splits into: one decoder layer each, and with
    ``end_stages`` the embedding and the head with the loss on stages of their own."""
    return model.layers + (2 if end_stages else 0)


@lru_cache(maxsize=1024)
def _partition(model: ModelSpec, stages: int, embedding_cost: float, end_stages: bool = False) -> StagePartition:
    layer = layer_flops_per_token(model)
    emb = embedding_cost_per_token(model, embedding_cost)
    head = head_flops_per_token(model)
    # Water-filling: every stage gets one layer (the ends none where they may be stages of their
    # own, with more than one stage), then each further layer goes to the currently cheapest stage.
    # With identical layer costs this minimises the most expensive stage.
    counts = [1] * stages
    if end_stages and stages > 1:
        counts[0] = counts[-1] = 0
    base = list(_costs(counts, layer, emb, head))
    heap = [(c, s) for s, c in enumerate(base)]
    heapq.heapify(heap)
    for _ in range(model.layers - sum(counts)):
        c, s = heapq.heappop(heap)
        counts[s] += 1
        heapq.heappush(heap, (c + layer, s))
    costs = _costs(counts, layer, emb, head)
    equal = equal_count_split(model.layers, stages)
    return StagePartition(
        layers_per_stage=tuple(counts),
        stage_costs=costs,
        imbalance=_imbalance(costs),
        equal_count_layers=equal,
        equal_count_imbalance=_imbalance(_costs(equal, layer, emb, head)),
    )


def partition_stages(model: ModelSpec, stages: int, *, embedding_cost: float = EMBEDDING_COST,
                     end_stages: bool = False) -> StagePartition:
    """Balance ``model.layers`` over ``stages`` pipeline stages (each gets at least one layer; with
    ``end_stages`` the first and the last may get none)."""
    require_positive_int("stages", stages)
    most = max_stages(model, end_stages=end_stages)
    if stages > most:
        ends = " + 2 (the embedding and the loss as stages of their own)" if end_stages else ""
        raise LayoutError(f"stages={stages} exceed layers={model.layers}{ends}")
    if not embedding_cost >= 0:
        raise LayoutError(f"embedding_cost must be >= 0, got {embedding_cost!r}")
    return _partition(model, stages, float(embedding_cost), bool(end_stages))
