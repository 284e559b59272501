"""The budget of a throughput: time, device-hours and money to train a token budget at a sustained
tokens/s (measured or predicted) on a number of devices."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tuner._formulas import cost_per_token, device_hours, time_to_train_s


@dataclass(frozen=True)
class TrainingBudget:
    """Time and money to train ``train_tokens`` at ``tokens_per_s`` (whole job) on ``devices``.
    None where an input is missing (no token budget, no price)."""

    tokens_per_s: float
    devices: int
    train_tokens: float | None
    price_per_device_hour: float | None
    time_to_train_s: float | None
    device_hours: float | None
    cost: float | None
    cost_per_token: float | None

    def to_dict(self) -> dict[str, Any]:
        # Shallow (every field is a scalar): dataclasses.asdict deep-copies, ~25x slower, and the
        # ranking attaches one budget per ranked layout (4,000 on a 10,000-trial sweep).
        return {name: getattr(self, name) for name in _BUDGET_FIELDS}


_BUDGET_FIELDS = tuple(f.name for f in dataclasses.fields(TrainingBudget))


def training_budget(tokens_per_s: float, *, devices: int, train_tokens: float | None,
                    price_per_device_hour: float | None) -> TrainingBudget:
    """``TrainingBudget`` of a sustained whole-job ``tokens_per_s`` (measured or predicted)."""
    ok = tokens_per_s > 0
    seconds = time_to_train_s(train_tokens, tokens_per_s) if ok and train_tokens else None
    hours = device_hours(devices, seconds) if seconds is not None else None
    price = price_per_device_hour
    return TrainingBudget(
        tokens_per_s=tokens_per_s, devices=devices, train_tokens=train_tokens, price_per_device_hour=price,
        time_to_train_s=seconds, device_hours=hours,
        cost=None if hours is None or price is None else hours * price,
        cost_per_token=cost_per_token(price, devices, tokens_per_s) if ok and price is not None else None,
    )
