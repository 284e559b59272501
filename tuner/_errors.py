"""One exception hierarchy for meshtune (Optuna-style: every user error is a ValueError subclass)."""

from __future__ import annotations


class MeshtuneError(Exception):
    """Base of every error meshtune raises on purpose."""


class SpecError(MeshtuneError, ValueError):
    """A model, cluster, training or spec-file value is invalid; the message names field and value."""


class LayoutError(SpecError):
    """A parallel layout is invalid for its model/cluster/training (e.g. ``tp=3 does not divide heads=32``)."""


class UnknownPresetError(SpecError):
    """A preset name that does not exist; the message lists the known ones."""


class BackendError(MeshtuneError):
    """A trial backend cannot be reached or configured (not a failed trial: those are results)."""


class NotFoundError(MeshtuneError, LookupError):
    """A stored object (sweep, trial, schedule) does not exist."""


class ConflictError(MeshtuneError):
    """The request conflicts with the stored state (e.g. cancelling a finished sweep)."""


def require_positive_int(field: str, value: object) -> None:
    """Raise SpecError naming ``field`` unless ``value`` is an int >= 1 (bools are rejected)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{field} must be a positive integer, got {value!r}")
    if value < 1:
        raise SpecError(f"{field} must be a positive integer, got {value}")


def require_positive_number(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise SpecError(f"{field} must be a positive number, got {value!r}")
