"""GET /api/presets: the model and cluster presets a spec can name, with derived sizes."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import ReaderDep
from api.schemas import ERROR_RESPONSES, ClusterPresetOut, ModelPresetOut, PresetsOut
from api.spec import SAMPLERS
from tuner import CLUSTER_PRESETS, MODEL_PRESETS, to_dict

router = APIRouter(tags=["presets"])


@router.get(
    "/api/presets",
    response_model=PresetsOut,
    summary="Model and cluster presets",
    responses={k: ERROR_RESPONSES[k] for k in (401, 403)},
)
def presets(_: ReaderDep) -> PresetsOut:
    models = [
        ModelPresetOut(**to_dict(m), params=m.params, active_params=m.active_params) for m in MODEL_PRESETS.values()
    ]
    clusters = [ClusterPresetOut(**to_dict(c), devices=c.devices) for c in CLUSTER_PRESETS.values()]
    return PresetsOut(models=models, clusters=clusters, samplers=list(SAMPLERS))
