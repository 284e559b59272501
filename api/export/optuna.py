"""A sweep's trials as an Optuna study in a standard Optuna storage, so that Optuna's own tools
(``optuna-dashboard``, ``optuna.load_study``, its plots and importance) read meshtune's data.

The storage is Optuna's ``RDBStorage``, never meshtune's database (default
``$MESHTUNE_HOME/optuna.db``). Export is incremental, on demand (``meshtune optuna-export SWEEP``) or
kept in sync by an ``OptunaMirror`` beside the API (``meshtune serve --optuna-storage URL``), outside
the engine's result transaction.

The storage, the sync and the trial mapping: docs/api.md#optuna-export.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from api import store
from api.sweeps import service
from tuner import CHECKPOINTING, SCHEDULES, Layout

log = logging.getLogger("meshtune.optuna")
OPTUNA_FILE = "optuna.db"
TRIAL_ID_ATTR = "meshtune_trial_id"
EXPORTED_STATUSES = ("completed", "pruned", "oom", "timeout", "crash", "nan")
_CATEGORICAL = {"ac": tuple(CHECKPOINTING), "schedule": tuple(SCHEDULES), "sp": (False, True)}


@dataclass(frozen=True)
class Export:
    storage: str  # the Optuna storage URL (password hidden)
    study_name: str
    added: int  # trials added by this export
    total: int  # trials in the study now

    def __post_init__(self) -> None:
        if self.added < 0 or self.total < self.added:
            raise ValueError(f"added={self.added} and total={self.total} are inconsistent")


def default_storage(store_url: str, home: Path) -> str:
    """The Optuna storage next to meshtune's store: a SQLite store's sibling ``<name>-optuna.db``,
    else ``$MESHTUNE_HOME/optuna.db`` (a PostgreSQL store's Optuna data never shares its schema)."""
    url = make_url(store_url)
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        db = Path(url.database)
        return f"sqlite:///{db.with_name(db.stem + '-' + OPTUNA_FILE)}"
    return f"sqlite:///{Path(home) / OPTUNA_FILE}"


def study_name(sweep: Any) -> str:
    return f"{sweep.id}-{sweep.name}"


def _distributions(layout: dict[str, Any], devices: int) -> dict[str, Any]:
    from optuna.distributions import CategoricalDistribution, IntDistribution

    out: dict[str, Any] = {}
    for name in Layout.__dataclass_fields__:
        value = layout.get(name, getattr(Layout(), name))
        if name in _CATEGORICAL:
            out[name] = CategoricalDistribution(_CATEGORICAL[name])
        else:  # a count of devices or micro-batches, or the ZeRO stage: ranges may differ between trials
            out[name] = IntDistribution(0 if name == "zero" else 1, max(int(value), 3 if name == "zero" else devices, 1))
    return out


def _frozen(trial: Any, devices: int) -> Any:
    """One stored meshtune trial (ORM row) as an Optuna FrozenTrial (``number`` is set by Optuna)."""
    import optuna
    from optuna.trial import TrialState

    layout = {f.name: trial.layout.get(f.name, f.default) for f in dataclasses.fields(Layout)}
    distributions = _distributions(layout, devices)
    value = trial.tokens_per_s_per_device
    ok = trial.status == "completed" and value is not None and math.isfinite(value)
    attrs = {
        TRIAL_ID_ATTR: trial.id, "number": trial.number, "attempt": trial.attempt, "phase": trial.phase,
        "source": trial.source, "layout_key": trial.layout_key, "status": trial.status,
        "error": None if ok else trial.cause, "infeasible": trial.status in store.INFEASIBLE_TRIAL_STATUSES,
        "tokens_per_s": trial.tokens_per_s, "mfu": trial.mfu, "peak_memory_bytes": trial.peak_memory_bytes,
        "predicted_tokens_per_s_per_device": trial.predicted_tokens_per_s_per_device,
        "simulated": bool(trial.simulated), "device_seconds": trial.device_seconds,
    }
    start = _naive(trial.started_at or trial.created_at)
    return optuna.trial.FrozenTrial(
        number=0, trial_id=0, state=TrialState.COMPLETE if ok else TrialState.FAIL, value=value if ok else None,
        values=None, datetime_start=start, datetime_complete=_naive(trial.finished_at) or start,
        params={k: layout[k] for k in distributions}, distributions=distributions,
        user_attrs={k: v for k, v in attrs.items() if v is not None}, system_attrs={}, intermediate_values={},
    )


def _naive(when: datetime | None) -> datetime | None:
    """Optuna stores naive local times (``datetime.now()``); meshtune's are aware UTC."""
    return None if when is None else when.astimezone().replace(tzinfo=None)


def export_sweep(session: Session, *, sweep_id: int, storage: str) -> Export:
    """Add the sweep's finished trials that the study lacks (the study is created on first export)."""
    import optuna

    sweep = service.get_sweep(session, sweep_id=sweep_id)  # NotFoundError for an unknown id
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        rdb = optuna.storages.RDBStorage(storage)
    except (sa_exc.SQLAlchemyError, ImportError, ValueError) as exc:  # unreachable, unknown kind, no driver
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        raise store.StoreUnavailableError(f"the Optuna storage {store.safe_url(storage)} cannot be used: {reason}") from None
    try:
        name = study_name(sweep)
        study = optuna.create_study(storage=rdb, study_name=name, direction="maximize", load_if_exists=True)
        study.set_user_attr("meshtune_sweep_id", sweep.id)
        for key in ("model", "cluster", "backend"):
            value = (sweep.spec or {}).get(key)
            if value is not None:
                study.set_user_attr(key, value)
        have = {t.user_attrs.get(TRIAL_ID_ATTR) for t in study.get_trials(deepcopy=False)}
        devices = max((t.world_size for t in store.all_trials(session, sweep_id=sweep_id)), default=1)
        new = [
            _frozen(t, devices) for t in store.all_trials(session, sweep_id=sweep_id)
            if t.status in EXPORTED_STATUSES and t.id not in have
        ]
        study.add_trials(new)
        return Export(store.safe_url(storage), name, len(new), len(have) + len(new))
    finally:
        rdb.engine.dispose()


class OptunaMirror(threading.Thread):
    """Keeps the Optuna storage in step with the store: every ``interval_s`` it exports the sweeps
    whose results version moved since its last pass. ``passes`` counts finished passes (tests wait
    on ``passed``, a Condition, rather than sleeping); an error is logged and retried next pass."""

    def __init__(self, sessions: Any, *, storage: str, interval_s: float = 5.0) -> None:
        super().__init__(name="optuna-mirror", daemon=True)
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.sessions, self.storage, self.interval_s = sessions, storage, interval_s
        self.stop_event = threading.Event()
        self.passed = threading.Condition()
        self.passes = 0
        self._seen: dict[int, int] = {}

    def run(self) -> None:
        while True:
            try:
                self.sync_once()
            except Exception:  # the mirror must never take the coordinator down
                log.exception("optuna mirror: pass failed (storage %s); retrying", store.safe_url(self.storage))
            with self.passed:
                self.passes += 1
                self.passed.notify_all()
            if self.stop_event.wait(self.interval_s):
                return

    def sync_once(self) -> int:
        """One pass; returns how many trials it added."""
        added = 0
        with self.sessions() as session:
            for sweep_id, version in sorted(store.results_versions(session).items()):
                if self._seen.get(sweep_id) != version:
                    added += export_sweep(session, sweep_id=sweep_id, storage=self.storage).added
                    self._seen[sweep_id] = version
        return added

    def wait_passes(self, n: int, timeout: float) -> bool:
        with self.passed:
            return self.passed.wait_for(lambda: self.passes >= n, timeout)

    def stop(self) -> None:
        self.stop_event.set()
        self.join(30)
