"""Confirm runs: asking for one on a completed sweep, and the report of short runs against long ones.
What the routes, the dashboard and the CLI call (keyword-only; unknown ids NotFoundError, state
conflicts ConflictError, bad values SpecError: one line naming the field and the value).

``request_confirm`` validates everything before writing anything, then reopens the sweep for one
round in a single conditional UPDATE (api/store/_confirm.py): the engine runs it (api/engine/_confirm.py).
``confirm_report`` reads the round's long runs and the ranking they confirm (tuner/_confirm.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy.orm import Session

from api import format as fmt
from api import store
from api._lru import LRU
from api.auth import Principal, require_owner
from api.engine._confirm import confirm_request, default_steps
from api.store import Sweep
from api.sweeps.service import _acting_owner  # the owner rule of a sweep's actions, one place
from tuner import ConflictError, NotFoundError, SpecError, compare, drift

MAX_STEPS = 10_000  # trial.measure_steps' bound
API_NAMES = {"top_k": "top_k", "steps": "steps"}  # how a bad value's field is named (the CLI: --top, --steps)


def _sweep(session: Session, sweep_id: int) -> Sweep:
    sweep = store.get_sweep(session, sweep_id=sweep_id)
    if sweep is None:
        raise NotFoundError(f"sweep {sweep_id} does not exist")
    return sweep


def _count(name: str, value: Any, *, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{name}={value!r} must be a whole number")
    if value < 1:
        raise SpecError(f"{name}={value} must be at least 1")
    if high is not None and value > high:
        raise SpecError(f"{name}={value} is more than {high:,}")
    return value


def check_request(session: Session, *, sweep_id: int, top_k: Any, steps: Any = None,
                  names: dict[str, str] = API_NAMES) -> tuple[Sweep, int, int]:
    """The sweep, K and N of a valid request, or the one-line refusal (nothing is written here)."""
    sweep = _sweep(session, sweep_id)
    top_k = _count(names["top_k"], top_k, high=1000)
    measure = int(((sweep.spec or {}).get("trial") or {}).get("measure_steps") or 3)
    steps = default_steps(measure) if steps is None else _count(names["steps"], steps, high=MAX_STEPS)
    if sweep.status in ("queued", "running"):
        raise ConflictError(f"sweep {sweep_id} is still {sweep.status}: a confirm run starts once it has completed")
    if sweep.status != "completed":
        raise ConflictError(f"sweep {sweep_id} is {sweep.status}: only a completed sweep can be confirmed")
    store.ensure_ranked(session, sweep_id=sweep_id)
    state = store.ranking_state(session, sweep_id=sweep_id)
    ranked = int(((state.summary or {}).get("tokens_per_s_per_device") or {}).get("total", 0)) if state else 0
    if ranked == 0:
        raise ConflictError(f"sweep {sweep_id} has no completed trial to confirm")
    if top_k > ranked:
        raise SpecError(f"{names['top_k']}={top_k} is more than the {ranked} ranked layouts of sweep {sweep_id}")
    return sweep, top_k, steps


def request_confirm(session: Session, *, sweep_id: int, top_k: Any, steps: Any = None, actor: Principal | None = None,
                    runner_id: str | None = None, names: dict[str, str] = API_NAMES,
                    requested_by: str | None = None) -> Sweep:
    """Reopen a completed sweep for a confirm round of its top ``top_k`` layouts, ``steps`` measured steps
    each (default 10x the sweep's). ``actor``: its owner or an admin (None: an in-process caller, the
    CLI, which names the user in ``requested_by``); ``runner_id``: the sweep runs under that runner at
    once (``meshtune confirm``), else it is queued for a coordinator. Returns the sweep as stored."""
    sweep = _sweep(session, sweep_id)

    require_owner(actor, owner=_acting_owner(session, sweep.owner), what=f"sweep {sweep_id}")
    sweep, top_k, steps = check_request(session, sweep_id=sweep_id, top_k=top_k, steps=steps, names=names)
    confirm = confirm_request(session, sweep_id=sweep_id, top_k=top_k, steps=steps, source="request",
                              previous=sweep.confirm, requested_by=actor.name if actor else requested_by)
    assert confirm is not None  # check_request saw ranked layouts
    if not store.reopen_for_confirm(session, sweep_id=sweep_id, confirm=confirm, runner_id=runner_id):
        session.rollback()
        now = _sweep(session, sweep_id)
        raise ConflictError(f"sweep {sweep_id} is {now.status}: only a completed sweep can be confirmed")
    session.commit()
    return _sweep(session, sweep_id)


# --- the report ----------------------------------------------------------------------------------


@dataclass
class ConfirmRow:
    layout_key: str
    layout: dict[str, Any]
    short_rank: int
    short_median: float  # the ranking's median tokens/s per device (short runs)
    short_low: float | None
    short_high: float | None
    short_n: int
    status: str  # pending, running, completed, oom, timeout, crash, nan
    trial_id: int | None = None
    trial_number: int | None = None
    cause: str | None = None
    steps: int = 0  # measured steps of the long run
    long_median: float | None = None  # median tokens/s per device over the long run's steps
    long_low: float | None = None  # 95% bootstrap interval of that median
    long_high: float | None = None
    long_rank: int | None = None
    change: float | None = None  # long_median / short_median - 1
    drift: dict[str, Any] | None = None  # tuner._confirm.Drift: last tenth against the first
    simulated: bool = False


@dataclass
class ConfirmReport:
    sweep_id: int
    round: int
    top_k: int
    steps: int
    source: str  # "spec" (search.confirm) or "request"
    requested_by: str | None
    requested_at: str | None
    done: bool  # every long run has its result
    rows: list[ConfirmRow] = field(default_factory=list)
    compared: int = 0  # layouts whose long run completed
    spearman: float | None = None
    spearman_low: float | None = None
    spearman_high: float | None = None
    winner_kept: bool | None = None
    short_winner: str | None = None
    long_winner: str | None = None
    p_best: float | None = None  # share of bootstrap resamples in which the short-run #1 is the long-run best
    drifted: list[str] = field(default_factory=list)  # layout keys whose throughput drifted
    verdict: str = ""
    simulated: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _per_step(tokens_per_s_per_device: float | None, step_time_s: float | None, steps: list[Any] | None) -> list[float]:
    """Each measured step's tokens/s per device (the trial's median figure scaled by its step times)."""
    if not tokens_per_s_per_device or not step_time_s:
        return []
    per_step_tokens = tokens_per_s_per_device * step_time_s
    return [per_step_tokens / s for s in (steps or []) if s]


_REPORTS: LRU[ConfirmReport] = LRU(max_entries=64)


def confirm_report(session: Session, *, sweep_id: int) -> ConfirmReport | None:
    """The latest confirm round of the sweep against its ranking; None when none was asked."""
    sweep = _sweep(session, sweep_id)
    confirm = sweep.confirm
    if not confirm:
        return None
    longs = store.confirm_trials(session, sweep_id=sweep_id, round=int(confirm["round"]))
    key = (str(session.get_bind().url), sweep_id, repr(confirm), tuple((t.id, t.status) for t in longs))
    return _REPORTS.get_or_build(key, lambda: _build(session, sweep, confirm, longs))


def _build(session: Session, sweep: Sweep, confirm: dict[str, Any], longs: list[Any]) -> ConfirmReport:
    keys: list[str] = list(confirm["keys"])
    ranked = {r.layout_key: r for r in store.ranked_rows(session, sweep_id=sweep.id, metric="tokens_per_s_per_device",
                                                         limit=max(len(keys), 1))}
    short_steps: dict[str, list[float]] = {k: [] for k in keys}
    for t in store.short_run_trials(session, sweep_id=sweep.id, keys=keys):
        short_steps[t.layout_key] += _per_step(t.tokens_per_s_per_device, t.step_time_s, t.step_times_s)
    by_key = {t.layout_key: t for t in longs}  # one live row per layout and round
    rows: list[ConfirmRow] = []
    long_steps: dict[str, list[float]] = {}
    for i, (k, layout) in enumerate(zip(keys, confirm["layouts"], strict=True)):
        r = ranked.get(k)
        row = ConfirmRow(layout_key=k, layout=layout, short_rank=r.rank if r else i + 1,
                         short_median=r.median if r else float("nan"), short_low=r.low if r else None,
                         short_high=r.high if r else None, short_n=r.n if r else 0, status="pending")
        t = by_key.get(k)
        if t is not None:
            row.status, row.trial_id, row.trial_number, row.cause = t.status, t.id, t.number, t.cause
            row.simulated = bool(t.simulated)
            if t.status == "completed":
                steps = _per_step(t.tokens_per_s_per_device, t.step_time_s, t.step_times_s)
                row.steps = len(steps)
                if steps:
                    long_steps[k] = steps
                    row.drift = _drift(session, t, steps)
        rows.append(row)
    report = ConfirmReport(
        sweep_id=sweep.id, round=int(confirm["round"]), top_k=int(confirm["top_k"]), steps=int(confirm["steps"]),
        source=str(confirm.get("source") or "request"), requested_by=confirm.get("requested_by"),
        requested_at=confirm.get("requested_at"), done=all(r.status not in ("pending", "running") for r in rows),
        rows=rows, short_winner=keys[0] if keys else None, simulated=any(r.simulated for r in rows),
    )
    done = [r for r in rows if r.layout_key in long_steps]
    if done:
        cmp = compare([r.short_median for r in done], [short_steps[r.layout_key] for r in done],
                      [long_steps[r.layout_key] for r in done], seed=sweep.id)
        order = sorted(range(len(done)), key=lambda i: -cmp.long_median[i])
        for i, r in enumerate(done):
            r.long_median, r.long_low, r.long_high = cmp.long_median[i], cmp.long_low[i], cmp.long_high[i]
            r.long_rank = order.index(i) + 1
            r.change = r.long_median / r.short_median - 1 if r.short_median else None
        report.compared, report.spearman = len(done), cmp.rho
        report.spearman_low, report.spearman_high = cmp.rho_low, cmp.rho_high
        report.long_winner = done[cmp.long_best].layout_key
        first_done = done[0].layout_key == report.short_winner
        report.winner_kept = first_done and cmp.winner_kept
        report.p_best = cmp.p_best if first_done else 0.0
    report.drifted = [r.layout_key for r in rows if r.drift and r.drift.get("drifted")]
    report.verdict = verdict(report)
    return report


def _drift(session: Session, trial: Any, steps: list[float]) -> dict[str, Any] | None:
    """Drift over the long run's steps, without the step whose memory was recorded (its sampler is
    not the layout's: workers/_memory_timeline.py records the last measured step)."""
    timeline = store.trial_timeline(session, trial_id=trial.id)
    warmup = len(trial.losses or []) - len(trial.step_times_s or [])
    recorded = {int(tl["step"]) - warmup for tl in timeline or [] if "step" in tl}
    kept = [v for i, v in enumerate(steps) if i not in recorded]
    d = drift(kept)
    return None if d is None else asdict(d)


