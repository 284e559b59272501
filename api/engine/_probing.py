"""Measure the cluster before modelling it (``Probing``, one of the loop's collaborators): before its
first trial a sweep takes the whole cluster from the ledger and uses the stored probe of this cluster,
model and environment, or runs one on the trials' own gang (api/probes/service.py). The prior, the
memory model, the warm start and every prediction then read the probed figures (tuner/_probe.py);
what earlier sweeps learned is kept only from those that modelled the same probe. A backend that
cannot probe (simulate, a plug-in without ``run_program``) or a probe that fails leaves the
datasheet's figures, and the calibration says why. A resumed sweep keeps the probe it started with.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from api.engine._claim import Claim
from api.engine._context import LoopContext
from api.engine._learning import Learning
from api.engine._share import Sharing
from api.probes import service as probes
from tuner import BackendError

log = logging.getLogger("meshtune.engine")


class Probing:
    """Probes ``backend`` with the whole cluster taken through ``sharing``, keeping ``claim`` beaten
    meanwhile; gives the figures to the context's model and has ``learning`` store them and inherit
    again. ``mode``: the coordinator's ``probe`` setting ("off": the datasheet's figures)."""

    def __init__(self, ctx: LoopContext, *, claim: Claim, sharing: Sharing, learning: Learning, backend: Any,
                 mode: str) -> None:
        self.ctx = ctx
        self.claim = claim
        self.sharing = sharing
        self.learning = learning
        self.backend = backend
        self.mode = mode

    def probe(self, warm: list[Any]) -> list[Any]:
        """Before any trial. Returns the warm start (``warm``: the layouts still to launch first),
        re-ranked by the probed model when one is used."""
        ctx, problem = self.ctx, self.ctx.problem
        if "probe" in problem.calibration:  # resumed: the figures it started from (SweepModel.load)
            return warm
        if self.mode == "off" or ctx.spec.backend == "simulate":  # the datasheet: nothing to say
            return warm  # (simulate answers from the datasheet's model: it measures nothing)
        before = problem.probe_id
        if not callable(getattr(self.backend, "run_program", None)):
            return self._use_probe(None, f"datasheet figures: backend {ctx.spec.backend!r} runs no probe", warm)
        world = problem.cluster.devices
        while not self.sharing.take_devices(world):  # the whole cluster, as a trial takes it: nothing runs beside it
            if ctx.stop.is_set():
                return warm
            self.sharing.ledger.wait_change(0.5)
        try:
            outcome = self._while_beating(lambda: probes.ensure(
                ctx.sessions, self.backend, model=problem.model, cluster=problem.cluster,
                training=problem.training, layouts=problem.space.layouts, workload=ctx.spec.workload,
                trial_id=f"{ctx.sweep_id}-probe"))
        except BackendError as exc:  # ProbeError, or the backend refusing: one line, the datasheet stands
            log.warning("sweep %s: %s", ctx.sweep_id, exc)
            return self._use_probe(None, f"datasheet figures: {exc}", warm)
        finally:
            self.sharing.let_go()
        log.info("sweep %s: probe #%s %s", ctx.sweep_id, outcome.row.id, "reused" if outcome.reused else "measured")
        warm = self._use_probe(probes.record_of(outcome, problem.cluster), None, warm)
        if problem.probe_id != before:
            # What earlier sweeps fitted is relative to the figures they modelled: start again from
            # the sweeps that modelled this probe (api.engine._learned.earlier filters by it).
            if problem.learned_from:
                problem.forget_inherited()
            self.learning.inherit()
        return warm

    def _while_beating(self, call: Any) -> Any:
        """``call()`` on a helper thread while this one keeps the sweep's claim and the devices' leases
        alive (a probe takes up to a minute; both expire after tens of seconds without a beat)."""
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"probe{self.ctx.sweep_id}") as pool:
            future = pool.submit(call)
            while True:
                try:
                    return future.result(timeout=1.0)
                except FutureTimeout:
                    self.claim.beat()
                    self.sharing.ledger.flush()  # the member beat keeps this coordinator's leases alive

    def _use_probe(self, record: dict[str, Any] | None, note: str | None, warm: list[Any]) -> list[Any]:
        problem = self.ctx.problem
        problem.use_probe(record, note=note)
        self.learning.save_calibration()
        if warm and not problem.listed:  # the warm start is the probed model's top layouts
            warm = [(lay, src) for lay, src in problem.warm_start(self.ctx.search) if lay.key not in self.ctx.seen]
        return warm
