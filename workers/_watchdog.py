"""Watching a trial's ranks on their gang until the trial ends, and the error that explains it.

The driver half of the Ray backend's failure handling (workers/ray_backend.py states the contract):
``watch_gang`` waits for every rank's ``run``, collecting its report or its classified error
(workers/failures.py); meanwhile it polls the ranks' progress through their "control" concurrency
group (``stalled_verdict``), kills only the hung ranks when their peers are merely blocked in a
collective with them (``kill_culprits``), and in the end picks the error that explains the trial (a
rank's own failure before its peers' consequences). ``node_lost_error`` is a trial's error when
nodes of it died.

Driver code: it imports Ray but not torch, like the rest of the backend's driver side.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from workers._contract import TrialError, TrialRequest
from workers._gangs import Slot, drop
from workers.failures import died_error, timeout_error

ERROR_GRACE_S = 2.0  # after one rank fails, how long its peers get to return before they are killed


def watch_gang(
    refs: dict[Any, int], ranks: list[Slot], request: TrialRequest, init_timeout: float
) -> tuple[dict[int, dict[str, Any]], TrialError | None, bool]:
    """Wait for every rank, watching progress. Returns (reports, the trial's error, all returned)."""
    pending = dict(refs)
    reports: dict[int, dict[str, Any]] = {}
    errors: list[TrialError] = []
    secondary: set[int] = set()  # errors raised inside a collective: consequences of a peer's failure
    start = time.monotonic()
    answered = [start]  # when the ranks last answered the watchdog (see stalled_verdict)
    first_error_at: float | None = None
    poll = min(1.0, max(0.05, request.step_timeout_s / 10))
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=poll)
        for ref in done:
            rank = pending.pop(ref)
            try:
                out = ray.get(ref)
            except RayActorError as exc:  # the process died (os._exit, signal, OOM killer)
                errors.append(died_error(rank=rank, exc=exc))
                drop(ranks[rank])  # even if every peer returns: a dead handle must not be reused
                continue
            if "report" in out:
                reports[rank] = out["report"]
            else:
                error = TrialError(**out["error"])
                if out.get("in_collective"):
                    secondary.add(id(error))
                errors.append(error)
        if not pending:
            break
        if errors:
            first_error_at = first_error_at or time.monotonic()
            if time.monotonic() - first_error_at > ERROR_GRACE_S:
                break  # peers are stuck in collectives with a dead partner: kill them
            continue
        verdict = stalled_verdict(pending, ranks, request, init_timeout, start, answered)
        if verdict is not None:
            error, culprits = verdict
            if culprits and len(culprits) < len(pending):
                return reports, error, kill_culprits(pending, ranks, culprits)
            return reports, error, False
    if errors:
        return reports, _primary(errors, secondary), not pending
    return reports, None, True


