"""Response bodies of the ranking routes: the ranked layouts (JSON; the CSV is
``api.ranking.service.ranking_csv``) and the ranking transferred to another training stack."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from api.schemas import ResponseModel


class RankingRowOut(ResponseModel):
    rank: int = Field(description="1 = best median; tied layouts keep distinct ranks but share a tie_group.")
    layout_key: str = Field(description="Stable readable identity of the layout.")
    layout: dict[str, Any] = Field(description="The parallel layout.")
    n: int = Field(description="Measurements of this layout (1 + re-measurements).")
    median: float = Field(description="Median of the ranking metric over the measurements.")
    low: float | None = Field(description="Lower end of the 95% interval of the metric (Student t on log values); "
                              "null when n < 2: one run gives no interval (shown as 'n=1') and is never 'not tied'.")
    high: float | None = Field(description="Upper end of the 95% interval of the metric; null when n < 2.")
    tie_group: int = Field(description="Layouts whose intervals overlap share a group number.")
    tied_with_best: bool = Field(description="True when this layout's interval overlaps the best one's.")
    tokens_per_s_per_device: float = Field(description="Median measured tokens/s per device.")
    useful_tokens_per_s: float | None = Field(
        description="Median measured useful tokens/s of the whole job, all devices (critical-batch discounted).")
    useful_tokens_per_s_per_device: float | None = Field(
        None, description="Median measured useful tokens/s per device (comparable with tokens_per_s_per_device).")
    peak_memory_bytes: int | None = Field(description="Median measured peak memory, bytes (max over ranks).")
    predicted_tokens_per_s_per_device: float | None = Field(description="Analytical prediction at proposal time.")
    prediction_error: float | None = Field(description="(predicted - measured) / measured for tokens/s per device.")
    predicted_memory_bytes: int | None = Field(description="Analytical peak memory prediction, bytes.")
    memory_prediction_error: float | None = Field(description="(predicted - measured) / measured for peak memory.")
    simulated: bool = Field(description="True when the measurements come from the simulate backend.")
    trial_numbers: list[int] = Field(description="Numbers of the trials that measured this layout.")
    budget: dict[str, Any] | None = Field(
        None, description="Time and cost to train the sweep's training.train_tokens at this layout's median measured "
        "tokens/s (time_to_train_s, device_hours, cost, cost_per_token at cluster.price_per_device_hour; null parts "
        "where no budget or price is set); simulated when the row is.")


class RankingOut(ResponseModel):
    sweep_id: int = Field(description="The ranked sweep.")
    metric: str = Field(description="What median/low/high are of: tokens_per_s_per_device, or useful_tokens_per_s "
                        "(whole job, all devices).")
    rows: list[RankingRowOut] = Field(description="Measured layouts, best first (the requested page of them).")
    total: int = Field(0, description="Measured layouts in the whole ranking.")
    calibration: dict[str, Any] | None = Field(
        description="The analytical model's efficiency and bandwidth factors fitted to this sweep's measurements."
    )
    simulated: bool = Field(description="True when any row comes from the simulate backend.")
    diagnostic: bool = Field(False, description="True when the sweep's trial.options are diagnostic (injected "
                             "failures, sleeps or memory caps): never mistake these numbers for real measurements.")
    budget: dict[str, Any] | None = Field(
        None, description="The sweep's budget: train_tokens, price_per_device_hour, devices, and what its search "
        "spent (search_device_seconds, search_device_hours, search_cost; simulated on the simulate backend).")


class TransferRowOut(ResponseModel):
    target_rank: int = Field(description="Rank by the target stack's prediction (layouts it predicts do not fit last).")
    measured_rank: int = Field(description="Rank in the sweep's measured ranking.")
    moved: int = Field(description="Places gained on the target stack (measured_rank - target_rank; 0: same place).")
    layout_key: str = Field(description="Stable readable identity of the layout.")
    layout: dict[str, Any] = Field(description="The parallel layout (tp, pp, dp, cp, ep, zero, mbs, ac, sp, ...).")
    n: int = Field(description="Measurements of the layout.")
    measured_tokens_per_s_per_device: float = Field(description="Median measured tokens/s per device (meshtune's "
                                                    "workers).")
    measured_peak_memory_bytes: int | None = Field(description="Median measured peak bytes per device.")
    predicted_tokens_per_s_per_device: float | None = Field(
        description="meshtune's workers (stack meshtune), under the sweep's calibration: the ranking's prediction.")
    target_tokens_per_s_per_device: float | None = Field(
        description="The target stack's prediction, corrected with the sweep's calibration.")
    target_model_tokens_per_s_per_device: float = Field(description="The target stack's prediction, model alone.")
    target_mfu: float | None = Field(description="MFU (PaLM's count) of the target stack's calibrated prediction.")
    target_memory_bytes: int | None = Field(description="The target stack's peak bytes per device, calibrated.")
    target_fits: bool = Field(description="Whether the target stack's predicted peak fits the device.")
    simulated: bool = Field(description="True when the measurement comes from the simulate backend.")


class TransferOut(ResponseModel):
    sweep_id: int = Field(description="The re-ranked sweep.")
    stack: dict[str, Any] = Field(description="The target stack (training.stack) and its properties.")
    calibrated: bool = Field(description="Whether the sweep kept a calibration (else the model alone predicts).")
    rows: list[TransferRowOut] = Field(description="The measured layouts, best first on the target stack.")
    same_winner: bool = Field(description="Whether the measured winner is the target stack's predicted winner.")
    reordered: int = Field(description="Rows whose place on the target stack differs from the measured one.")
    simulated: bool = Field(description="True when the measurements come from the simulate backend.")
