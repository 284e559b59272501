"""/api/sweeps/{id}/reshard-check(s): verify moving a run between two layouts of a sweep's problem
(thin wrappers over api.reshard.service)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from api._http import GuardedRoute
from api.deps import ReaderDep, SessionDep, SweepId, WriterDep
from api.reshard import service
from api.reshard.schemas import ReshardCheckIn, ReshardCheckOut
from api.schemas import BODY_RESPONSES, ERROR_RESPONSES, NOT_FOUND

router = APIRouter(prefix="/api/sweeps", tags=["reshard"], route_class=GuardedRoute)


@router.post(
    "/{sweep_id}/reshard-check",
    response_model=ReshardCheckOut,
    summary="Check moving a run between two layouts",
    responses={**{k: ERROR_RESPONSES[k] for k in (401, 403, 422)}, **NOT_FOUND, **BODY_RESPONSES},
)
def reshard_check(request: Request, sweep_id: SweepId, body: ReshardCheckIn, session: SessionDep,
                  user: WriterDep) -> ReshardCheckOut:
    """Train ``steps_before`` real steps of the sweep's model under ``from_layout``, save model and
    optimizer with torch.distributed.checkpoint, load under ``to_layout`` and train ``steps_after``
    more. Verdict: every tensor bit-identical after the load, and losses within the workers' numerics
    tolerance of an uninterrupted run. Blocks while it runs (a few steps of each layout); stored
    with the sweep."""
    row = service.run_check(
        session, sweep_id=sweep_id, from_layout=body.from_layout, to_layout=body.to_layout,
        steps_before=body.steps_before, steps_after=body.steps_after, owner=user.name, corrupt=body.corrupt,
        runner=getattr(request.app.state, "reshard_runner", None),
    )
    return ReshardCheckOut.model_validate(row)


@router.get(
    "/{sweep_id}/reshard-checks",
    response_model=list[ReshardCheckOut],
    summary="Reshard checks of a sweep",
    responses={**{k: ERROR_RESPONSES[k] for k in (401, 403, 422)}, **NOT_FOUND},
)
def list_reshard_checks(sweep_id: SweepId, session: SessionDep, _: ReaderDep) -> list[ReshardCheckOut]:
    """Every reshard check run against this sweep, oldest first."""
    return [ReshardCheckOut.model_validate(r) for r in service.list_checks(session, sweep_id=sweep_id)]
