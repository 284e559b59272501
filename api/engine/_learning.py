"""What each outcome teaches the sweep (``Learning``, one of the loop's collaborators): the sampler
is told every result, failures as infeasible, the cluster's failures not at all (api/engine/_lost.py);
the memory model and the calibration learn from the measurements; the host's noise is pooled over
repeats; earlier sweeps on the same cluster fingerprint (or those the spec's ``search.learn_from``
names) seed the model, which the sweep's own first measurements re-check (api.engine._recheck): what
they contradict is dropped, and the calibration's notes say so.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import numpy as np

from api import store
from api.engine import _learned, _recheck
from api.engine._context import LoopContext
from api.engine._lost import infra_of
from api.engine._surrogate import SurrogateProposer
from tuner import ClusterSpec, Layout, cluster_spec, pooled_noise

log = logging.getLogger("meshtune.engine")


def hardware(section: Any) -> ClusterSpec | None:
    """A sweep's cluster section as hardware: resolved (a preset name and the mapping it expands to
    are one cluster), the price left out (it changes no measurement); None if it no longer parses."""
    try:
        return dataclasses.replace(cluster_spec(section), price_per_device_hour=None)
    except (ValueError, TypeError):
        return None


def _sweeps(ids: list[int]) -> str:
    return ("sweep " if len(ids) == 1 else "sweeps ") + ", ".join(f"#{i}" for i in ids)


def _contradiction(what: str, measured: str, source: tuple[int, dict[str, Any]], hit: tuple[int, float]) -> str:
    """The note of an inherited model the sweep's own measurements contradict (api.engine._recheck)."""
    (sweep_id, evidence), (k, ratio) = source, hit
    return (f"inherited {what} of sweep #{sweep_id} (fitted on {evidence['n']} measurements) dropped with the rest "
            f"of its learning: it predicted {ratio:.2f}x the {measured} of this sweep's first {k} "
            f"measurement{'s' if k != 1 else ''}, beyond its uncertainty of {math.expm1(evidence['sd']):.0%}")