def verdict(report: ConfirmReport) -> str:
    """One line: the winner kept or changed, the rank correlation and the drifts, with their intervals."""
    label = {r.layout_key: fmt.layout_text(r.layout) for r in report.rows}
    n_long = len(report.rows)
    if not report.done:
        finished = sum(r.status not in ("pending", "running") for r in report.rows)
        head = f"confirm round {report.round} running: {finished} of {n_long} long runs ({report.steps} steps) done"
        if not report.compared:
            return head
        head += "; so far "
    else:
        head = ""
    first = report.rows[0] if report.rows else None
    if first is None:
        return head + "nothing to confirm"
    if first.status not in ("completed", "pending", "running"):
        text = f"winner changed: the short-run winner {label[first.layout_key]} failed its long run ({first.status})"
    elif report.winner_kept:
        clear = (report.p_best or 0) >= 0.95 or report.compared == 1
        text = (f"winner kept: {label[first.layout_key]} still has the best median over {report.steps} steps "
                f"({'the best' if clear else 'but not separated: the best only'} in {report.p_best:.0%} of resamples)")
    elif report.long_winner is not None:
        text = (f"winner changed: {label[report.long_winner]} beats the short-run winner {label[first.layout_key]} "
                f"over {report.steps} steps ({label[first.layout_key]} is the best in only {report.p_best or 0:.0%} "
                "of resamples)")
    else:
        text = "no long run completed"
    if report.spearman is not None:
        text += (f"; Spearman {report.spearman:+.2f} [{report.spearman_low:+.2f}, {report.spearman_high:+.2f}] "
                 f"over {report.compared} layouts")
    elif report.compared:
        text += f"; Spearman undefined over {report.compared} layout{'s' if report.compared != 1 else ''}"
    drifts = [r for r in report.rows if r.layout_key in report.drifted]
    if drifts:
        text += "; drifted: " + ", ".join(
            f"{label[r.layout_key]} {fmt.signed_pct(r.drift['change'])} "
            f"[{fmt.signed_pct(r.drift['low'])}, {fmt.signed_pct(r.drift['high'])}]" for r in drifts)
    elif report.compared:
        text += "; no drift between the first and last tenth"
    return head + text
