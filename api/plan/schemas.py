"""Response bodies of the plan routes: the plan (its fastest predicted layouts), the best layout per
cluster size, and per device type and size. Every field carries a description (the OpenAPI document)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from api.schemas import ResponseModel


class PlannedLayoutOut(ResponseModel):
    key: str = Field(description="Stable readable identity of the layout.")
    layout: dict[str, Any] = Field(description="The parallel layout (tp, pp, dp, cp, ep, zero, mbs, ac, sp, schedule, vpp).")
    microbatches: int = Field(description="Microbatches per step per data-parallel rank.")
    placement: dict[str, Any] = Field(
        description="How the mesh axes map onto the topology: summary, order, mesh_dim_names, mesh_shape."
    )
    memory: dict[str, Any] = Field(
        description="Predicted bytes per device: params, grads, optimizer, activations, overhead, total; "
        "stage = the pipeline stage with the peak; fits."
    )
    time: dict[str, Any] = Field(
        description="Predicted step_time_s, tokens_per_s, tokens_per_s_per_device, mfu, hfu, useful_tokens_per_s, "
        "and the step-time breakdown (compute, communication, bubble, ... seconds)."
    )
    budget: dict[str, Any] | None = Field(
        None, description="Time and cost to train training.train_tokens at the predicted tokens/s: time_to_train_s, "
        "device_hours, cost, cost_per_token (null parts where no budget or price is given).")


COMPARISON_FIGURES = (
    "Where the cluster's figures come from: source 'probed' (probe_id: the newest stored probe of this hardware "
    "and model at any node count, `meshtune probe`; probe_nodes: the nodes it ran on; datasheet_links: per tier "
    "of links the probe's nodes did not have, the node counts that keep the datasheet's figures there) or "
    "'datasheet', and a line saying so (text).")


class PlanSizesOut(ResponseModel):
    model: dict[str, Any] = Field(description="The resolved model spec.")
    cluster: dict[str, Any] = Field(description="The resolved cluster spec (nodes: the first size; probed: the "
                                    "figures it is modelled with, see figures).")
    training: dict[str, Any] = Field(description="The resolved training spec (the first size's batch).")
    scale_batch: bool = Field(description="Whether the global batch grows with the device count.")
    sizes: list[dict[str, Any]] = Field(
        description="Per node count: devices, global_batch, the best predicted layout (null when none fits, with "
        "why), tokens_per_s, tokens_per_s_per_device, mfu, useful_tokens_per_s (critical batch), budget "
        "(time_to_train_s, device_hours, cost, cost_per_token).")
    figure: dict[str, Any] = Field(description="The comparison as a plotly figure (data and layout) for plotly.js.")
    seconds: float = Field(description="Time the analytical planner took, seconds.")
    figures: dict[str, Any] = Field(default_factory=dict, description=COMPARISON_FIGURES)


class PlanDevicesOut(ResponseModel):
    model: dict[str, Any] = Field(description="The resolved model spec.")
    clusters: list[dict[str, Any]] = Field(description="The resolved cluster spec of each device type (with its price, "
                                           "and the probed figures it is modelled with).")
    training: dict[str, Any] = Field(description="The resolved training spec (the first size's batch).")
    stack: dict[str, Any] = Field(description="The training stack predicted for (training.stack) and its properties.")
    scale_batch: bool = Field(description="Whether the global batch grows with the device count.")
    devices: list[dict[str, Any]] = Field(
        description="Per (device type, node count): device, nodes, devices, the best predicted layout (null when none "
        "fits, with why), tokens_per_s, mfu, budget (time_to_train_s, cost, cost_per_token), fastest, cheapest.")
    figure: dict[str, Any] = Field(description="The comparison as a plotly figure (data and layout) for plotly.js.")
    seconds: float = Field(description="Time the analytical planner took, seconds.")
    figures: list[dict[str, Any]] = Field(default_factory=list, description=(
        "Per device type (device: its preset), in the order compared: a probe applies only to its own "
        "device type. " + COMPARISON_FIGURES))


class PlanOut(ResponseModel):
    model: dict[str, Any] = Field(description="The resolved model spec.")
    cluster: dict[str, Any] = Field(description="The resolved cluster spec.")
    training: dict[str, Any] = Field(description="The resolved training spec (batch in sequences).")
    feasible: int = Field(description="Valid layouts predicted to fit in device memory: the distinct runs, each a "
                          "different program (layouts that run the same program are one canonical layout).")
    infeasible: int = Field(description="Valid layouts predicted not to fit (pruned with no device time).")
    rejected: dict[str, int] = Field(description="Candidates rejected before estimation, counted by reason.")
    twins: int = Field(0, description="Space combinations that run the same program as a counted layout, "
                       "folded into it (e.g. zero 1-3 with dp*cp*ep = 1 is the zero=0 program).")
    entries: list[PlannedLayoutOut] = Field(description="The fastest predicted feasible layouts, best first (top N).")
    seconds: float = Field(description="Time the analytical planner took, seconds.")
    figures: dict[str, Any] = Field(default_factory=dict, description=(
        "Where the cluster's figures come from: source 'probed' (probe_id: the newest stored probe of this cluster "
        "and model, `meshtune probe`, else the newest of this hardware and model at another node count; "
        "probe_nodes: the nodes it ran on; datasheet_links: per tier of links the probe's nodes did not have and "
        "this cluster has, [this node count], where the datasheet's figures stay) or 'datasheet' (probe_nodes "
        "null), and a line saying so (text: also when some tensor-parallel degrees of the plan were not probed)."))
