"""Bodies of the confirm routes: the request, and the report of short runs against long runs."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from api.schemas import ResponseModel
from api.spec import ConfirmSettings as ConfirmIn  # the request's body is the spec's search.confirm

__all__ = ["ConfirmIn", "ConfirmOut", "ConfirmRowOut"]


class ConfirmRowOut(ResponseModel):
    layout_key: str = Field(description="The layout's identity.")
    layout: dict[str, Any] = Field(description="The parallel layout.")
    short_rank: int = Field(description="Its place in the short-run ranking (1 = the sweep's winner).")
    short_median: float = Field(description="Short runs: median tokens/s per device (the ranking's).")
    short_low: float | None = Field(description="Short runs: lower end of the ranking's 95% interval.")
    short_high: float | None = Field(description="Short runs: upper end of the ranking's 95% interval.")
    short_n: int = Field(description="Short-run measurements (trials) behind the median.")
    status: str = Field(description="The long run: pending, running, completed, oom, timeout, crash or nan.")
    trial_id: int | None = Field(description="Row id of the long run's trial (its page: /sweeps/{id}/trials/{trial_id}).")
    trial_number: int | None = Field(description="The long run's trial number.")
    cause: str | None = Field(description="Why the long run did not complete, if it did not.")
    steps: int = Field(description="Measured steps of the long run.")
    long_median: float | None = Field(description="Long run: median tokens/s per device over its steps.")
    long_low: float | None = Field(description="95% bootstrap interval of that median (resampling the steps).")
    long_high: float | None = Field(description="Upper end of that interval.")
    long_rank: int | None = Field(description="Its place among the completed long runs.")
    change: float | None = Field(description="long_median / short_median - 1.")
    drift: dict[str, Any] | None = Field(description="Throughput over the last tenth of the long run against its first "
                                         "tenth (the memory-recorded step left out): steps per tenth, first, last, "
                                         "change with its 95% Welch interval (low, high) and drifted (the interval "
                                         "excludes no change).")
    simulated: bool = Field(description="True when the long run comes from the simulate backend.")


class ConfirmOut(ResponseModel):
    sweep_id: int = Field(description="The sweep.")
    round: int = Field(description="Confirm round (0 = the first asked of this sweep); the latest is reported.")
    top_k: int = Field(description="Leading layouts asked for.")
    steps: int = Field(description="Measured steps of each long run.")
    source: str = Field(description="'spec' (search.confirm) or 'request' (meshtune confirm, the API, the dashboard).")
    requested_by: str | None = Field(description="Who asked (a token's name), for a request.")
    requested_at: str | None = Field(description="When it was asked (UTC, ISO 8601).")
    done: bool = Field(description="Every long run has its result.")
    rows: list[ConfirmRowOut] = Field(description="The confirmed layouts in short-run order.")
    compared: int = Field(description="Layouts whose long run completed (the correlation's sample).")
    spearman: float | None = Field(description="Spearman's rank correlation of the short-run and long-run medians.")
    spearman_low: float | None = Field(description="Its 95% bootstrap interval (both runs' steps resampled), low end.")
    spearman_high: float | None = Field(description="High end.")
    winner_kept: bool | None = Field(description="The short-run winner has the best long-run median.")
    short_winner: str | None = Field(description="The short-run winner's layout key.")
    long_winner: str | None = Field(description="The layout key with the best long-run median.")
    p_best: float | None = Field(description="Share of bootstrap resamples in which the short-run winner is the long-run best.")
    drifted: list[str] = Field(description="Layout keys whose throughput drifted during the long run.")
    verdict: str = Field(description="The report in one line.")
    simulated: bool = Field(description="True when any long run comes from the simulate backend.")