class Learning:
    """Teaches the context's model and ``proposer`` (the sweep's sampler: api/engine/_space.py,
    api/engine/_surrogate.py) and stores the calibration; keeps the sweep's cluster fingerprint and
    what it inherited."""

    def __init__(self, ctx: LoopContext, proposer: Any) -> None:
        self.ctx = ctx
        self.proposer = proposer
        self.fingerprint: str | None = None  # the sweep's cluster, once a measurement names it
        self.inherited_fp: str | None = None  # the fingerprint whose sweeps it learned from
        self.earlier: list[dict[str, Any]] = []  # what was inherited, weighed (api.engine._recheck.weigh)

    def inherit(self) -> None:
        """Start from what earlier sweeps on this cluster learned (api.engine._learned), as the spec's
        ``search.learn_from`` says: auto (by fingerprint), none (nothing) or those sweeps only;
        weighed by the evidence behind each fit (api.engine._recheck)."""
        ctx = self.ctx
        self.earlier = []
        learn_from = ctx.spec.search.learn_from
        with ctx.sessions() as s:
            sweep = store.get_sweep(s, sweep_id=ctx.sweep_id)
            self.fingerprint = sweep.fingerprint
            if learn_from == "none":  # a cold sweep: no fingerprint is guessed, nothing is dropped later
                self.inherited_fp = None
                return
            listed = learn_from if isinstance(learn_from, list) else None
            if listed is not None:  # one fingerprint among them (api/sweeps/service.py check_learn_from)
                fp = next((sw.fingerprint for sw in (store.get_sweep(s, sweep_id=i) for i in listed)
                           if sw is not None and sw.fingerprint), None)
            else:
                mine = hardware((sweep.spec or {}).get("cluster"))
                fp = sweep.fingerprint or store.latest_fingerprint(
                    s, backend=ctx.spec.backend, same_cluster=lambda c: mine is not None and hardware(c) == mine,
                    before_id=ctx.sweep_id)
            self.inherited_fp = fp
            if fp is not None:
                self._take(s, fp, listed)

    def _take(self, session: Any, fp: str, listed: list[int] | None) -> None:
        problem = self.ctx.problem
        scaler = SurrogateProposer(problem.space, problem=problem, seed=0).scaled
        self.earlier = _recheck.weigh(_learned.earlier(session, fingerprint=fp, sweep_id=self.ctx.sweep_id,
                                                       scaled=scaler, probe_id=problem.probe_id, sweep_ids=listed))
        problem.inherit(self.earlier)

    def note_fingerprint(self, row: store.Trial) -> None:
        """The first measurement names the sweep's cluster; a wrong provisional guess is undone."""
        ctx = self.ctx
        fp = _learned.fingerprint(row.env, ctx.spec.backend)
        if fp is None or self.fingerprint is not None:
            return
        self.fingerprint = fp
        with store.session_scope(ctx.sessions) as s:
            store.set_fingerprint(s, sweep_id=ctx.sweep_id, fingerprint=fp)
        if fp != self.inherited_fp and ctx.problem.learned_from:
            log.info("sweep %s: cluster fingerprint %s differs from the provisional %s; inherited learning dropped",
                     ctx.sweep_id, fp, self.inherited_fp)
            self._drop_inherited(f"inherited learning from {_sweeps(ctx.problem.learned_from)} dropped: this "
                                 f"sweep's first measurement has another cluster fingerprint ({fp}, not "
                                 f"{self.inherited_fp})")
            self.inherited_fp = fp
            listed = ctx.spec.search.learn_from
            if not isinstance(listed, list):  # auto: the sweeps of the real fingerprint; listed ones were the user's
                with ctx.sessions() as s:
                    self._take(s, fp, None)
            self.save_calibration()

    def recheck_inherited(self) -> bool:
        """Drop the inherited learning when the sweep's own first search measurements contradict its
        time or memory model beyond the uncertainty its evidence allows (api.engine._recheck); the
        calibration's notes say which, from which sweep, and by how much. Returns whether it dropped
        it (the caller stores the calibration). A function of the recorded rows: a resume decides alike."""
        p = self.ctx.problem
        if not p.learned_from or not self.earlier:
            return False
        first = sorted((t for t in self.ctx.trials() if t.phase == "search" and t.status in ("completed", "oom")),
                       key=lambda t: t.number)[:_recheck.RECHECK_TRIALS]
        mem = _recheck.source(self.earlier, "memory", p.inherited_mem_w)
        if mem is not None:
            pred, measured, lower = [], [], []
            for t in first:
                known = p.peaks.get(t.layout_key) if t.status == "completed" else None
                if known is not None:  # the peak as the memory model compares it (SweepModel.observe)
                    mparts, peak = known
                elif t.status == "oom":
                    mparts, peak = p.parts(Layout(**t.layout))[1], float(p.cluster.device_memory)
                else:
                    continue
                pred.append(float(np.dot(mparts, p.inherited_mem_w)))
                measured.append(float(peak))
                lower.append(t.status == "oom")
            hit = _recheck.contradicted(pred, measured, mem[1]["sd"], lower)
            if hit is not None:
                return self._drop_inherited(_contradiction("memory model", "peaks", mem, hit))
        tim = _recheck.source(self.earlier, "time", p.inherited_time_w)
        if tim is not None:
            done = [t for t in first if t.status == "completed" and t.step_time_s]
            pred = [float(np.dot(p.parts(Layout(**t.layout))[0], p.inherited_time_w)) for t in done]
            hit = _recheck.contradicted(pred, [float(t.step_time_s) for t in done], tim[1]["sd"])
            if hit is not None:
                return self._drop_inherited(_contradiction("time model", "step times", tim, hit))
        return False

    def _drop_inherited(self, note: str) -> bool:
        problem = self.ctx.problem
        log.info("sweep %s: %s", self.ctx.sweep_id, note)
        problem.forget_inherited()
        self.earlier = []
        notes = [n for n in problem.calibration.get("notes", []) if n != note]
        problem.calibration = {**problem.calibration, "notes": [*notes, note]}
        return True

    def update_noise(self) -> None:
        """The host's run-to-run noise, pooled over every repeated layout (tuner._stats)."""
        noise = pooled_noise(self._groups())
        self.ctx.problem.noise_sigma = noise.sigma if noise is not None else None

    def _groups(self) -> dict[str, list[float]]:
        groups: dict[str, list[float]] = {}
        for t in self.ctx.trials():  # a confirm run is a longer run, not a repeat of the short ones
            if t.status == "completed" and t.tokens_per_s_per_device is not None and t.phase != "confirm":
                groups.setdefault(t.layout_key, []).append(t.tokens_per_s_per_device)
        return groups

    def teach(self, layout: Layout, handle: Any, row: store.Trial) -> None:
        """``tell`` every outcome but the cluster's failures (docs/engine.md#lost-nodes)."""
        if infra_of(row) is None:
            self.tell(layout, handle, row)
        elif handle is not None:  # an asked Optuna trial must end: FAIL, which its samplers ignore
            self.proposer.tell(layout, handle, values=None, violation=0.0, status=row.status)

    def tell(self, layout: Layout, handle: Any, row: store.Trial) -> None:
        """Every outcome teaches the sampler: a failure (oom, timeout, crash, nan, pruned) is told as
        infeasible with its cost (zero throughput, a positive constraint violation), never as Optuna's
        FAIL, which TPE and GP ignore; the surrogate also keeps it as a failure near which it
        proposes less."""
        device_memory = self.ctx.problem.cluster.device_memory
        if row.status == "completed":
            values = [row.tokens_per_s_per_device or 0.0, float(row.peak_memory_bytes or 0)]
            self.proposer.tell(layout, handle, values=values, violation=0.0, status=row.status)
            return
        peak = row.predicted_memory_bytes if row.status == "pruned" else row.peak_memory_bytes
        peak = peak or 2 * device_memory
        violation = max(peak / device_memory - 1.0, 1e-3) if row.status in ("oom", "pruned") else 1.0
        self.proposer.tell(layout, handle, values=[0.0, float(max(peak, device_memory))], violation=violation,
                           status=row.status)

    def maybe_calibrate(self) -> bool:
        """Re-fit the calibration from the search's completed rows when due; True when it did (and stored it)."""
        rows = [t for t in self.ctx.trials() if t.phase == "search" and t.status == "completed" and t.step_time_s]
        if self.ctx.problem.maybe_calibrate(rows) is None:
            return False
        self.save_calibration()
        return True

    def save_calibration(self) -> None:
        calibration = dict(self.ctx.problem.calibration)
        noise = pooled_noise(self._groups())
        calibration["noise"] = dataclasses.asdict(noise) if noise is not None else None
        learned = getattr(self.proposer, "learned", None)
        programs = learned() if callable(learned) else None
        if programs:  # the surrogate's per-program weights: what a later sweep on this cluster starts from
            calibration["programs"] = programs
        with store.session_scope(self.ctx.sessions) as s:
            store.set_calibration(s, sweep_id=self.ctx.sweep_id, calibration=calibration)
