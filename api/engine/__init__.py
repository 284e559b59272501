"""The sweep engine: Optuna ask-and-tell over a sweep's valid layouts, pruning by the memory model,
warm start, budgets, concurrent trials and restart recovery.

Where Optuna's state lives, and why: **in memory, rebuilt from our trials table.** Each sweep gets an
in-memory ``optuna.Study``; on (re)start the engine replays every finished search trial into it with
``study.add_trial`` (values, and the memory constraint for infeasible ones). Our ``trials`` table is
the one source of truth. Reasons:
- Optuna's ``RDBStorage`` runs its own Alembic migrations and stamps ``alembic_version``
  (optuna/storages/_rdb/storage.py and its bundled alembic/ directory); sharing the
  app's schema breaks one of the two, and a separate file/schema doubles what must be backed up,
  migrated and kept consistent (a trial recorded in one store but not the other after a crash).
- SQLite with several writer processes gives "database is locked" (optuna #820, #4994); the
  embedded default would have two writers (API + engine) on Optuna's tables.
- Ask-and-tell heartbeats and ``fail_stale_trials`` would be a second restart protocol beside ours.
- Samplers only need the history; replaying a few thousand trials takes well under a second.
The price: ``optuna-dashboard`` cannot open a sweep directly. meshtune's own dashboard reads the store;
a study can be materialised for Optuna tooling from the trials table (api/dashboard/importance.py
does this for parameter importance).

Restart rule: a coordinator that starts (``SweepRunner.run_pending`` or ``run_sweep``) resumes every
queued or unfinished sweep whose runner is gone (same host and dead pid, or heartbeat older than
``stale_after_s``). A trial row still "running" is marked "interrupted" and the trial is re-run under
the **same number** as ``attempt + 1``; so every trial number ends with exactly one non-interrupted row,
and numbers are never reused or skipped. Results are written with a guard (only a "running" row
accepts one), so a duplicate report changes nothing. ``meshtune sweep --resume ID`` applies the same
rule in the foreground (Ctrl-C on ``meshtune sweep`` releases the sweep so that it can be resumed at once).

Ownership (two coordinators on one database): the owner heartbeats every HEARTBEAT_S (also through
long runs of pruned proposals and, from a helper thread, through slow set-up); every transaction that
adds trial rows first re-asserts ownership (``store.hold_sweep``, which takes the sweep's row lock);
results are written only onto a row of the same layout while the writer still owns the sweep. A runner
that finds its sweep taken over stops at once and writes nothing more (``LostClaim``); a runner's
error never fails or interrupts a sweep that another runner owns. A database error that may pass
(connection lost, server restart) is waited out by the sweep's loop with its trials in flight
(api/engine/_outage.py); one that outlasts that wait releases the sweep for a later resume instead
of failing it, and ``run_pending`` survives any error (logged, retried with back-off).

Several sweeps at once (issue 15): ``run_pending`` runs up to ``max_concurrent_sweeps`` claimed
sweeps, one ``SweepLoop`` thread each (a queued sweep is claimed only when it would be served
before every sweep already waiting for devices, so the others stay queued with their position); every trial takes its devices from the runner's
``DeviceLedger`` for its backend (fair share between owners, then priority, then age; per-owner
limits wait at launch) before its row is written and gives them back after its result is recorded,
so the stored [started_at, finished_at) intervals never hold more devices than the cluster has,
whichever coordinator on the database ran them (the grants are lease rows handed out by one queue
per cluster for every coordinator: api/engine/_shared.py, api/store/_leases.py). Restart re-runs take their devices like any trial (their ``started_at`` is
when they got them). A cancelled sweep asks a backend that can (``backend.cancel(trial_id)``: Ray
kills the trial's gang and removes its placement groups) to stop its trials in flight; their results
are not recorded and their rows become "interrupted" (cause ``sweep cancelled``); a backend without
``cancel`` lets them finish, and they are recorded as before.

A node lost under a trial (Ray marks the crash ``infra="node_lost"``) is the cluster's fault: the
result is recorded, not told to the sampler, not counted in the budget, and the layout re-queued
once; the ledger re-reads the live capacity; a trial that no longer fits the nodes left is refused
as its result (api/engine/_lost.py).

Submission (``api.sweeps.service.create_sweep``, schedules too) refuses a spec whose space leaves no
valid layout or whose backend does not resolve (SpecError naming ``space.<field>`` / ``backend``).

A sweep that FAILS (e.g. its backend cannot be imported) is never resumed: its rows still "running"
are marked "interrupted" with the cause ``sweep failed: <reason>``, so no row of a finished sweep is
left "running" (nor counted as running by /metrics). When a trial meets a backend error, the trials
beside it still finish and keep their own results; the one that met it is "interrupted" with it.

Infrastructure is not the sweep's fault: a backend that raises ``workers.BackendUnavailable`` (Ray
did not start in time, the cluster does not answer, no room, rank processes did not start) has the
call retried after a back-off (``_loop.RETRY_DELAYS_S``). If it stays unavailable the sweep is left
unfinished, never failed: its rows in flight become "interrupted" (cause ``backend unavailable:
...``; re-run as attempt + 1 on resume), it is released, ``run_sweep`` raises the error with the
resume command, and ``run_pending`` does not claim it again for a growing back-off, so the sweeps
behind it still run.

Listed layouts (``search.layouts``): no sampler, warm start or patience; each listed layout is run
once in the listed order (search phase, source "listed"; still subject to the memory model's pruning)
and then topped up to ``search.repeats`` measurements (re-measurement phase).
"""

from api.engine._model import Prediction, Problem, check_backend, check_runnable
from api.engine._runner import SweepRunner
from api.engine._space import LayoutSpace

__all__ = ["LayoutSpace", "Prediction", "Problem", "SweepRunner", "check_backend", "check_runnable"]
