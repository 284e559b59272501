"""GET /metrics: Prometheus text exposition read from the store at scrape time.

The numbers live in the database (several coordinators may share it, and a restart must not reset
them), so they are collected per scrape by a custom collector rather than kept in process counters.
"""

from __future__ import annotations

import sqlalchemy as sa
from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from sqlalchemy.orm import Session

from api import store
from api.deps import ReaderDep, SessionDep
from api.schemas import ERROR_RESPONSES

router = APIRouter(tags=["metrics"])


class StoreCollector:
    """Sweeps by state, trials by outcome, device-seconds spent — one consistent read per scrape."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def collect(self):  # noqa: ANN201 - prometheus_client's collector protocol
        sweeps = store.count_sweeps_by_status(self.session)
        trials = store.count_trials_by_status(self.session)
        spent = _device_seconds(self.session)
        g = GaugeMetricFamily("meshtune_sweeps", "Sweeps in the store by state.", labels=["state"])
        for state in store.SWEEP_STATUSES:
            g.add_metric([state], sweeps.get(state, 0))
        yield g
        t = GaugeMetricFamily(
            "meshtune_trials", "Trial attempts in the store by outcome (pruned = rejected by the model).",
            labels=["outcome"],
        )
        for outcome in store.TRIAL_STATUSES:
            t.add_metric([outcome], trials.get(outcome, 0))
        yield t
        c = CounterMetricFamily(
            "meshtune_device_seconds",
            "Device time of trials (wall seconds x devices held), all sweeps; simulated=\"true\": what the "
            "simulate backend says a real run would take (no device spent it).",
            labels=["simulated"],
        )
        for simulated in (False, True):
            c.add_metric([str(simulated).lower()], spent.get(simulated, 0.0))
        yield c


def _device_seconds(session: Session) -> dict[bool, float]:
    """Device-seconds of every trial, real (False) apart from simulated (True). The simulate backend
    reports the device time of the run it models; summed with real time it made a simulated sweep of
    a 64-device model read as hundreds of device-hours spent (store.total_device_seconds sums both)."""
    rows = session.execute(
        sa.select(store.Trial.simulated, sa.func.coalesce(sa.func.sum(store.Trial.device_seconds), 0.0))
        .group_by(store.Trial.simulated)
    ).all()
    out: dict[bool, float] = {}
    for simulated, seconds in rows:
        out[bool(simulated)] = out.get(bool(simulated), 0.0) + float(seconds or 0.0)
    return out


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
