"""What each outcome teaches the sweep (mixed into SweepLoop): the sampler is told every result,
failures as infeasible; the memory model and the calibration learn from the measurements; the host's
noise is pooled over repeats; earlier sweeps on the same cluster fingerprint seed the model.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from api import store
from api.engine import _learned
from api.engine._surrogate import SurrogateProposer
from tuner import ClusterSpec, Layout, cluster_spec, pooled_noise

if TYPE_CHECKING:
    from api.engine._runner import SweepRunner

log = logging.getLogger("meshtune.engine")


def hardware(section: Any) -> ClusterSpec | None:
    """A sweep's cluster section as hardware: resolved (a preset name and the mapping it expands to
    are one cluster), the price left out (it changes no measurement); None if it no longer parses."""
    try:
        return dataclasses.replace(cluster_spec(section), price_per_device_hour=None)
    except (ValueError, TypeError):
        return None


class Learning:
    """Reads the loop's ``r``, ``sweep_id``, ``spec``, ``problem``, ``proposer`` (set by SweepLoop)."""

    r: SweepRunner
    sweep_id: int
    spec: Any
    problem: Any
    proposer: Any
    fingerprint: str | None
    inherited_fp: str | None
    _rows: Callable[[], list[store.Trial]]  # SweepLoop's

    def _inherit(self) -> None:
        """Start from what earlier sweeps on this cluster fingerprint learned (api.engine._learned)."""
        with self.r.sessions() as s:
            sweep = store.get_sweep(s, sweep_id=self.sweep_id)
            self.fingerprint = sweep.fingerprint
            mine = hardware((sweep.spec or {}).get("cluster"))
            fp = sweep.fingerprint or store.latest_fingerprint(
                s, backend=self.spec.backend, same_cluster=lambda c: mine is not None and hardware(c) == mine,
                before_id=self.sweep_id)
            self.inherited_fp = fp
            if fp is not None:
                scaler = SurrogateProposer(self.problem.space, problem=self.problem, seed=0).scaled
                self.problem.inherit(_learned.earlier(s, fingerprint=fp, sweep_id=self.sweep_id, scaled=scaler,
                                                     probe_id=self.problem.probe_id))

    def _note_fingerprint(self, row: store.Trial) -> None:
        """The first measurement names the sweep's cluster; a wrong provisional guess is undone."""
        fp = _learned.fingerprint(row.env, self.spec.backend)
        if fp is None or self.fingerprint is not None:
            return
        self.fingerprint = fp
        with store.session_scope(self.r.sessions) as s:
            store.set_fingerprint(s, sweep_id=self.sweep_id, fingerprint=fp)
        if fp != self.inherited_fp and self.problem.learned_from:
            log.info("sweep %s: cluster fingerprint %s differs from the provisional %s; inherited learning dropped",
                     self.sweep_id, fp, self.inherited_fp)
            self.problem.forget_inherited()
            self.inherited_fp = fp
            with self.r.sessions() as s:
                scaler = SurrogateProposer(self.problem.space, problem=self.problem, seed=0).scaled
                self.problem.inherit(_learned.earlier(s, fingerprint=fp, sweep_id=self.sweep_id, scaled=scaler,
                                                     probe_id=self.problem.probe_id))

    def _update_noise(self) -> None:
        """The host's run-to-run noise, pooled over every repeated layout (tuner._stats)."""
        noise = pooled_noise(self._groups())
        self.problem.noise_sigma = noise.sigma if noise is not None else None

    def _groups(self) -> dict[str, list[float]]:
        groups: dict[str, list[float]] = {}
        for t in self._rows():  # a confirm run is a longer run, not a repeat of the short ones
            if t.status == "completed" and t.tokens_per_s_per_device is not None and t.phase != "confirm":
                groups.setdefault(t.layout_key, []).append(t.tokens_per_s_per_device)
        return groups

    def _tell(self, layout: Layout, handle: Any, row: store.Trial) -> None:
        """Every outcome teaches the sampler: a failure (oom, timeout, crash, nan, pruned) is told as
        infeasible with its cost (zero throughput, a positive constraint violation), never as Optuna's
        FAIL, which TPE and GP ignore; the surrogate also keeps it as a failure near which it
        proposes less."""
        device_memory = self.problem.cluster.device_memory
        if row.status == "completed":
            values = [row.tokens_per_s_per_device or 0.0, float(row.peak_memory_bytes or 0)]
            self.proposer.tell(layout, handle, values=values, violation=0.0, status=row.status)
            return
        peak = row.predicted_memory_bytes if row.status == "pruned" else row.peak_memory_bytes
        peak = peak or 2 * device_memory
        violation = max(peak / device_memory - 1.0, 1e-3) if row.status in ("oom", "pruned") else 1.0
        self.proposer.tell(layout, handle, values=[0.0, float(max(peak, device_memory))], violation=violation,
                           status=row.status)

    def _maybe_calibrate(self) -> bool:
        rows = [t for t in self._rows() if t.phase == "search" and t.status == "completed" and t.step_time_s]
        if self.problem.maybe_calibrate(rows) is None:
            return False
        self._save_calibration()
        return True

    def _save_calibration(self) -> None:
        calibration = dict(self.problem.calibration)
        noise = pooled_noise(self._groups())
        calibration["noise"] = dataclasses.asdict(noise) if noise is not None else None
        learned = getattr(self.proposer, "learned", None)
        programs = learned() if callable(learned) else None
        if programs:  # the surrogate's per-program weights: what a later sweep on this cluster starts from
            calibration["programs"] = programs
        with store.session_scope(self.r.sessions) as s:
            store.set_calibration(s, sweep_id=self.sweep_id, calibration=calibration)
