"""GET /metrics: Prometheus text exposition read from the store at scrape time.

The numbers live in the database (several coordinators may share it, and a restart must not reset
them), so they are collected per scrape by a custom collector rather than kept in process counters.
"""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from sqlalchemy.orm import Session

from api import store
from api.deps import ReaderDep, SessionDep
from api.schemas import ERROR_RESPONSES
from api.sweeps import service as svc

router = APIRouter(tags=["metrics"])


class StoreCollector:
    """Sweeps by state, trials by outcome, device-seconds spent — one consistent read per scrape. A
    simulated outcome or device time is labelled ``simulated="true"``, never summed with real ones."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def collect(self):  # noqa: ANN201 - prometheus_client's collector protocol
        counts = svc.counts(self.session)
        g = GaugeMetricFamily("meshtune_sweeps", "Sweeps in the store by state.", labels=["state"])
        for state in store.SWEEP_STATUSES:
            g.add_metric([state], counts.sweeps_by_status.get(state, 0))
        yield g
        t = GaugeMetricFamily(
            "meshtune_trials", "Trial attempts in the store by outcome (pruned = rejected by the model); "
            "simulated=\"true\": results of the simulate backend, not measurements.",
            labels=["outcome", "simulated"],
        )
        for outcome in store.TRIAL_STATUSES:
            for simulated in (False, True):
                t.add_metric([outcome, str(simulated).lower()], counts.trials_by_status.get((outcome, simulated), 0))
        yield t
        c = CounterMetricFamily(
            "meshtune_device_seconds",
            "Device time of trials (wall seconds x devices held), all sweeps; simulated=\"true\": what the "
            "simulate backend says a real run would take (no device spent it).",
            labels=["simulated"],
        )
        for simulated in (False, True):
            c.add_metric([str(simulated).lower()], counts.device_seconds[simulated])
        yield c


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    responses={
        200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text exposition format 0.0.4."},
        **{k: ERROR_RESPONSES[k] for k in (401, 403)},
    },
)
def metrics(session: SessionDep, _: ReaderDep) -> Response:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(session))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
