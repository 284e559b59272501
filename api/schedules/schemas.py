"""Request and response models for schedules, alerts and trends (HTTP API, CLI --json, dashboard).

Every field is described (it is the OpenAPI document); validators raise ValueError naming the field
and the value, which the API turns into a 422 and the CLI into exit 2.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from api.redact import mask_url
from api.schedules._cron import check_cron, check_timezone
from api.schedules._urls import RefusedTarget, check_target
from api.spec import RequestModel, SweepSpec
from api.store import SWEEP_PRIORITIES
from tuner import RegressionPolicy

MAX_GRACE_S = 7 * 86400.0
# The queue priority of the sweeps a schedule fires: the sweeps' own (POST /api/sweeps?priority=).
Priority = Literal[SWEEP_PRIORITIES]  # type: ignore[valid-type]
PRIORITY_HELP = ("Queue priority of the sweeps it fires: high, normal or low, after fair share between owners "
                 "(a schedule's sweeps are owned by 'schedule:<id>'), before age. Default normal, as a "
                 "submitted sweep's.")


def check_webhook_url(url: str | None, *, field_name: str = "webhook_url") -> str | None:
    """``url`` if it is an absolute http(s) URL with a host; None/"" means no webhook."""
    if url is None or (isinstance(url, str) and not url.strip()):
        return None
    # Every message shows the URL masked (mask_url): a webhook URL carries its secret in its path,
    # query or user-info, and a rejected value is echoed to the client and into logs.
    if not isinstance(url, str) or len(url) > 2000:
        shown = mask_url(url) if isinstance(url, str) else type(url).__name__
        raise ValueError(f"{field_name} must be an http(s) URL of at most 2000 characters, got {shown!r}")
    parts = urlsplit(url.strip())
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise ValueError(f"{field_name}={mask_url(url)!r} has an invalid port") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{field_name}={mask_url(url)!r} is not an http:// or https:// URL with a host")
    try:
        check_target(url.strip())
    except RefusedTarget as exc:  # the value is masked: it may hold a secret
        raise ValueError(f"{field_name}={mask_url(url)!r} is refused: {exc}") from None
    return url.strip()


class RegressionIn(RequestModel):
    alpha: float = Field(0.05, gt=0, lt=1, description="False-alarm rate per night across all layouts (Bonferroni).")
    min_effect: float = Field(0.05, ge=0, lt=1, description="Smallest relative change of tokens/s that is alerted (0.05 = 5%).")
    min_repeats: int = Field(2, ge=2, le=50, description="Measurements needed tonight and in history before a layout is judged.")
    history_nights: int = Field(7, ge=1, le=1000, description="Previous completed runs of the schedule that form the history.")
    min_history_nights: int = Field(
        2, ge=1, le=1000, strict=True,
        description="Previous runs that measured a layout before it is judged. Two or more: tonight is tested "
                    "against the past nightly means (night-to-night variation counts as noise); 1: a single "
                    "past night is compared repeat against repeat, which cannot tell a slow night from a slowdown.",
    )

    @model_validator(mode="after")
    def _check(self) -> RegressionIn:
        if self.min_history_nights > self.history_nights:
            raise ValueError(
                f"regression.min_history_nights={self.min_history_nights} exceeds regression.history_nights="
                f"{self.history_nights}: no layout could ever be judged"
            )
        RegressionPolicy(**self.model_dump())  # the tuner's own validation (SpecError naming the field)
        return self


class RemeasureIn(RequestModel):
    sweep_id: int = Field(ge=1, le=2**31 - 1, description="The sweep whose top-k layouts (by its ranking) are re-measured.")
    top_k: int = Field(3, ge=1, le=50, description="How many of its best layouts to re-measure.")
    repeats: int = Field(3, ge=2, le=50, description="Measurements of each layout per run (>= 2 to see noise).")


class ScheduleIn(RequestModel):
    """A scheduled sweep: when (cron + time zone), what (a sweep template, or a re-measurement of the
    top-k layouts of an earlier sweep), and whom to tell (a webhook). Strict types (RequestModel)."""

    model_config = ConfigDict(
        json_schema_extra={"examples": [{
            "name": "nightly-tiny", "cron": "0 2 * * *", "timezone": "Europe/Berlin",
            "remeasure": {"sweep_id": 1, "top_k": 3, "repeats": 3},
            "webhook_url": "https://hooks.example.com/meshtune",
        }]},
    )

    name: str = Field(min_length=1, max_length=200, description="A label for the schedule.")
    cron: str = Field(description="Cron expression (5 fields; a 6th = seconds), e.g. '0 2 * * *' = 02:00 daily.")
    timezone: str = Field("UTC", max_length=64, description="IANA time zone the cron expression is evaluated in, e.g. 'Europe/Berlin'.")
    template: SweepSpec | None = Field(None, description="A sweep spec to run at every fire (exclusive with remeasure).")
    remeasure: RemeasureIn | None = Field(None, description="Re-measure the top-k layouts of a sweep (exclusive with template).")
    enabled: bool = Field(True, description="Disabled schedules do not fire (run-now still works).")
    webhook_url: str | None = Field(None, description="http(s) URL that receives alerts as a JSON POST.")
    misfire_grace_s: float = Field(
        7200.0, gt=0, le=MAX_GRACE_S,
        description="A fire missed while no coordinator ran still runs (once) if at most this many seconds late.",
    )
    regression: RegressionIn = Field(default_factory=RegressionIn, description="When a change is alerted.")
    priority: Priority = Field("normal", description=PRIORITY_HELP)

    @field_validator("cron")
    @classmethod
    def _cron(cls, v: str) -> str:
        return check_cron(v, field_name="cron")

    @field_validator("timezone")
    @classmethod
    def _tz(cls, v: str) -> str:
        check_timezone(v, field_name="timezone")
        return v.strip()

    @field_validator("webhook_url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        return check_webhook_url(v)

    @model_validator(mode="after")
    def _what(self) -> ScheduleIn:
        if (self.template is None) == (self.remeasure is None):
            raise ValueError("template/remeasure: give exactly one of template (a sweep spec) or remeasure")
        need = self.regression.min_repeats
        if self.template is not None:
            s = self.template.search
            if s.repeats < need or s.remeasure_top_k < 1:
                raise ValueError(
                    f"template.search.repeats={s.repeats} (with remeasure_top_k={s.remeasure_top_k}): a scheduled "
                    f"sweep must re-measure at least one layout >= regression.min_repeats={need} times"
                )
        elif self.remeasure is not None and self.remeasure.repeats < need:
            raise ValueError(f"remeasure.repeats={self.remeasure.repeats} is below regression.min_repeats={need}")
        return self


class ScheduleUpdate(RequestModel):
    """Fields to change (absent = unchanged). What a schedule runs is fixed: its history is about it."""

    name: str | None = Field(None, min_length=1, max_length=200, description="New label.")
    cron: str | None = Field(None, description="New cron expression.")
    timezone: str | None = Field(None, description="New IANA time zone.")
    enabled: bool | None = Field(None, description="Enable or disable firing.")
    webhook_url: str | None = Field(None, description="New webhook URL ('' removes it).")
    misfire_grace_s: float | None = Field(None, gt=0, le=MAX_GRACE_S, description="New misfire grace window (s).")
    regression: RegressionIn | None = Field(None, description="New alerting policy.")
    priority: Priority | None = Field(None, description="New queue priority of the sweeps it fires.")

    @field_validator("cron")
    @classmethod
    def _cron(cls, v: str | None) -> str | None:
        return None if v is None else check_cron(v, field_name="cron")

    @field_validator("timezone")
    @classmethod
    def _tz(cls, v: str | None) -> str | None:
        if v is None:
            return None
        check_timezone(v, field_name="timezone")
        return v.strip()

    @field_validator("webhook_url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        return v if v == "" else check_webhook_url(v)


class _Out(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class ScheduleOut(_Out):
    id: int = Field(description="Schedule id.")
    name: str = Field(description="Label.")
    owner: str | None = Field(description="Name of the token that created it.")
    cron: str = Field(description="Cron expression.")
    timezone: str = Field(description="IANA time zone of the cron expression.")
    kind: str = Field(description="'template' (runs a sweep spec) or 'remeasure' (top-k layouts of a sweep).")
    template: dict[str, Any] | None = Field(description="The sweep spec run at each fire (kind 'template').")
    source_sweep_id: int | None = Field(description="The sweep whose top layouts are re-measured (kind 'remeasure').")
    top_k: int | None = Field(description="Layouts re-measured (kind 'remeasure').")
    repeats: int = Field(description="Measurements per layout per run.")
    enabled: bool = Field(description="Whether cron fires happen.")
    webhook_url: str | None = Field(description="Where alerts are POSTed, masked as scheme://host/… (the full "
                                    "URL is a secret and is never returned).")
    misfire_grace_s: float = Field(description="Misfire grace window in seconds.")
    policy: dict[str, Any] = Field(description="Regression policy (alpha, min_effect, min_repeats, history_nights, "
                                              "min_history_nights).")
    priority: str = Field("normal", description="Queue priority of the sweeps it fires (high, normal, low).")
    next_fire_at: datetime | None = Field(None, description="Next cron fire (UTC), when enabled.")
    created_at: datetime = Field(description="Creation time (UTC).")
    updated_at: datetime = Field(description="Last change (UTC).")


    @field_validator("webhook_url", mode="before")
    @classmethod
    def _mask(cls, v: str | None) -> str | None:
        return mask_url(v)


class FireOut(_Out):
    id: int = Field(description="Fire id.")
    schedule_id: int = Field(description="Its schedule.")
    fire_time: datetime = Field(description="The cron time (UTC) it stands for, or the time of a manual run.")
    trigger: str = Field(description="'cron' or 'manual' (run-now).")
    status: str = Field(description="running, completed, failed, missed or coalesced.")
    claimed_by: str | None = Field(description="The coordinator replica that claimed it.")
    sweep_ids: list[int] = Field(description="Sweeps it created.")
    error: str | None = Field(description="Why it failed, or a note for missed/coalesced fires.")
    env: dict[str, Any] | None = Field(description="Environment fingerprint of its measurements.")
    env_changes: dict[str, Any] | None = Field(description="Fingerprint keys that changed since the previous run.")
    comparisons: list[dict[str, Any]] | None = Field(description="Every layout's verdict against history.")
    created_at: datetime = Field(description="When it was recorded (UTC).")
    finished_at: datetime | None = Field(description="When it ended (UTC).")


class AlertOut(_Out):
    id: int = Field(description="Alert id.")
    schedule_id: int = Field(description="Its schedule.")
    fire_id: int = Field(description="The run that raised it.")
    kind: str = Field(description="regression, improvement or failure.")
    layout_key: str | None = Field(description="The layout (None for a failed run).")
    ratio: float | None = Field(description="tokens/s tonight / history (geometric means); 0.8 = 20% slower.")
    ratio_low: float | None = Field(description="Lower end of the ratio's confidence interval.")
    ratio_high: float | None = Field(description="Upper end of the ratio's confidence interval.")
    p_value: float | None = Field(description="Two-sided p-value of the t-test on log tokens/s.")
    message: str = Field(description="One line a person can act on: layout, change, interval, environment.")
    detail: dict[str, Any] = Field(description="The comparison and the environment changes.")
    delivery_status: str = Field(description="pending, delivered, failed (gave up) or no_target (no webhook).")
    attempts: int = Field(description="Webhook attempts so far.")
    last_error: str | None = Field(description="The last failed attempt's error.")
    delivered_at: datetime | None = Field(description="When the webhook accepted it (UTC).")
    created_at: datetime = Field(description="When it was raised (UTC).")


class SchedulePage(BaseModel):
    items: list[ScheduleOut] = Field(description="This page.")
    total: int = Field(description="Matching schedules in all.")


class FirePage(BaseModel):
    items: list[FireOut] = Field(description="This page, newest first.")
    total: int = Field(description="Matching fires in all.")


class AlertPage(BaseModel):
    items: list[AlertOut] = Field(description="This page, newest first.")
    total: int = Field(description="Matching alerts in all.")


class TrendPoint(BaseModel):
    fire_id: int = Field(description="The run.")
    fire_time: datetime = Field(description="Its fire time (UTC).")
    layout_key: str = Field(description="The layout.")
    best_tokens_per_s: float = Field(description="Best tokens/s of the layout in that run.")
    median_tokens_per_s: float = Field(description="Median tokens/s of its repeats in that run.")
    n: int = Field(description="Measurements of the layout in that run.")
    simulated: bool = Field(description="Measured by the simulate backend (a prediction, not a measurement).")
    verdict: str | None = Field(description="regression/improvement/unchanged/insufficient against history.")
    alert_id: int | None = Field(description="The alert raised for it, if any.")


class TrendsOut(BaseModel):
    schedule_id: int = Field(description="The schedule.")
    layouts: list[str] = Field(description="Layouts present, ordered by their latest best tokens/s.")
    points: list[TrendPoint] = Field(description="One point per (run, layout), oldest run first.")
