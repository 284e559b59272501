"""/api/probes: the stored cluster probes and their figures, probed beside datasheet (thin wrappers
over api.probes.service; a probe is measured by ``meshtune probe`` or by a sweep's start)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field

from api._http import GuardedRoute
from api.deps import ReaderDep, SessionDep, path_id
from api.probes import service
from api.schemas import ERROR_RESPONSES, NOT_FOUND
from tuner import NotFoundError, cluster_spec, figure_rows, summary

router = APIRouter(prefix="/api/probes", tags=["probes"], route_class=GuardedRoute)
ProbeId = path_id("Probe id.")


class ProbeOut(BaseModel):
    id: int = Field(description="Probe id.")
    key: str = Field(description="What it measured: the cluster's hardware, the model's shapes, dtype, backend, workload.")
    env_fingerprint: str = Field(description="The environment it ran in (device, driver, torch, CUDA, NCCL, backend).")
    backend: str = Field(description="The backend whose rank processes it ran on.")
    dtype: str = Field(description="The dtype the compute figures were measured in.")
    created_at: datetime = Field(description="When it finished (it is stored only once finished).")
    wall_s: float = Field(description="Seconds it took, the rank processes' start included.")
    cluster: dict[str, Any] = Field(description="The cluster's hardware as probed (a ClusterSpec).")
    model: dict[str, Any] = Field(description="The model whose shapes the compute figures were measured at.")
    env: dict[str, Any] = Field(description="Rank 0's environment fingerprint (workers/env.py).")
    summary: str = Field(description="How many figures are probed; which tiers of links were, which fell back to the datasheet.")
    figures: dict[str, Any] = Field(description="tuner.ProbedFigures: what the time and memory models read.")
    rows: list[dict[str, Any]] = Field(description="Each figure: datasheet, probed, ratio, which one the models use.")


def _out(row: Any) -> ProbeOut:
    cluster = service.hardware(cluster_spec(row.cluster))
    figures = service.figures_of(row)
    return ProbeOut(id=row.id, key=row.key, env_fingerprint=row.env_fingerprint, backend=row.backend, dtype=row.dtype,
                    created_at=row.created_at, wall_s=row.wall_s, cluster=row.cluster, model=row.model, env=row.env,
                    summary=summary(cluster, figures), figures=row.figures,
                    rows=[r.to_dict() for r in figure_rows(cluster, figures)])


@router.get("", response_model=list[ProbeOut], summary="Stored cluster probes, newest first",
            responses={k: ERROR_RESPONSES[k] for k in (401, 403)})
def list_probes(session: SessionDep, _: ReaderDep) -> list[ProbeOut]:
    """Every stored probe, newest first (at most 100)."""
    return [_out(r) for r in service.newest(session, limit=100)]


@router.get("/{probe_id}", response_model=ProbeOut, summary="One cluster probe",
            responses={**{k: ERROR_RESPONSES[k] for k in (401, 403, 422)}, **NOT_FOUND})
def get_probe(probe_id: ProbeId, session: SessionDep, _: ReaderDep) -> ProbeOut:
    """A probe's figures, each beside the datasheet's with the ratio."""
    row = service.get(session, probe_id)
    if row is None:
        raise NotFoundError(f"probe {probe_id} does not exist")
    return _out(row)
