"""After a fire's sweeps end: compare each layout tonight with the schedule's history, write alerts.

``check_fire`` runs in one transaction that first moves the fire out of "running" (a replica that
loses that race writes nothing) and writes the alerts before any webhook is tried, so a failing
webhook can delay an alert but never lose it. History is kept grouped by previous night
(``history_by_fire``); the statistics are ``tuner._regression``.

The design: docs/api.md#checking-a-fire.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from sqlalchemy.orm import Session

from api import store
from api.schedules import _store
from api.schedules.models import Schedule, ScheduleFire
from api.store import Trial
from tuner import LayoutComparison, RegressionPolicy, compare_night, fingerprint_diff


def policy_of(schedule: Schedule) -> RegressionPolicy:
    return RegressionPolicy(**(schedule.policy or {}))


def night_env(trials: list[Trial]) -> dict[str, Any] | None:
    """The environment most of tonight's measurements ran in (its fingerprint decides ties)."""
    envs = {t.env_fingerprint: t.env for t in trials if t.env}
    if not envs:
        return None
    common = Counter(t.env_fingerprint for t in trials if t.env).most_common()
    best = max(n for _, n in common)
    return envs[min(fp for fp, n in common if n == best)]


def _by_layout(trials: list[Trial]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = defaultdict(list)
    for t in trials:
        out[t.layout_key].append(float(t.tokens_per_s))
    return dict(out)


def history_by_fire(previous: list[ScheduleFire], history: list[Trial]) -> dict[str, list[list[float]]]:
    """Per layout: one list of tokens/s per previous fire that measured it (``previous`` order,
    newest first), the history shape ``tuner._regression.compare_night`` tests night by night."""
    fire_of = {sweep_id: i for i, f in enumerate(previous) for sweep_id in (f.sweep_ids or [])}
    nights: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for t in history:
        if t.sweep_id in fire_of:
            nights[t.layout_key][fire_of[t.sweep_id]].append(float(t.tokens_per_s))
    return {key: [by_fire[i] for i in sorted(by_fire)] for key, by_fire in nights.items()}


def _env_changes_by_layout(
    tonight: list[Trial], history: list[Trial], previous: list[ScheduleFire]
) -> dict[str, dict[str, Any]]:
    """Per layout: what changed in the fingerprint since the newest earlier run that measured it.
    Compared per layout because some keys (world size, hosts) differ between layouts by nature."""
    out: dict[str, dict[str, Any]] = {}
    tonight_by: dict[str, list[Trial]] = defaultdict(list)
    for t in tonight:
        tonight_by[t.layout_key].append(t)
    for fire in previous:  # newest first
        ids = set(fire.sweep_ids or [])
        then_by: dict[str, list[Trial]] = defaultdict(list)
        for t in history:
            if t.sweep_id in ids:
                then_by[t.layout_key].append(t)
        for key, ts in then_by.items():
            if key in tonight_by and key not in out:
                before, after = night_env(ts), night_env(tonight_by[key])
                out[key] = fingerprint_diff(before, after) if (before and after) else {}
    return out


def _describe_env(changes: dict[str, Any]) -> str:
    if not changes:
        return "environment fingerprint unchanged"
    parts = [f"{k}: {v['before']!r} -> {v['after']!r}" for k, v in list(changes.items())[:6]]
    more = f" (+{len(changes) - 6} more)" if len(changes) > 6 else ""
    return "environment changed: " + "; ".join(parts) + more


def _basis(c: LayoutComparison) -> str:
    if c.method == "nightly-means":
        return f"{c.history_nights} nights, tested on nightly means"
    nights = "" if c.history_nights is None else f"{c.history_nights} night, "
    return f"{nights}tested on pooled repeats"


def alert_message(schedule: Schedule, c: LayoutComparison, env_changes: dict[str, Any]) -> str:
    word = "slower" if c.verdict == "regression" else "faster"
    return (
        f"[{schedule.name}] layout {c.layout} is {abs(c.change):.1%} {word}: tokens/s ratio {c.ratio:.3f} "
        f"(interval {c.ratio_low:.3f}-{c.ratio_high:.3f} at {c.confidence:.2%} confidence, p={c.p_value:.2g}); "
        f"median {c.tonight_median:.4g} tonight (n={c.tonight_n}) vs {c.history_median:.4g} before "
        f"(n={c.history_n}, {_basis(c)}); {_describe_env(env_changes)}"
    )


def check_fire(session: Session, *, fire: ScheduleFire, schedule: Schedule) -> bool | None:
    """Finish ``fire`` if all its sweeps have ended. Returns None when they have not, else whether
    this call finished it (False: another replica did). The caller commits."""
    sweeps = [store.get_sweep(session, sweep_id=i) for i in fire.sweep_ids or []]
    if any(s is not None and s.status not in store.FINISHED_SWEEP_STATUSES for s in sweeps):
        return None
    problems = [
        f"sweep {sid} was deleted" if s is None else f"sweep {s.id} {s.status}" + (f": {s.error}" if s.error else "")
        for sid, s in zip(fire.sweep_ids or [], sweeps, strict=True)
        if s is None or s.status != "completed"
    ]
    tonight = _store.fire_measurements(session, sweep_ids=list(fire.sweep_ids or []))
    deliver = bool(schedule.webhook_url)
    if not tonight:
        reason = "; ".join(problems) or "no layout was measured successfully"
        if not _store.finish_fire(session, fire_id=fire.id, status="failed", error=reason, comparisons=[]):
            return False
        _store.insert_alert(
            session, fire_id=fire.id, schedule_id=schedule.id, kind="failure", layout_key=None,
            message=f"[{schedule.name}] run at {fire.fire_time.isoformat()} measured nothing: {reason}",
            detail={"error": reason, "sweep_ids": list(fire.sweep_ids or [])}, deliver=deliver,
        )
        return True

    policy = policy_of(schedule)
    simulated = Counter(bool(t.simulated) for t in tonight).most_common(1)[0][0]
    tonight = [t for t in tonight if bool(t.simulated) == simulated]
    previous, _ = _store.list_fires(
        session, schedule_id=schedule.id, status="completed", before=fire.fire_time, limit=policy.history_nights
    )
    history_ids = [i for f in previous for i in (f.sweep_ids or [])]
    history = [t for t in _store.fire_measurements(session, sweep_ids=history_ids) if bool(t.simulated) == simulated]
    comparisons = compare_night(_by_layout(tonight), history_by_fire(previous, history), policy=policy)

    env = night_env(tonight)
    changes_by_layout = _env_changes_by_layout(tonight, history, previous)
    env_changes: dict[str, Any] = {}
    for changes in changes_by_layout.values():
        for key, change in changes.items():
            env_changes.setdefault(key, change)
    if not _store.finish_fire(
        session, fire_id=fire.id, status="completed", env=env, env_changes=env_changes,
        comparisons=[c.to_dict() for c in comparisons], error="; ".join(problems) or None,
    ):
        return False
    for c in comparisons:
        if not c.flagged:
            continue
        _store.insert_alert(
            session, fire_id=fire.id, schedule_id=schedule.id, kind=c.verdict, layout_key=c.layout,
            message=alert_message(schedule, c, changes_by_layout.get(c.layout, {})),
            detail={**c.to_dict(), "env_changes": changes_by_layout.get(c.layout, {}), "simulated": simulated,
                    "history_fire_ids": [f.id for f in previous]},
            deliver=deliver, ratio=c.ratio, ratio_low=c.ratio_low, ratio_high=c.ratio_high, p_value=c.p_value,
        )
    if problems:
        _store.insert_alert(
            session, fire_id=fire.id, schedule_id=schedule.id, kind="failure", layout_key=None,
            message=f"[{schedule.name}] run at {fire.fire_time.isoformat()} partly failed: {'; '.join(problems)}",
            detail={"error": "; ".join(problems)}, deliver=deliver,
        )
    return True
