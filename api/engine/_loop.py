"""One sweep's loop: propose -> prune by the memory model -> run on the backend -> record -> tell.

All database writes and all Optuna calls happen on the loop's thread; worker threads only call
``backend.run`` (so SQLite sees one writer per coordinator and the in-memory study needs no lock).

The loop is split by concept: who owns the sweep and its heartbeat (api/engine/_claim.py), when the
search stops and what is re-measured (api/engine/_budget.py), what each outcome teaches the sampler,
the memory model and the calibration (api/engine/_learning.py); this module proposes, launches and
collects.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from api import store
from api.engine._budget import Budget
from api.engine._claim import Claim, KeepAlive, LostClaim
from api.engine._confirm import CONFIRM, Confirm
from api.engine._learning import Learning
from api.engine._lost import NODE_LOST, REQUEUED, LostNodes, infra_of
from api.engine._model import SweepModel
from api.engine._outage import Outages
from api.engine._probing import Probing
from api.engine._share import Claimant, Grant, Sharing
from api.engine._space import ListProposer, OptunaProposer
from api.engine._surrogate import SurrogateProposer
from api.engine._ticket import Ticket
from api.spec import SweepSpec
from api.store._queue import restart_trial_clock
from tuner import BackendError, Layout
from workers import BackendUnavailable, TrialError, TrialRequest, TrialResult

if TYPE_CHECKING:
    from api.engine._runner import SweepRunner

MAX_THREADS = 32
# Back-off between attempts when the backend is unavailable (BackendUnavailable: Ray not started,
# no room, ...); after the last, the sweep is left resumable (see SweepRunner._run_claimed).
RETRY_DELAYS_S: tuple[float, ...] = (5.0, 20.0, 60.0)
log = logging.getLogger("meshtune.engine")
__all__ = ["SweepLoop"]


class SweepLoop(Claim, Budget, Learning, Sharing, LostNodes, Confirm, Outages, Probing):
    def __init__(self, runner: SweepRunner, sweep_id: int, stop: threading.Event, on_progress: Any) -> None:
        self.r = runner
        self.sweep_id = sweep_id
        self.stop = stop
        self.on_progress = on_progress or (lambda event: None)
        with runner.sessions() as s:
            sweep = store.get_sweep(s, sweep_id=sweep_id)
            self.spec = SweepSpec.model_validate(sweep.spec)
            calibration = sweep.calibration
            self.confirm = sweep.confirm  # the latest confirm round asked (api/engine/_confirm.py)
            self.claimant = Claimant(sweep_id, sweep.owner, sweep.priority or "normal", sweep.created_at)
        self.problem = SweepModel.from_spec(self.spec, calibration=calibration)
        self.search = self.spec.search
        space = self.problem.space
        if self.problem.listed:  # search.layouts: the listed order, no sampler
            self.proposer: Any = ListProposer(space, shuffle_seed=None)
        elif self.search.sampler in ("grid", "random"):
            seed = None if self.search.sampler == "grid" else self.search.seed
            self.proposer = ListProposer(space, shuffle_seed=seed)
        elif self.search.sampler == "surrogate":
            self.proposer = SurrogateProposer(space, problem=self.problem, seed=self.search.seed)
        else:
            self.proposer = OptunaProposer(space, sampler=self.search.sampler, seed=self.search.seed,
                                           max_trials=self.search.max_trials)
        self.in_flight: dict[Future, Ticket] = {}
        self.held: Grant | None = None  # devices taken for the next launch (kept across pruned proposals)
        self.waiting = False  # asked the ledger for devices and was told to wait
        self.cancelled_ids: set[str] = set()
        self.reruns: list[Ticket] = []
        self.any_lost = False  # a row lost with its node exists (then _requeue_next is asked)
        self.last_beat = 0.0
        self.backend_error: BackendError | None = None  # the first one; the loop drains, then raises it
        self.stop_reason: str | None = None  # why the search stopped (None: a confirm round alone)

    # --- state from the store ---------------------------------------------------------------------

    def _load_rows(self) -> None:
        """Cache of the sweep's live rows by number (the loop is the only writer while it runs)."""
        with self.r.sessions() as s:
            self.rows = {t.number: t for t in store.all_trials(s, sweep_id=self.sweep_id) if t.status != "interrupted"}
            self.spent = sum(t.device_seconds or 0.0 for t in store.all_trials(s, sweep_id=self.sweep_id))

    def _rows(self) -> list[store.Trial]:
        return list(self.rows.values())

    def _reload(self, s: Any, number: int, attempt: int | None = None) -> store.Trial:
        row = store.get_trial_by_number(s, sweep_id=self.sweep_id, number=number, attempt=attempt)
        self.rows[number] = row
        return row

    def _rebuild(self) -> list[store.Trial]:
        """Replay every finished search trial into the in-memory study (Optuna's state is derived)."""
        rows = self._rows()
        for t in sorted(rows, key=lambda t: t.number):
            if t.status in store.TERMINAL_TRIAL_STATUSES:
                self.problem.observe(t)  # memory: peaks and OOM bounds, as they arrived
                if t.phase == "search":
                    self._teach(Layout(**t.layout), None, t)
                self.any_lost = self.any_lost or infra_of(t) == NODE_LOST
        self._update_noise()
        return rows

    # --- the loop ----------------------------------------------------------------------------------

    def run(self) -> None:
        with KeepAlive(self.r, self.sweep_id) as keep:
            rerun = self._recover()
            self._inherit()
            rows = self._rebuild()
            if self._recheck_inherited():  # resumed: what its first measurements contradicted stays dropped
                self._save_calibration()
            self.seen = {t.layout_key for t in rows if t.phase == "search"}
            warm = [] if self.problem.listed else self.problem.warm_start(self.search)
            self.warm = [(lay, src) for lay, src in warm if lay.key not in self.seen]
            self.next_number = max((t.number for t in rows), default=-1) + 1
            self.backend = self._retrying("start the backend", lambda: self.r.backend_factory(self.spec))
        self.r.loop_started(self.sweep_id)
        try:
            if keep.lost:
                raise LostClaim(f"sweep {self.sweep_id} was taken over during set-up")
            self.last_beat = 0.0
            self._beat()
            self.slots = self._slots()
            self.ledger = self.r.ledger_for(self.r.cluster_of(self.backend), self.capacity)
            self._probe_cluster()  # before any trial: the model of this cluster is its measured figures
            self.pool = ThreadPoolExecutor(max_workers=self.slots, thread_name_prefix=f"sweep{self.sweep_id}")
            try:
                # Re-runs of a restart go first, each once the ledger grants its devices.
                self.reruns = [Ticket(t.number, t.attempt, Layout(**t.layout), t.phase, None) for t in rerun]
                finished = self._through_outages(self._loop)  # a store outage is waited out
            except BaseException:
                # Failing (or Ctrl-C): do not wait for trials in flight, whose results nobody would
                # record; closing the backend below ends them. Their rows are marked by the caller
                # (sweep failed) or by the next resume (interrupted, re-run as attempt + 1).
                self.pool.shutdown(wait=False, cancel_futures=True)
                raise
            self.pool.shutdown(wait=True)
        finally:
            self._give_back()
            self.r.loop_ended(self.sweep_id, self.backend)
        if finished is False and self._status == "cancelled":
            self._mark_cancelled()
        if self.backend_error is not None:  # every other trial in flight has its own result recorded
            raise self.backend_error
        if finished:
            with store.session_scope(self.r.sessions) as s:
                store.refresh_sweep_cache(s, sweep_id=self.sweep_id)
                store.set_sweep_status(s, sweep_id=self.sweep_id, status="completed", only_from=("running",),
                                       runner_id=self.r.runner_id, stop_reason=self.stop_reason)
        self._progress("end")

    def _trial_id(self, ticket: Ticket) -> str:
        return f"{self.sweep_id}-{ticket.number}-{ticket.attempt}"

    def _slots(self) -> int:
        world = self.problem.cluster.devices
        capacity = int(self._retrying("ask the backend its capacity", self.backend.capacity))
        self.capacity = capacity
        slots = capacity // world if capacity >= 2 * world else 1
        if self.r.settings.max_concurrent_trials > 0:
            slots = min(slots, self.r.settings.max_concurrent_trials)
        return max(1, min(slots, MAX_THREADS))

    def _loop(self) -> bool:
        """Returns True when the sweep ran to its end (not cancelled, stopped or taken over)."""
        phase = CONFIRM if self._confirm_only() else "search"
        remeasure: list[tuple[Layout, int]] = []
        world = self.problem.cluster.devices
        while True:
            halted = self._beat() != "running" or self.stop.is_set()
            if self._status == "cancelled":
                self._cancel_in_flight()
            self._collect([f for f in list(self.in_flight) if f.done()])
            # A backend error: start nothing more, let the trials in flight end and be recorded.
            halted = halted or self.backend_error is not None
            self.waiting = False
            while not halted and len(self.in_flight) < self.slots:
                if self.reruns:  # nothing new is proposed before every re-run has started
                    if not self._take_devices(world):
                        break
                    self._rerun(self.reruns.pop(0))
                    continue
                lost = self._requeue_next() if self.any_lost else None
                if lost is not None:  # lost with its node: once more, on the nodes that remain
                    if not self._take_devices(world):
                        break
                    self._launch(Layout(**lost.layout), phase=lost.phase, source=REQUEUED, repeat=lost.repeat, handle=None)
                    continue
                if phase == CONFIRM:  # the top layouts' long runs, after everything else
                    layout = self._confirm_next()
                    if layout is None or not self._take_devices(world):
                        break
                    self._launch(layout, phase=CONFIRM, source=CONFIRM, repeat=self.confirm["round"], handle=None)
                    continue
                if phase == "search":
                    if not self._search_done():
                        if not self._take_devices(world):
                            break
                        self._launch_search()  # a pruned proposal takes no slot (nor its devices)
                        # Keep the claim alive (and notice a cancel) through long runs of pruned
                        # proposals, which never reach the outer loop's beat.
                        halted = self._beat() != "running" or self.stop.is_set()
                        continue
                    if self.in_flight:
                        break  # re-measurement starts from the final search results
                    self.stop_reason = self._search_stop()  # the sweep's stop_reason when it ends
                    phase, remeasure = "remeasure", self._remeasure_plan()
                if not remeasure and not self.in_flight:  # adaptive: the next round from the results so far
                    remeasure = self._remeasure_plan()
                if not remeasure or self._over_device_budget():
                    break
                if not self._take_devices(world):
                    break
                layout, repeat = remeasure.pop(0)
                self._launch(layout, phase="remeasure", source="remeasure", repeat=repeat, handle=None)
            if not self.waiting or halted:  # not asking now: let the sweeps behind this one have them
                self.ledger.withdraw(self.sweep_id)
                self.ledger.release(self.held)
                self.held = None
            if not self.in_flight:
                if halted:
                    return False
                if self.waiting:
                    self.ledger.wait_change(0.5)
                    continue
                if phase == "remeasure" and self._confirm_begin():
                    phase = CONFIRM
                    continue
                if phase in ("remeasure", CONFIRM):
                    return True
                continue
            # Waiting for devices as well: back soon, a grant may come from another coordinator's release.
            timeout = self.r.poll_s if halted else (self.ledger.poll_s if self.waiting else 0.5)
            wait(list(self.in_flight), timeout=timeout, return_when=FIRST_COMPLETED)

    # --- budgets -------------------------------------------------------------------------------

    def _launch_search(self) -> bool:
        """Propose one layout; prune it or start it. False when nothing more can be proposed now."""
        likeliest = None
        if self.warm:
            layout, source = self.warm.pop(0)
            handle = None
        else:
            # Nothing left predicted to fit: the layout most likely to, launched (never pruned).
            likeliest = None if self.problem.listed else self.problem.fallback(self.seen)
            proposal = (likeliest, None) if likeliest is not None else self.proposer.propose(self.seen)
            if proposal is None:
                self._exhausted = True
                return False
            (layout, handle), source = proposal, ("listed" if self.problem.listed else "sampler")
        self.seen.add(layout.key)
        prediction = self.problem.predict(layout)
        if not prediction.fits and likeliest is None:
            number = self._take_number()
            with store.session_scope(self.r.sessions) as s:
                self._hold(s)
                self._inserted(store.insert_trial(
                    s, sweep_id=self.sweep_id, number=number, layout=dataclasses.asdict(layout),
                    layout_key=layout.key, world_size=layout.world_size, source=source, status="pruned",
                    cause=prediction.prune_cause, **prediction.columns(), backend=self.backend.name,
                ), number)
                store.refresh_sweep_cache(s, sweep_id=self.sweep_id)
                row = self._reload(s, number)
            self._tell(layout, handle, row)
            self._progress("pruned", row)
            return True
        self._launch(layout, phase="search", source=source, repeat=0, handle=handle, prediction=prediction)
        return True

    def _rerun(self, ticket: Ticket) -> None:
        with store.session_scope(self.r.sessions) as s:
            self._hold(s)
            restart_trial_clock(s, sweep_id=self.sweep_id, number=ticket.number, attempt=ticket.attempt)
            self._reload(s, ticket.number, ticket.attempt)
        ticket.grant, self.held = self.held, None
        self._submit(ticket)

    def _take_number(self) -> int:
        number = self.next_number
        self.next_number += 1
        return number

    def _launch(self, layout: Layout, *, phase: str, source: str, repeat: int, handle: Any, prediction: Any = None) -> None:
        prediction = prediction or self.problem.predict(layout)
        number = self._take_number()
        with store.session_scope(self.r.sessions) as s:
            self._hold(s)
            self._inserted(store.insert_trial(
                s, sweep_id=self.sweep_id, number=number, layout=dataclasses.asdict(layout), layout_key=layout.key,
                world_size=layout.world_size, phase=phase, source=source, repeat=repeat, **prediction.columns(),
                backend=self.backend.name,
            ), number)
            self._reload(s, number)
        grant, self.held = self.held, None
        self._submit(Ticket(number, 0, layout, phase, handle, grant=grant))

    def _submit(self, ticket: Ticket) -> None:
        trial = self.spec.trial
        request = TrialRequest(
            model=self.problem.model, cluster=self.problem.cluster, training=self.problem.training,
            layout=ticket.layout, warmup_steps=trial.warmup_steps, measure_steps=self._measure_steps(ticket.phase),
            step_timeout_s=trial.step_timeout_s, seed=self.spec.search.seed,
            trial_id=self._trial_id(ticket), options=trial.options.to_worker(), workload=self.spec.workload,
        )
        ticket.future = self.pool.submit(self._run_one, request)
        self.in_flight[ticket.future] = ticket
        self._progress("started")

    def _retrying(self, what: str, call: Any, trial_id: str | None = None) -> Any:
        """``call()``, retried after each ``RETRY_DELAYS_S`` back-off while it raises
        ``BackendUnavailable`` (and the loop is not being stopped, nor the trial cancelled); then
        that error propagates."""
        for attempt, delay in enumerate((*RETRY_DELAYS_S, None), start=1):
            try:
                return call()
            except BackendUnavailable as exc:
                if delay is None or self.stop.is_set() or trial_id in self.cancelled_ids:
                    raise
                log.warning("sweep %s: could not %s (attempt %d: %s); retrying in %.0f s",
                            self.sweep_id, what, attempt, exc, delay)
                if self.stop.wait(delay):
                    raise
        raise AssertionError("unreachable")  # pragma: no cover - the last attempt returns or raises

    def _run_one(self, request: TrialRequest) -> TrialResult:
        try:
            return self._retrying(f"run trial {request.trial_id}", lambda: self.backend.run(request),
                                  trial_id=request.trial_id)
        except BackendUnavailable:
            raise
        except BackendError as exc:  # the trial's result if the cluster shrank under it, else raised
            return self._refused(exc)
        except Exception as exc:  # a backend bug is recorded as this trial's crash, not the sweep's end
            return TrialResult(
                status="crash", backend=getattr(self.backend, "name", "?"),
                error=TrialError(kind="crash", message=f"backend raised {type(exc).__name__}: {exc}",
                                 exception_type=type(exc).__name__),
            )

    def _collect(self, done: list[Future]) -> None:
        for fut in done:
            ticket = self.in_flight[fut]  # popped once its result is stored (an outage may break that write)
            if ticket.cancelled:  # stopped because the sweep was cancelled: not a result of its layout
                del self.in_flight[fut]
                self.ledger.release(ticket.grant)
                continue
            try:
                result = fut.result()
            except BackendError as exc:
                del self.in_flight[fut]
                self.ledger.release(ticket.grant)
                # The backend could not run this trial (it did not crash: it never ran). Its row stays
                # "running" until the loop ends, then becomes "interrupted" with the cause (sweep
                # failed, or backend unavailable: re-run on resume); the trials beside it finish and
                # keep their own results.
                self.backend_error = self.backend_error or exc
                continue
            with store.session_scope(self.r.sessions) as s:
                row = self.rows.get(ticket.number)
                recorded = store.record_result(
                    s, sweep_id=self.sweep_id, number=ticket.number, attempt=ticket.attempt, result=result,
                    useful_fraction=row.useful_fraction if row else None, layout_key=ticket.layout.key,
                    runner_id=self.r.runner_id)
                if not recorded:  # the row is no longer ours (taken over and interrupted): keep nothing
                    raise LostClaim(f"sweep {self.sweep_id}: trial {ticket.number} attempt {ticket.attempt} "
                                    "is no longer this coordinator's")
                store.refresh_sweep_cache(s, sweep_id=self.sweep_id)
                row = self._reload(s, ticket.number, ticket.attempt)
            del self.in_flight[fut]
            self._note_lost(row)  # first: the devices go back to a cluster that knows it lost a node
            # Only now, with the row's finished_at stored: a stored interval never outlasts its grant.
            self.ledger.release(ticket.grant)
            self.spent += row.device_seconds or 0.0
            if row.status == "completed":
                self._note_fingerprint(row)
            changed = self.problem.observe(row)  # an OOM's bytes and every peak teach the memory model
            changed = (ticket.phase == "search" and self._recheck_inherited()) or changed  # contradicted: dropped
            if ticket.phase == "search":
                self._teach(ticket.layout, ticket.handle, row)
            else:
                self._update_noise()
            if not (ticket.phase == "search" and row.status == "completed" and self._maybe_calibrate()) and changed:
                self._save_calibration()
            self._progress("finished", row)

    def _progress(self, event: str, row: Any = None) -> None:
        self.on_progress({
            "event": event, "sweep_id": self.sweep_id, "in_flight": len(self.in_flight),
            "max_trials": self.search.max_trials, "trial": row,
        })