def stalled_verdict(
    pending: dict[Any, int], ranks: list[Slot], request: TrialRequest, init_timeout: float, start: float,
    answered: list[float] | None = None,
) -> tuple[TrialError, list[int]] | None:
    """(timeout error, culprit ranks) if a pending rank made no progress for too long, else None.

    A rank that does not even answer its snapshot (a process starved or stuck below Python) is
    not waited for forever: when no round has been answered for as long as a rank may take to
    start and make its first step (``answered[0]``: the last answered round), every pending rank
    is a culprit and the trial ends as ``timeout``.

    Once any rank is stalled, culprits are the pending ranks *not* waiting inside a torch.distributed
    call (by their stack), stalled themselves or not: the peers blocked in a collective wait on them.
    (The one a gang waits on can have marked progress last, e.g. a rank that hung before its next
    step after finishing the last one after its peers: only its peers are over the limit then.)
    On NCCL a blocked peer's Python stack ends in ``torch.cuda.synchronize`` or a ``.item()``
    (collectives return at once; the host waits on the stream), so every pending rank counts
    as a culprit, the whole gang is killed at once and the error names every rank ("all N ranks";
    the stacks and step counts in it still show which one hung). Killing only a culprit would not
    free NCCL peers anyway."""
    waiting = sorted(pending.values())
    answered = answered if answered is not None else [start]
    try:
        snaps = ray.get([ranks[r].actor.snapshot.remote() for r in waiting], timeout=5.0)
    except (GetTimeoutError, RayError):  # no answer this round; a dead actor surfaces through its run()
        silent = time.monotonic() - answered[0]
        if silent <= init_timeout + request.step_timeout_s:
            return None
        error = timeout_error(ranks=waiting, world_size=len(ranks), seconds=silent,
                              what="not answering the watchdog")
        return error, waiting
    answered[0] = time.monotonic()
    since_start = time.monotonic() - start
    stalled = []
    for rank, snap in zip(waiting, snaps, strict=True):
        if snap["phase"] == "steps":
            idle, limit, what = snap["idle_s"], request.step_timeout_s, "a training step"
        elif snap["phase"] == "init":
            idle, limit, what = snap["idle_s"], init_timeout + request.step_timeout_s, "start-up and first step"
        else:  # this trial has not started on the rank yet
            idle, limit, what = since_start, init_timeout + request.step_timeout_s, "waiting to start"
        if idle > limit:
            stalled.append((rank, snap, idle, what))
    if not stalled:
        return None
    with contextlib.suppress(GetTimeoutError, RayError):
        snaps = ray.get([ranks[r].actor.snapshot.remote(with_stack=True) for r in waiting], timeout=5.0)
    steps = {r: s["steps"] for r, s in zip(waiting, snaps, strict=True)}
    fewest = min(steps.values())
    culprits = [r for r, s in zip(waiting, snaps, strict=True) if "stack" in s and not _waiting_in_collective(s["stack"])]
    laggards = culprits or [r for r, n in steps.items() if n == fewest]
    _, _, idle, what = stalled[0]
    error = timeout_error(ranks=laggards, world_size=len(ranks), seconds=idle, what=what, steps_done=fewest)
    error.message += f"; optimizer steps per rank: {steps}"
    stacks = [f"rank {r}:\n{s.get('stack', '(no stack)')}" for r, s in zip(waiting, snaps, strict=True)]
    error.traceback_tail = "\n".join(stacks)[-8000:]
    return error, culprits


def kill_culprits(pending: dict[Any, int], ranks: list[Slot], culprits: list[int]) -> bool:
    """Kill only the hung ranks; their peers then fail out of the collective (gloo notices the
    closed connections) and stay reusable. True if every peer returned within the grace time;
    False leaves the caller to kill the rest (e.g. NCCL peers that do not notice)."""
    for r in culprits:
        drop(ranks[r])
    rest = [ref for ref, r in pending.items() if r not in culprits]
    done, _ = ray.wait(rest, num_returns=len(rest), timeout=ERROR_GRACE_S + 3.0)
    return len(done) == len(rest)


def node_lost_error(error: TrialError, rank_nodes: list[str], lost: set[str]) -> TrialError:
    """The trial's error when nodes of it died: a ``crash`` that says which node and ranks were lost
    (the ranks' own errors are consequences of it), keeping the error's rank and type when it was a
    rank on a lost node."""
    node = sorted(lost)[0]
    on_it = [r for r, n in enumerate(rank_nodes) if n in lost]
    first = error.rank if error.rank in on_it else on_it[0]
    message = (f"node lost: node {node[:12]} died with ranks {_ranges(on_it)} of this trial; "
               f"rank {first}: {error.message}")[:500]
    return TrialError(kind="crash", message=message, rank=first, exception_type=error.exception_type,
                      traceback_tail=error.traceback_tail, infra="node_lost")


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(f"{start}" if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)


def _waiting_in_collective(stack: str) -> bool:
    """Whether the innermost frame of a formatted stack is inside torch.distributed."""
    frames = [line for line in stack.splitlines() if line.lstrip().startswith('File "')]
    return bool(frames) and f"{os.sep}torch{os.sep}distributed{os.sep}" in frames[-1]


def _primary(errors: list[TrialError], secondary: set[int]) -> TrialError:
    """The error that explains the trial: a rank's own failure before its peers' consequences
    (an error raised inside a collective, or a process that died), then the earliest."""

    def weight(e: TrialError) -> int:
        if e.kind in ("oom", "nan"):
            return 0
        if id(e) in secondary:
            return 3
        if (e.exception_type or "").startswith("ray."):
            return 2
        return 1

    return min(enumerate(errors), key=lambda ie: (weight(ie[1]), ie[0]))[1]
