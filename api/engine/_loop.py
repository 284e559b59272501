"""One sweep's loop: propose -> prune by the memory model -> run on the backend -> record -> tell.

All database writes and all Optuna calls happen on the loop's thread; worker threads only call
``backend.run`` (so SQLite sees one writer per coordinator and the in-memory study needs no lock).

The loop is composed of collaborators, one per concept, built in ``SweepLoop.__init__`` and
``SweepLoop._attach`` in a fixed order; each takes what it names (the shared ``LoopContext`` of
api/engine/_context.py, the collaborators it calls), never the runner nor the loop. This module
proposes, launches and collects. The structure: docs/engine.md#the-loop-and-its-collaborators.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from api import store
from api.engine._budget import SearchBudget
from api.engine._claim import Claim, KeepAlive, LostClaim
from api.engine._confirm import CONFIRM, Confirm
from api.engine._context import LoopContext
from api.engine._learning import Learning
from api.engine._lost import REQUEUED, LostNodes
from api.engine._model import SweepModel
from api.engine._outage import Outages
from api.engine._probing import Probing
from api.engine._share import Claimant, DeviceLedger, Sharing
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


def _proposer(problem: SweepModel, search: Any) -> Any:
    """The sampler that walks the sweep's space (api/engine/_space.py, api/engine/_surrogate.py)."""
    space = problem.space
    if problem.listed:  # search.layouts: the listed order, no sampler
        return ListProposer(space, shuffle_seed=None)
    if search.sampler in ("grid", "random"):
        return ListProposer(space, shuffle_seed=None if search.sampler == "grid" else search.seed)
    if search.sampler == "surrogate":
        return SurrogateProposer(space, problem=problem, seed=search.seed)
    return OptunaProposer(space, sampler=search.sampler, seed=search.seed, max_trials=search.max_trials)


