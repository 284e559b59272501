"""/api/sweeps/{id}/confirm: ask a completed sweep to run its top layouts longer, and read the report
(thin wrappers over api.confirm.service)."""

from __future__ import annotations

from fastapi import APIRouter, status

from api._http import GuardedRoute
from api.confirm import service
from api.confirm.schemas import ConfirmIn, ConfirmOut
from api.deps import ReaderDep, SessionDep, SweepId, WriterDep
from api.schemas import BODY_RESPONSES, ERROR_RESPONSES, NOT_FOUND, ErrorOut
from api.sweeps import service as sweeps
from api.sweeps.schemas import SweepOut
from tuner import NotFoundError

router = APIRouter(prefix="/api/sweeps", tags=["confirm"], route_class=GuardedRoute)


@router.post(
    "/{sweep_id}/confirm",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=SweepOut,
    summary="Confirm the top layouts with longer runs",
    responses={**{k: ERROR_RESPONSES[k] for k in (401, 403, 422)}, **NOT_FOUND, **BODY_RESPONSES,
               409: {"model": ErrorOut, "description": "The sweep is still queued or running, was cancelled or "
                     "failed, or has no completed trial to confirm."}},
)
def confirm(sweep_id: SweepId, body: ConfirmIn, session: SessionDep, user: WriterDep) -> SweepOut:
    """Reopen a completed sweep for one confirm round: its ranking's first ``top_k`` layouts each run
    again for ``steps`` measured steps (default 10x the sweep's), as the phase "confirm" (kept out of
    the ranking). The coordinator runs it (the sweep is queued again); GET .../confirm reports it.
    Only the sweep's owner or an admin may (403 otherwise); nothing is stored on a refusal."""
    service.request_confirm(session, sweep_id=sweep_id, top_k=body.top_k, steps=body.steps, actor=user)
    return sweeps.describe_sweep(session, sweep_id=sweep_id)


@router.get("/{sweep_id}/confirm", response_model=ConfirmOut, summary="Short runs against long runs",
            responses={**{k: ERROR_RESPONSES[k] for k in (401, 403, 422)}, **NOT_FOUND})
def confirm_report(sweep_id: SweepId, session: SessionDep, _: ReaderDep) -> ConfirmOut:
    """The latest confirm round: each confirmed layout's short-run and long-run medians with their
    intervals, Spearman's correlation of the two orders with a bootstrap interval, whether the winner
    was kept, and each long run's drift (last tenth against the first). 404 when none was asked."""
    report = service.confirm_report(session, sweep_id=sweep_id)
    if report is None:
        raise NotFoundError(f"sweep {sweep_id} has no confirm run (POST /api/sweeps/{sweep_id}/confirm asks one)")
    return ConfirmOut.model_validate(report, from_attributes=True)
