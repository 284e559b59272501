"""Measure the cluster before modelling it (mixed into SweepLoop): before its first trial a sweep
takes the whole cluster from the ledger and uses the stored probe of this cluster, model and
environment, or runs one on the trials' own gang (api/probes/service.py). The prior, the memory
model, the warm start and every prediction then read the probed figures (tuner/_probe.py); what
earlier sweeps learned is kept only from those that modelled the same probe. A backend that cannot
probe (simulate, a plug-in without ``run_program``) or a probe that fails leaves the datasheet's
figures, and the calibration says why. A resumed sweep keeps the probe it started with.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

from api.probes import service as probes
from tuner import BackendError

if TYPE_CHECKING:
    from api.engine._runner import SweepRunner

log = logging.getLogger("meshtune.engine")


class Probing:
    """Reads the loop's ``r``, ``sweep_id``, ``spec``, ``problem``, ``backend``, ``ledger``, ``held``."""

    r: SweepRunner
    sweep_id: int
    spec: Any
    problem: Any
    backend: Any
    warm: list[Any]
    seen: set[str]

    def _probe_cluster(self) -> None:
        if "probe" in self.problem.calibration:  # resumed: the figures it started from (Problem.load)
            return
        if self.r.settings.probe == "off" or self.spec.backend == "simulate":  # the datasheet: nothing to say
            return  # (simulate answers from the datasheet's model: it measures nothing)
        before = self.problem.probe_id
        if not callable(getattr(self.backend, "run_program", None)):
            self._use_probe(None, f"datasheet figures: backend {self.spec.backend!r} runs no probe")
            return
        world = self.problem.cluster.devices
        while not self._take_devices(world):  # the whole cluster, as a trial takes it: nothing runs beside it
            if self.stop.is_set():
                return
            self.ledger.wait_change(0.5)
        try:
            outcome = self._while_beating(lambda: probes.ensure(
                self.r.sessions, self.backend, model=self.problem.model, cluster=self.problem.cluster,
                training=self.problem.training, layouts=self.problem.space.layouts, workload=self.spec.workload,
                trial_id=f"{self.sweep_id}-probe"))
        except BackendError as exc:  # ProbeError, or the backend refusing: one line, the datasheet stands
            log.warning("sweep %s: %s", self.sweep_id, exc)
            self._use_probe(None, f"datasheet figures: {exc}")
            return
        finally:
            self.ledger.withdraw(self.sweep_id)
            self.ledger.release(self.held)
            self.held, self.waiting = None, False
        log.info("sweep %s: probe #%s %s", self.sweep_id, outcome.row.id, "reused" if outcome.reused else "measured")
        self._use_probe(probes.record_of(outcome, self.problem.cluster), None)
        if self.problem.probe_id != before:
            # What earlier sweeps fitted is relative to the figures they modelled: start again from
            # the sweeps that modelled this probe (api.engine._learned.earlier filters by it).
            if self.problem.learned_from:
                self.problem.forget_inherited()
            self._inherit()

    def _while_beating(self, call: Any) -> Any:
        """``call()`` on a helper thread while this one keeps the sweep's claim and the devices' leases
        alive (a probe takes up to a minute; both expire after tens of seconds without a beat)."""
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"probe{self.sweep_id}") as pool:
            future = pool.submit(call)
            while True:
                try:
                    return future.result(timeout=1.0)
                except FutureTimeout:
                    self._beat()
                    self.ledger.flush()  # the member beat keeps this coordinator's leases alive

    def _use_probe(self, record: dict[str, Any] | None, note: str | None) -> None:
        self.problem.use_probe(record, note=note)
        self._save_calibration()
        if self.warm and not self.problem.listed:  # the warm start is the probed model's top layouts
            self.warm = [(lay, src) for lay, src in self.problem.warm_start(self.search) if lay.key not in self.seen]