class SweepLoop:
    """One sweep of ``runner`` (its sessions, runner id, settings, backends and ledgers), run to its end
    by ``run``; ``stop`` ends it early, ``on_progress`` hears of each trial."""

    def __init__(self, runner: SweepRunner, sweep_id: int, stop: threading.Event, on_progress: Any) -> None:
        self.runner = runner
        self.on_progress = on_progress or (lambda event: None)
        with runner.sessions() as s:
            sweep = store.get_sweep(s, sweep_id=sweep_id)
            spec = SweepSpec.model_validate(sweep.spec)
            calibration = sweep.calibration
            asked = sweep.confirm  # the latest confirm round asked (api/engine/_confirm.py)
            self.claimant = Claimant(sweep_id, sweep.owner, sweep.priority or "normal", sweep.created_at)
        problem = SweepModel.from_spec(spec, calibration=calibration)

        # The collaborators, in the order each needs the one before. Built here, on the store alone:
        # 1. what they all share: the sweep, its spec and model, the store, the stop flag, the rows;
        self.ctx = LoopContext(sweep_id=sweep_id, spec=spec, sessions=runner.sessions,
                               runner_id=runner.runner_id, problem=problem, stop=stop)
        # 2. the sampler that proposes layouts (told by learning, asked by this loop);
        self.proposer = _proposer(problem, spec.search)
        # 3. the claim: the restart rule, the check before each insert, the heartbeat;
        self.claim = Claim(self.ctx)
        # 4. the budget: when the search stops, what is re-measured;
        self.budget = SearchBudget(self.ctx)
        # 5. learning: what each outcome teaches the sampler, the model and the calibration;
        self.learning = Learning(self.ctx, self.proposer)
        # 6. confirm runs: the round asked, begun under the claim;
        self.confirm = Confirm(self.ctx, self.claim, asked)
        # 7. store outages: waited out, then settled under the claim.
        self.outages = Outages(self.ctx, self.claim)
        # Built by ``_attach`` once the backend runs and its ledger is known:
        # 8. sharing: the devices of each launch from the ledger, cancels on the backend;
        # 9. lost nodes: the cluster's failures, through sharing's capacity;
        # 10. probing: the cluster measured through sharing, under the claim, stored by learning.
        self.sharing: Sharing | None = None
        self.lost: LostNodes | None = None
        self.probing: Probing | None = None

        self.in_flight: dict[Future, Ticket] = {}
        self.reruns: list[Ticket] = []
        self.waiting = False  # asked the ledger for devices and was told to wait
        self.backend_error: BackendError | None = None  # the first one; the loop drains, then raises it
        self.stop_reason: str | None = None  # why the search stopped (None: a confirm round alone)

    def _attach(self, ledger: DeviceLedger) -> None:
        """The collaborators of the running sweep (8-10 above), on ``self.backend`` and ``ledger``."""
        self.sharing = Sharing(self.ctx, ledger, self.backend, self.claimant)
        self.lost = LostNodes(self.ctx, self.sharing, backend_name=getattr(self.backend, "name", "?"))
        self.probing = Probing(self.ctx, claim=self.claim, sharing=self.sharing, learning=self.learning,
                               backend=self.backend, mode=self.runner.settings.probe)

    # --- state from the store ---------------------------------------------------------------------

    def _rebuild(self) -> list[store.Trial]:
        """Replay every finished search trial into the in-memory study (Optuna's state is derived)."""
        rows = self.ctx.trials()
        for t in sorted(rows, key=lambda t: t.number):
            if t.status in store.TERMINAL_TRIAL_STATUSES:
                self.ctx.problem.observe(t)  # memory: peaks and OOM bounds, as they arrived
                if t.phase == "search":
                    self.learning.teach(Layout(**t.layout), None, t)
        self.learning.update_noise()
        return rows

    def _settle(self) -> None:
        """After a store outage: the next number and the re-runs as the store has them (api/engine/_outage.py)."""
        self.next_number, found = self.outages.settle([*self.in_flight.values(), *self.reruns])
        self.reruns += found

    # --- the loop ----------------------------------------------------------------------------------

    def run(self) -> None:
        ctx, runner = self.ctx, self.runner
        with KeepAlive(ctx.sessions, ctx.runner_id, ctx.sweep_id) as keep:
            rerun = self.claim.recover()
            self.learning.inherit()
            rows = self._rebuild()
            if self.learning.recheck_inherited():  # resumed: what its first measurements contradicted stays dropped
                self.learning.save_calibration()
            ctx.seen = {t.layout_key for t in rows if t.phase == "search"}
            warm = [] if ctx.problem.listed else ctx.problem.warm_start(ctx.search)
            self.warm = [(lay, src) for lay, src in warm if lay.key not in ctx.seen]
            self.next_number = max((t.number for t in rows), default=-1) + 1
            self.backend = self._retrying("start the backend", lambda: runner.backend_factory(ctx.spec))
        runner.loop_started(ctx.sweep_id)
        try:
            if keep.lost:
                raise LostClaim(f"sweep {ctx.sweep_id} was taken over during set-up")
            self.claim.beat(now=True)
            self.slots, capacity = self._slots()
            self._attach(runner.ledger_for(runner.cluster_of(self.backend), capacity))
            self.warm = self.probing.probe(self.warm)  # before any trial: the model of this cluster is its measured figures
            self.pool = ThreadPoolExecutor(max_workers=self.slots, thread_name_prefix=f"sweep{ctx.sweep_id}")
            try:
                # Re-runs of a restart go first, each once the ledger grants its devices.
                self.reruns = [Ticket(t.number, t.attempt, Layout(**t.layout), t.phase, None) for t in rerun]
                # A store outage is waited out.
                finished = self.outages.through(self._loop, settle=self._settle, in_flight=self.in_flight)
            except BaseException:
                # Failing (or Ctrl-C): do not wait for trials in flight, whose results nobody would
                # record; closing the backend below ends them. Their rows are marked by the caller
                # (sweep failed) or by the next resume (interrupted, re-run as attempt + 1).
                self.pool.shutdown(wait=False, cancel_futures=True)
                raise
            self.pool.shutdown(wait=True)
        finally:
            if self.sharing is not None:
                self.sharing.give_back(self.in_flight.values())
            runner.loop_ended(ctx.sweep_id, self.backend)
        if finished is False and self.claim.status == "cancelled":
            self.sharing.mark_cancelled()
        if self.backend_error is not None:  # every other trial in flight has its own result recorded
            raise self.backend_error
        if finished:
            with store.session_scope(ctx.sessions) as s:
                store.refresh_sweep_cache(s, sweep_id=ctx.sweep_id)
                store.set_sweep_status(s, sweep_id=ctx.sweep_id, status="completed", only_from=("running",),
                                       runner_id=ctx.runner_id, stop_reason=self.stop_reason)
        self._progress("end")

    def _trial_id(self, ticket: Ticket) -> str:
        return f"{self.ctx.sweep_id}-{ticket.number}-{ticket.attempt}"

    def _slots(self) -> tuple[int, int]:
        """How many trials run at once, and the backend's devices."""
        world = self.ctx.problem.cluster.devices
        capacity = int(self._retrying("ask the backend its capacity", self.backend.capacity))
        slots = capacity // world if capacity >= 2 * world else 1
        if self.runner.settings.max_concurrent_trials > 0:
            slots = min(slots, self.runner.settings.max_concurrent_trials)
        return max(1, min(slots, MAX_THREADS)), capacity

    def _take_devices(self, world: int) -> bool:
        """Devices for the next launch (api/engine/_share.py); False: wait for them (``waiting``)."""
        self.waiting = not self.sharing.take_devices(world)
        return not self.waiting

    def _loop(self) -> bool:
        """Returns True when the sweep ran to its end (not cancelled, stopped or taken over)."""
        ctx, claim, budget, confirm, sharing = self.ctx, self.claim, self.budget, self.confirm, self.sharing
        phase = CONFIRM if confirm.reopened() else "search"
        remeasure: list[tuple[Layout, int]] = []
        world = ctx.problem.cluster.devices
        while True:
            halted = claim.beat() != "running" or ctx.stop.is_set()
            if claim.status == "cancelled":
                sharing.cancel(self.in_flight.values(), self._trial_id)
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
                lost = self.lost.requeue_next()
                if lost is not None:  # lost with its node: once more, on the nodes that remain
                    if not self._take_devices(world):
                        break
                    self._launch(Layout(**lost.layout), phase=lost.phase, source=REQUEUED, repeat=lost.repeat, handle=None)
                    continue
                if phase == CONFIRM:  # the top layouts' long runs, after everything else
                    layout = confirm.next_layout()
                    if layout is None or not self._take_devices(world):
                        break
                    self._launch(layout, phase=CONFIRM, source=CONFIRM, repeat=confirm.round, handle=None)
                    continue
                if phase == "search":
                    if not budget.search_done():
                        if not self._take_devices(world):
                            break
                        self._launch_search()  # a pruned proposal takes no slot (nor its devices)
                        # Keep the claim alive (and notice a cancel) through long runs of pruned
                        # proposals, which never reach the outer loop's beat.
                        halted = claim.beat() != "running" or ctx.stop.is_set()
                        continue
                    if self.in_flight:
                        break  # re-measurement starts from the final search results
                    self.stop_reason = budget.search_stop()  # the sweep's stop_reason when it ends
                    phase, remeasure = "remeasure", budget.remeasure_plan()
                if not remeasure and not self.in_flight:  # adaptive: the next round from the results so far
                    remeasure = budget.remeasure_plan()
                if not remeasure or budget.over_device_budget():
                    break
                if not self._take_devices(world):
                    break
                layout, repeat = remeasure.pop(0)
                self._launch(layout, phase="remeasure", source="remeasure", repeat=repeat, handle=None)
            if not self.waiting or halted:  # not asking now: let the sweeps behind this one have them
                sharing.let_go()
            if not self.in_flight:
                if halted:
                    return False
                if self.waiting:
                    sharing.ledger.wait_change(0.5)
                    continue
                if phase == "remeasure" and confirm.begin():
                    phase = CONFIRM
                    continue
                if phase in ("remeasure", CONFIRM):
                    return True
                continue
            # Waiting for devices as well: back soon, a grant may come from another coordinator's release.
            timeout = self.runner.poll_s if halted else (sharing.ledger.poll_s if self.waiting else 0.5)
            wait(list(self.in_flight), timeout=timeout, return_when=FIRST_COMPLETED)

    # --- launching ---------------------------------------------------------------------------------

    def _launch_search(self) -> bool:
        """Propose one layout; prune it or start it. False when nothing more can be proposed now."""
        ctx, problem = self.ctx, self.ctx.problem
        likeliest = None
        if self.warm:
            layout, source = self.warm.pop(0)
            handle = None
        else:
            # Nothing left predicted to fit: the layout most likely to, launched (never pruned).
            likeliest = None if problem.listed else problem.fallback(ctx.seen)
            proposal = (likeliest, None) if likeliest is not None else self.proposer.propose(ctx.seen)
            if proposal is None:
                self.budget.note_exhausted()
                return False
            (layout, handle), source = proposal, ("listed" if problem.listed else "sampler")
        ctx.seen.add(layout.key)
        prediction = problem.predict(layout)
        if not prediction.fits and likeliest is None:
            number = self._take_number()
            with store.session_scope(ctx.sessions) as s:
                self.claim.hold(s)
                self.claim.inserted(store.insert_trial(
                    s, sweep_id=ctx.sweep_id, number=number, layout=dataclasses.asdict(layout),
                    layout_key=layout.key, world_size=layout.world_size, source=source, status="pruned",
                    cause=prediction.prune_cause, **prediction.columns(), backend=self.backend.name,
                ), number)
                store.refresh_sweep_cache(s, sweep_id=ctx.sweep_id)
                row = ctx.reload(s, number)
            self.learning.tell(layout, handle, row)
            self._progress("pruned", row)
            return True
        self._launch(layout, phase="search", source=source, repeat=0, handle=handle, prediction=prediction)
        return True

    def _rerun(self, ticket: Ticket) -> None:
        with store.session_scope(self.ctx.sessions) as s:
            self.claim.hold(s)
            restart_trial_clock(s, sweep_id=self.ctx.sweep_id, number=ticket.number, attempt=ticket.attempt)
            self.ctx.reload(s, ticket.number, ticket.attempt)
        ticket.grant = self.sharing.hand_over()
        self._submit(ticket)

    def _take_number(self) -> int:
        number = self.next_number
        self.next_number += 1
        return number

    def _launch(self, layout: Layout, *, phase: str, source: str, repeat: int, handle: Any, prediction: Any = None) -> None:
        ctx = self.ctx
        prediction = prediction or ctx.problem.predict(layout)
        number = self._take_number()
        with store.session_scope(ctx.sessions) as s:
            self.claim.hold(s)
            self.claim.inserted(store.insert_trial(
                s, sweep_id=ctx.sweep_id, number=number, layout=dataclasses.asdict(layout), layout_key=layout.key,
                world_size=layout.world_size, phase=phase, source=source, repeat=repeat, **prediction.columns(),
                backend=self.backend.name,
            ), number)
            ctx.reload(s, number)
        self._submit(Ticket(number, 0, layout, phase, handle, grant=self.sharing.hand_over()))

    def _submit(self, ticket: Ticket) -> None:
        spec, problem = self.ctx.spec, self.ctx.problem
        trial = spec.trial
        request = TrialRequest(
            model=problem.model, cluster=problem.cluster, training=problem.training,
            layout=ticket.layout, warmup_steps=trial.warmup_steps, measure_steps=self.confirm.measure_steps(ticket.phase),
            step_timeout_s=trial.step_timeout_s, seed=spec.search.seed,
            trial_id=self._trial_id(ticket), options=trial.options.to_worker(), workload=spec.workload,
        )
        ticket.future = self.pool.submit(self._run_one, request, ticket)
        self.in_flight[ticket.future] = ticket
        self._progress("started")

    # --- on the worker threads ---------------------------------------------------------------------

    def _retrying(self, what: str, call: Any, cancelled: Any = None) -> Any:
        """``call()``, retried after each ``RETRY_DELAYS_S`` back-off while it raises
        ``BackendUnavailable`` (and the loop is not being stopped, nor ``cancelled()``: the trial was
        cancelled); then that error propagates."""
        stop = self.ctx.stop
        for attempt, delay in enumerate((*RETRY_DELAYS_S, None), start=1):
            try:
                return call()
            except BackendUnavailable as exc:
                if delay is None or stop.is_set() or (cancelled is not None and cancelled()):
                    raise
                log.warning("sweep %s: could not %s (attempt %d: %s); retrying in %.0f s",
                            self.ctx.sweep_id, what, attempt, exc, delay)
                if stop.wait(delay):
                    raise
        raise AssertionError("unreachable")  # pragma: no cover - the last attempt returns or raises

    def _run_one(self, request: TrialRequest, ticket: Ticket) -> TrialResult:
        try:
            return self._retrying(f"run trial {request.trial_id}", lambda: self.backend.run(request),
                                  cancelled=lambda: ticket.cancelled)
        except BackendUnavailable:
            raise
        except BackendError as exc:  # the trial's result if the cluster shrank under it, else raised
            return self.lost.refused(exc)
        except Exception as exc:  # a backend bug is recorded as this trial's crash, not the sweep's end
            return TrialResult(
                status="crash", backend=getattr(self.backend, "name", "?"),
                error=TrialError(kind="crash", message=f"backend raised {type(exc).__name__}: {exc}",
                                 exception_type=type(exc).__name__),
            )

    # --- results -----------------------------------------------------------------------------------

    def _collect(self, done: list[Future]) -> None:
        ctx, learning = self.ctx, self.learning
        for fut in done:
            ticket = self.in_flight[fut]  # popped once its result is stored (an outage may break that write)
            if ticket.cancelled:  # stopped because the sweep was cancelled: not a result of its layout
                del self.in_flight[fut]
                self.sharing.release(ticket.grant)
                continue
            try:
                result = fut.result()
            except BackendError as exc:
                del self.in_flight[fut]
                self.sharing.release(ticket.grant)
                # The backend could not run this trial (it did not crash: it never ran). Its row stays
                # "running" until the loop ends, then becomes "interrupted" with the cause (sweep
                # failed, or backend unavailable: re-run on resume); the trials beside it finish and
                # keep their own results.
                self.backend_error = self.backend_error or exc
                continue
            with store.session_scope(ctx.sessions) as s:
                row = ctx.rows.get(ticket.number)
                recorded = store.record_result(
                    s, sweep_id=ctx.sweep_id, number=ticket.number, attempt=ticket.attempt, result=result,
                    useful_fraction=row.useful_fraction if row else None, layout_key=ticket.layout.key,
                    runner_id=ctx.runner_id)
                if not recorded:  # the row is no longer ours (taken over and interrupted): keep nothing
                    raise LostClaim(f"sweep {ctx.sweep_id}: trial {ticket.number} attempt {ticket.attempt} "
                                    "is no longer this coordinator's")
                store.refresh_sweep_cache(s, sweep_id=ctx.sweep_id)
                row = ctx.reload(s, ticket.number, ticket.attempt)
            del self.in_flight[fut]
            self.lost.note_lost(row)  # first: the devices go back to a cluster that knows it lost a node
            # Only now, with the row's finished_at stored: a stored interval never outlasts its grant.
            self.sharing.release(ticket.grant)
            ctx.spent += row.device_seconds or 0.0
            if row.status == "completed":
                learning.note_fingerprint(row)
            changed = ctx.problem.observe(row)  # an OOM's bytes and every peak teach the memory model
            changed = (ticket.phase == "search" and learning.recheck_inherited()) or changed  # contradicted: dropped
            if ticket.phase == "search":
                learning.teach(ticket.layout, ticket.handle, row)
            else:
                learning.update_noise()
            if not (ticket.phase == "search" and row.status == "completed" and learning.maybe_calibrate()) and changed:
                learning.save_calibration()
            self._progress("finished", row)

    def _progress(self, event: str, row: Any = None) -> None:
        self.on_progress({
            "event": event, "sweep_id": self.ctx.sweep_id, "in_flight": len(self.in_flight),
            "max_trials": self.ctx.search.max_trials, "trial": row,
        })
