"""GET /api/sweeps/{id}/export: a ranked layout of the sweep in a framework's configuration (thin
wrapper over api.export.service)."""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, Query, Response

from api._http import GuardedRoute
from api.deps import MAX_ID, ReaderDep, SessionDep, SweepId
from api.export import service
from api.schemas import ERROR_RESPONSES, ErrorOut
from tuner import EXPORT_FORMATS

router = APIRouter(prefix="/api/sweeps", tags=["export"], route_class=GuardedRoute)

CONTENT = {"application/toml": {}, "text/plain": {}, "application/json": {}, "text/x-shellscript": {}}
NOTES_HEADER = "X-Meshtune-Notes"  # the header and caveat lines, a JSON list (ASCII)


@router.get(
    "/{sweep_id}/export",
    summary="Export a ranked layout to torchtitan, Megatron-LM, DeepSpeed or NeMo",
    response_class=Response,
    responses={
        200: {"content": CONTENT, "description": "torchtitan: TOML job config; megatron: Megatron-LM "
              "arguments, one flag a line, shell-quoted; deepspeed: JSON config with the Hugging Face "
              "model config; nemo: Megatron-Bridge run_recipe.py arguments (recipe and overrides); "
              "megatron-launch / torchtitan-launch: bash scripts. Argument lists hold only the arguments; "
              f"the header and caveats are in the `{NOTES_HEADER}` response header (a JSON list of "
              "lines), and also in the TOML, JSON and scripts (comments, or the JSON's `meshtune` key).",
              "headers": {NOTES_HEADER: {"description": "The header and caveat lines, a JSON list.",
                                         "schema": {"type": "string"}}}},
        **{k: ERROR_RESPONSES[k] for k in (401, 403, 422)},
        404: {"model": ErrorOut, "description": "No sweep with this id, or no such rank or layout in its ranking."},
        409: {"model": ErrorOut, "description": "The sweep has no completed trial yet."},
    },
)
def export(
    sweep_id: SweepId,
    session: SessionDep,
    _: ReaderDep,
    format: Annotated[str, Query(max_length=50, description=f"One of {', '.join(EXPORT_FORMATS)}.")],
    rank: Annotated[int | None, Query(ge=1, le=MAX_ID, description="Ranked layout to export (default 1, the best).")] = None,
    layout: Annotated[str | None, Query(max_length=300, description="Layout to export instead of a rank: its key, "
                                         "or the short form meshtune show prints (`cp2 dp4 pp2 z1 1f1b`).")] = None,
) -> Response:
    """The layout at ``rank`` (or with key ``layout``) of the sweep's ranking, written for the framework:
    404 for an unknown sweep, rank or layout, 409 when no trial completed, 422 for an unknown format."""
    out = service.export_sweep(session, sweep_id=sweep_id, format=format, rank=rank, layout=layout)
    return Response(out.export.text, media_type=out.media_type,
                    headers={"Content-Disposition": f'inline; filename="{out.filename}"',
                             NOTES_HEADER: json.dumps(list(out.export.notes))})
