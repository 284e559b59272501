"""Stage partitioner: balanced compute, uneven splits, the ends of the pipeline."""

from __future__ import annotations

from functools import cache

import pytest

from tuner import LayoutError, SpecError, equal_count_split, model_spec, partition_stages
from tuner._partition import embedding_cost_per_token, head_flops_per_token, layer_flops_per_token


def optimal_max_cost(layers: int, stages: int, layer: float, emb: float, head: float, *,
                     end_stages: bool = False) -> float:
    """Exhaustive minimum over every split of the most expensive stage (contiguous, >= 1 layer; with
    ``end_stages`` the first and the last stage may hold none)."""

    def least(s: int) -> int:
        return 0 if end_stages and s in (0, stages - 1) else 1

    @cache
    def best(s: int, left: int) -> float:
        if s == stages - 1:
            return left * layer + head + (emb if s == 0 else 0) if left >= least(s) else float("inf")
        out = float("inf")
        after = sum(least(r) for r in range(s + 1, stages))
        for n in range(least(s), left - after + 1):
            cost = n * layer + (emb if s == 0 else 0)
            out = min(out, max(cost, best(s + 1, left - n)))
        return out

    return best(0, layers)


def test_60_layers_on_8_stages() -> None:
    model = model_spec({"preset": "llama3-8b", "layers": 60})
    part = partition_stages(model, 8)
    assert len(part.layers_per_stage) == 8 and sum(part.layers_per_stage) == 60
    assert min(part.layers_per_stage) >= 1
    layer, emb, head = layer_flops_per_token(model), embedding_cost_per_token(model), head_flops_per_token(model)
    # The 128k-vocab head costs ~1.8 layers, the embedding a quarter of that: the ends get fewer layers.
    assert head / layer == pytest.approx(1.84, abs=0.01)
    assert part.layers_per_stage[-1] < max(part.layers_per_stage)
    assert part.layers_per_stage[0] < max(part.layers_per_stage)
    assert max(part.stage_costs) == pytest.approx(optimal_max_cost(60, 8, layer, emb, head))
    assert part.equal_count_layers == (8, 8, 8, 8, 7, 7, 7, 7)
    assert part.imbalance < part.equal_count_imbalance
    mean = (60 * layer + emb + head) / 8
    assert part.equal_count_imbalance == pytest.approx((7 * layer + head) / mean)
    assert part.imbalance == pytest.approx(max(part.stage_costs) / mean)
    assert part.first_layer(0) == 0 and part.first_layer(3) == sum(part.layers_per_stage[:3])


@pytest.mark.parametrize(("preset", "stages"), [("llama3-405b", 16), ("gpt3-175b", 12), ("small", 3), ("tiny", 4)])
def test_balanced_split_is_optimal(preset: str, stages: int) -> None:
    model = model_spec(preset)
    part = partition_stages(model, stages)
    layer, emb, head = layer_flops_per_token(model), embedding_cost_per_token(model), head_flops_per_token(model)
    assert max(part.stage_costs) == pytest.approx(optimal_max_cost(model.layers, stages, layer, emb, head))
    assert part.imbalance <= part.equal_count_imbalance + 1e-12


def test_llama3_405b_ends_lose_a_layer() -> None:
    # Llama 3 (Dubey et al. 2024 Sec. 3.3.2) removed one layer from the first and the last stage.
    part = partition_stages(model_spec("llama3-405b"), 16)
    assert part.layers_per_stage == (7,) + (8,) * 14 + (7,)


def test_the_ends_as_stages_of_their_own() -> None:
    # A stack whose runtime runs the embedding and the loss as stages of their own (Megatron's layout
    # "E|t|...|t|L"): Llama 3 405B's 126 layers + the 2 ends on 16 x 8 stages, one each (Dubey et al. 2024
    # Sec. 3.3.2); 127 stages leave only the heavier end (the head, 0.6 of a layer) alone.
    model = model_spec("llama3-405b")
    assert partition_stages(model, 128, end_stages=True).layers_per_stage == (0,) + (1,) * 126 + (0,)
    assert partition_stages(model, 128, end_stages=True).rank_layers(16) == (7,) + (8,) * 14 + (7,)
    assert partition_stages(model, 127, end_stages=True).layers_per_stage == (1,) * 126 + (0,)
    with pytest.raises(LayoutError, match=r"^stages=128 exceed layers=126$"):
        partition_stages(model, 128)
    with pytest.raises(LayoutError, match=r"^stages=129 exceed layers=126 \+ 2 \(the embedding and the loss"):
        partition_stages(model, 129, end_stages=True)
    # Ends lighter than a layer: the same split either way; llama3-8b's head (2.4 layers) alone on its stage
    # where that balances better, each split the exhaustive optimum of its rule.
    for stages in (16, 64):
        assert partition_stages(model, stages, end_stages=True) == partition_stages(model, stages)
    small = model_spec("llama3-8b")
    layer, emb, head = layer_flops_per_token(small), embedding_cost_per_token(small), head_flops_per_token(small)
    ends = partition_stages(small, 24, end_stages=True)
    assert ends.layers_per_stage[-1] == 0 and ends.layers_per_stage != partition_stages(small, 24).layers_per_stage
    assert max(ends.stage_costs) == pytest.approx(optimal_max_cost(32, 24, layer, emb, head, end_stages=True))
    assert max(ends.stage_costs) < max(partition_stages(small, 24).stage_costs)


def test_interleaved_rank_layers_and_edge_cases() -> None:
    model = model_spec("tiny")
    assert partition_stages(model, 1).layers_per_stage == (4,)
    assert partition_stages(model, 1).imbalance == 1.0
    part = partition_stages(model, 4)
    assert part.layers_per_stage == (1, 1, 1, 1)
    assert part.rank_layers(2) == (2, 2)  # stage s on pp rank s % pp
    assert equal_count_split(10, 4) == (3, 3, 2, 2)
    with pytest.raises(LayoutError, match="stages=5 exceed layers=4"):
        partition_stages(model, 5)
    with pytest.raises(SpecError, match="stages must be a positive integer, got 0"):
        partition_stages(model, 0)
