"""GET /healthz: is the database reachable, and is Ray? Each is reported on its own.

Ray is never started (or even imported) for a health check: a configured ``RAY_ADDRESS`` is probed
with a TCP connection to its GCS/client port; without one, the embedded local Ray is reported as
running if this process already started it, else as "started on demand" (``ok: null``).
"""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

from fastapi import APIRouter, Request, Response

from api.deps import SettingsDep
from api.schemas import ComponentHealth, HealthOut
from api.settings import Settings
from api.store._db import StoreUnavailableError, check_connection

router = APIRouter(tags=["health"])

RAY_CURRENT_CLUSTER = Path("/tmp/ray/ray_current_cluster")  # where `ray start` writes the GCS address
PROBE_TIMEOUT_S = 1.0


def _database(request: Request) -> ComponentHealth:
    started = time.perf_counter()
    try:
        check_connection(request.app.state.engine)
    except StoreUnavailableError as exc:
        return ComponentHealth(ok=False, detail=str(exc))
    return ComponentHealth(
        ok=True, detail="SELECT 1 round-tripped", latency_ms=round((time.perf_counter() - started) * 1e3, 3)
    )


def _ray_target(address: str) -> tuple[str, int] | None:
    """(host, port) to probe for a Ray address: 'host:port', 'ray://host:port' or 'auto'."""
    if address == "auto":
        if not RAY_CURRENT_CLUSTER.exists():
            return None
        address = RAY_CURRENT_CLUSTER.read_text().strip()
    address = address.split("://", 1)[-1]
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _ray(settings: Settings) -> ComponentHealth:
    if not settings.ray_address:
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            return ComponentHealth(ok=True, detail="local Ray started by this coordinator is running")
        return ComponentHealth(ok=None, detail="no RAY_ADDRESS: a local Ray is started on demand by the first trial")
    target = _ray_target(settings.ray_address)
    if target is None:
        return ComponentHealth(ok=False, detail=f"cannot resolve RAY_ADDRESS={settings.ray_address!r} to host:port")
    started = time.perf_counter()
    try:
        with socket.create_connection(target, timeout=PROBE_TIMEOUT_S):
            pass
    except OSError as exc:
        return ComponentHealth(ok=False, detail=f"Ray at {target[0]}:{target[1]} is unreachable: {exc.strerror or exc}")
    return ComponentHealth(
        ok=True,
        detail=f"Ray at {target[0]}:{target[1]} accepts connections",
        latency_ms=round((time.perf_counter() - started) * 1e3, 3),
    )


@router.get(
    "/healthz",
    response_model=HealthOut,
    summary="Database and Ray reachability",
    responses={503: {"model": HealthOut, "description": "The database or the configured Ray is unreachable."}},
)
def healthz(request: Request, response: Response, settings: SettingsDep) -> HealthOut:
    database = _database(request)
    ray = _ray(settings)
    healthy = database.ok is not False and ray.ok is not False
    if not healthy:
        response.status_code = 503
    return HealthOut(status="ok" if healthy else "degraded", database=database, ray=ray)
