"""A sweep's model (``SweepModel``) over its ``tuner.Problem``: the valid layouts, the analytical
predictions used for pruning and warm start, and the calibration learned from measurements (the
sweep's own and those of earlier sweeps on the same cluster fingerprint).

Time and memory are weighted parts of the analytical model, each fit kept only when it does at least
as well as the prior on held-out measurements (api.engine._calibrate); memory is corrected layout by
layout (api.engine._memory), an OOM a lower bound, never a global scale. When no unseen layout is
predicted to fit, ``fallback`` names the one most likely to. Every change bumps
``calibration["version"]``. The design: docs/engine.md#calibration, docs/engine.md#memory-model.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from typing import Any

import numpy as np

import tuner
from api.engine import _calibrate as cal
from api.engine._memory import MEMORY_SIGMA, LocalMemory
from api.engine._prediction import PRIOR_MEM_W, PRIOR_TIME_W, Prediction, cluster_under
from api.engine._space import LayoutSpace, _features, knob_values
from api.engine._submission import enumerate_space
from api.spec import SearchSettings, SweepSpec
from tuner import Layout, SpecError

REFIT_AT = (2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 25, 30, 40, 50, 65, 80, 100, 130, 160, 200)
MAX_FIT_SAMPLES = 60
HEADROOM_Z = 1.645  # one-sided 95%: warm start launches what fits with this many memory errors to spare
log = logging.getLogger("meshtune.engine")


class SweepModel:
    """The sweep's model over a ``tuner.Problem``: its valid layouts (``space``), the analytical
    predictions and the calibration learned from measurements. ``layouts``: search.layouts, exactly
    these in this order; else the problem's enumeration (SpecError when it is empty)."""

    def __init__(
        self,
        problem: tuner.Problem,
        *,
        calibration: dict[str, Any] | None = None,
        layouts: list[Layout] | None = None,
        space_fields: dict[str, Any] | None = None,
    ) -> None:
        # The cluster is replaced by a probe's figures (use_probe, load); the problem's is the datasheet's.
        self.model, self.cluster, self.training = problem.model, problem.cluster, problem.training
        model, cluster, training = self.model, self.cluster, self.training
        self.listed = layouts is not None  # search.layouts: exactly these, in this order
        if layouts is None:
            # The enumeration keeps only what the problem's workload runs (``problem.capabilities``;
            # ``tuner.check_supported``, the check a listed layout passes).
            layouts = enumerate_space(problem, space_fields=space_fields).valid
        self.space = LayoutSpace(layouts, cluster.devices)
        raw = self.space._features  # scaled as the surrogate scales them: [0, 1] over the space
        self._feat_lo, span = raw.min(axis=0), np.ptp(raw, axis=0)
        self._feat_span = np.where(span > 0, span, 1.0)
        self._x = (raw - self._feat_lo) / self._feat_span
        self.tokens = training.global_batch * model.seq_len
        self.time_w, self.mem_w = PRIOR_TIME_W.copy(), PRIOR_MEM_W.copy()
        self.inherited_time_w: np.ndarray | None = None
        self.inherited_mem_w: np.ndarray | None = None
        self.memory_sigma = MEMORY_SIGMA
        self.noise_sigma: float | None = None
        self.inherited_residuals: list[tuple[np.ndarray, float]] = []
        self.inherited_programs: dict[str, Any] | None = None  # an earlier sweep's per-program weights
        self.learned_from: list[int] = []
        self.ooms: dict[str, tuple[list[float], float]] = {}  # layout key -> (memory parts, bytes it needed at least)
        self.peaks: dict[str, tuple[list[float], float]] = {}  # layout key -> (memory parts, measured peak)
        self._where: dict[str, np.ndarray] = {}  # layout key -> its scaled features (measured ones)
        self._local: tuple[int, LocalMemory] | None = None  # (version, the GP fitted under it)
        self._memory_all: tuple[int, dict[str, np.ndarray]] | None = None  # every layout's, under a version
        self._arrays: tuple[np.ndarray, np.ndarray, float] | None = None
        self.calibration: dict[str, Any] = {"version": 0}
        self._fitted_at = 0
        if calibration:
            self.load(calibration)

    @classmethod
    def from_spec(cls, spec: SweepSpec, *, calibration: dict[str, Any] | None = None) -> SweepModel:
        return cls(spec.to_problem(), calibration=calibration, layouts=spec.listed_layouts(),
                   space_fields=spec.space)

    @property
    def version(self) -> int:
        return int(self.calibration.get("version", 0))

    def load(self, calibration: dict[str, Any]) -> None:
        """Resume under a stored calibration (the measurements are replayed through ``observe``)."""
        self.calibration = dict(calibration)
        self.cluster = cluster_under(calibration, self.cluster)  # the probed figures it started from
        if "time" in calibration:
            self.time_w = np.array([calibration["time"]["weights"][k] for k in cal.TIME_PARTS])
            self._fitted_at = int(calibration["time"].get("n", 0))
        if "memory" in calibration:
            self.mem_w = np.array([calibration["memory"]["weights"][k] for k in cal.MEMORY_PARTS])
        self.memory_sigma = float(calibration.get("memory_sigma", MEMORY_SIGMA))
        self.learned_from = list(calibration.get("learned_from", []))

    def use_probe(self, record: dict[str, Any] | None, *, note: str | None = None) -> dict[str, Any]:
        """Model the cluster with a probe's figures (``record``: api/probes/service.py ``record_of``),
        or say why it is modelled from the datasheet (``record=None`` and ``note``): the prior, the
        memory model and every prediction from now on read them. Returns the calibration to store."""
        if record is None:  # the datasheet's figures stay: no prediction changes, no new version
            self.calibration = {**self.calibration, "probe": {"figures": None, "note": note}}
            return self.calibration
        self.cluster = cluster_under({"probe": record}, dataclasses.replace(self.cluster, probed=None))
        self._arrays = None  # every layout's parts again, under the new figures
        return self._store(probe=record)

    @property
    def probe_id(self) -> int | None:
        return (self.calibration.get("probe") or {}).get("id")

    # --- the analytical model's parts --------------------------------------------------------------

    def _layout_parts(self, layout: Layout) -> tuple[list[float], list[float], float]:
        return self._layout_parts_full(layout)[:3]

    def _layout_parts_full(self, layout: Layout) -> tuple[list[float], list[float], float, list[float]]:
        est = tuner.estimate_time(layout, model=self.model, cluster=self.cluster, training=self.training)
        mem = tuner.estimate_memory(layout, model=self.model, cluster=self.cluster, training=self.training)
        useful = est.useful_tokens_per_s / est.tokens_per_s if est.tokens_per_s else None
        return cal.time_parts(est.breakdown), cal.memory_parts(mem), useful, cal.program_parts(est.breakdown, layout)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Time and memory parts of every layout of the space (computed once: ~30 us a layout)."""
        if self._arrays is None:
            rows = [self._layout_parts_full(lay) for lay in self.space.layouts]
            self._arrays = (np.array([r[0] for r in rows]), np.array([r[1] for r in rows]), rows[0][2])
            self._programs = np.array([r[3] for r in rows])
        return self._arrays[0], self._arrays[1]

    def program_arrays(self) -> np.ndarray:
        """The step time's parts per collective program of every layout (api.engine._calibrate.PROGRAM_PARTS)."""
        self.arrays()
        return self._programs

    def parts(self, layout: Layout) -> tuple[list[float], list[float], float | None]:
        i = self.space.index.get(layout.key)
        if i is not None and self._arrays is not None:
            return list(self._arrays[0][i]), list(self._arrays[1][i]), self._arrays[2]
        return self._layout_parts(layout)

    def raw_memory_bytes(self, layout: Layout) -> int:
        """The memory model's peak per device for ``layout``, before calibration."""
        return int(tuner.estimate_memory(layout, model=self.model, cluster=self.cluster, training=self.training).total)

    # --- predictions -----------------------------------------------------------------------------

    def _scaled(self, layout: Layout) -> np.ndarray:
        i = self.space.index.get(layout.key)
        if i is not None:
            return self._x[i]
        dp = self.space.devices / max(1, layout.tp * layout.pp * layout.cp * layout.ep)
        return np.clip((np.array(_features(knob_values(layout), dp)) - self._feat_lo) / self._feat_span, -0.5, 1.5)

    def local_memory(self) -> LocalMemory:
        """The GP over log(true / weighted-parts memory), fitted under the calibration in force."""
        if self._local is None or self._local[0] != self.version:
            def base(parts: list[float]) -> float:
                return max(float(np.dot(parts, self.mem_w)), 1.0)
            peaks = [(self._where[k], base(p), b) for k, (p, b) in sorted(self.peaks.items())]
            ooms = [(self._where[k], base(p), b, np.asarray(p, dtype=float))
                    for k, (p, b) in sorted(self.ooms.items())]
            self._local = (self.version, LocalMemory(self._x.shape[1], len(cal.MEMORY_PARTS), peaks, ooms))
        return self._local[1]

    def _memory_of(self, layout: Layout, mparts: list[float]) -> tuple[int, bool]:
        """(predicted bytes, whether it fits) for one layout."""
        i = self.space.index.get(layout.key)
        if i is not None and self._arrays is not None:
            m = self.memory_arrays()
            return int(m["bytes"][i]), bool(m["fits"][i])
        local = self.local_memory()
        mu, _ = local.query(self._scaled(layout)[None, :])
        memory = int(self._bytes(np.array([mparts]), mu)[0])
        if layout.key in self.ooms:
            memory = max(memory, math.ceil(self.ooms[layout.key][1]))
        dominated = bool(local.dominated(np.array([mparts], dtype=float))[0])
        return memory, memory <= self.cluster.device_memory and not dominated and layout.key not in self.ooms

    def _bytes(self, mparts: np.ndarray, mu: np.ndarray) -> np.ndarray:
        # bytes, up: a bound raised to the device's memory stays reached
        return np.ceil(np.maximum(mparts @ self.mem_w, 1.0) * np.exp(mu)).astype(np.int64)

    def memory_arrays(self) -> dict[str, np.ndarray]:
        """Every layout's predicted bytes ("bytes"), the sd of its log ("sd") and whether it fits
        ("fits": predicted within the device's memory, not OOMed, needing less of some part than
        every OOMed layout), under the calibration in force (computed once per version)."""
        if self._memory_all is None or self._memory_all[0] != self.version:
            _, m = self.arrays()
            local = self.local_memory()
            mu, sd = local.query(self._x)
            memory = self._bytes(m, mu)
            out = np.zeros(len(m), bool)
            for key, (_, need) in self.ooms.items():
                i = self.space.index.get(key)
                if i is not None:
                    memory[i] = max(int(memory[i]), math.ceil(need))
                    out[i] = True
            out |= local.dominated(m)
            fits = (memory <= self.cluster.device_memory) & ~out
            self._memory_all = (self.version, {"bytes": memory, "sd": sd, "fits": fits, "ruled_out": out})
        return self._memory_all[1]

    def _why_not(self, layout: Layout, mparts: list[float]) -> str | None:
        if layout.key in self.ooms:
            return "pruned by the memory model: it ran out of memory in this sweep"
        parts = np.asarray(mparts, dtype=float)
        for key, (p, _) in sorted(self.ooms.items()):
            if np.all(parts >= np.asarray(p) * (1.0 - 1e-9)):
                return (f"pruned by the memory model: it needs at least as much of every memory part "
                        f"({', '.join(cal.MEMORY_PARTS)}) as {key}, which ran out of memory in this sweep")
        return None

    def predict(self, layout: Layout) -> Prediction:
        tparts, mparts, useful = self.parts(layout)
        memory, fits = self._memory_of(layout, mparts)
        step = float(np.dot(tparts, self.time_w))
        if not fits:
            calibrated = " (calibrated)" if self.version else ""
            cause = self._why_not(layout, mparts) or (f"pruned by the memory model: predicted {memory} bytes{calibrated} per device exceeds "
                            f"device_memory={self.cluster.device_memory}")
            return Prediction(memory, None, None, None, False, cause, self.version)
        tps = self.tokens / step / layout.world_size if step > 0 else None
        return Prediction(memory, step if step > 0 else None, tps, useful, True, None, self.version)

    def prior_log_tokens(self) -> np.ndarray:
        """log tokens/s per device of every layout under the calibration in force."""
        t, _ = self.arrays()
        step = t @ self.time_w
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(step > 0, np.log(self.tokens / self.cluster.devices / np.maximum(step, 1e-30)), np.nan)

    def memory_margin(self) -> tuple[np.ndarray, np.ndarray]:
        """(log(device_memory / predicted peak) of every layout, -inf where an OOM rules it out;
        the memory model's uncertainty at each layout in the same log units)."""
        m = self.memory_arrays()
        margin = np.log(self.cluster.device_memory / m["bytes"].astype(float))
        margin[m["ruled_out"]] = -np.inf
        return margin, m["sd"]

    def fallback(self, exclude: set[str]) -> Layout | None:
        """When no layout outside ``exclude`` is predicted to fit: the one most likely to (the
        highest probability of fitting, ties by predicted throughput); None when one is predicted to
        fit, or every layout was tried."""
        fits = self.memory_arrays()["fits"]
        unseen = np.ones(len(self.space), bool)
        for key in exclude:
            i = self.space.index.get(key)
            if i is not None:
                unseen[i] = False
        if not unseen.any() or (fits & unseen).any():
            return None
        return self.likeliest(exclude)

    def likeliest(self, exclude: set[str]) -> Layout | None:
        """The layout outside ``exclude`` most likely to fit (ties by predicted throughput); None
        when every layout was tried."""
        margin, sd = self.memory_margin()
        z = margin / np.maximum(sd, 1e-6)
        prior = np.nan_to_num(self.prior_log_tokens(), nan=-np.inf)
        for key in exclude:
            i = self.space.index.get(key)
            if i is not None:
                z[i] = np.nan
        ok = np.flatnonzero(~np.isnan(z))
        if not len(ok):
            return None
        best = ok[np.lexsort((prior[ok], z[ok]))[-1]]
        return self.space.layouts[int(best)]

    def warm_start(self, search: SearchSettings) -> list[tuple[Layout, str]]:
        """Reference layouts the user named, then the model's top-k predicted layouts that fit with
        ``HEADROOM_Z`` times the memory model's uncertainty at each to spare (no warm start into a layout the model barely fits)."""
        out: list[tuple[Layout, str]] = []
        for i, name in enumerate(search.reference_layouts):
            ref = tuner.REFERENCE_LAYOUTS.get(name)
            if ref is None:
                raise SpecError(f"search.reference_layouts[{i}]={name!r} is not a known reference layout")
            layout = tuner.canonical_layout(ref.layout, training=self.training)  # the space lists canonical twins
            if layout.key not in self.space.index:  # valid (checked on submission) but outside ``space``
                log.warning("reference layout %s (%s) is outside the sweep's space; not enqueued", name, layout.key)
                continue
            out.append((layout, "reference"))
        if search.warm_start_top_k > 0:
            prior = self.prior_log_tokens()
            margin, sd = self.memory_margin()
            ok = np.flatnonzero(np.isfinite(prior) & (margin >= HEADROOM_Z * sd))
            if not len(ok):  # nothing fits with that headroom: the plan's rule, room before tight ones
                ok = np.flatnonzero(np.isfinite(prior) & (margin >= -math.log1p(-tuner.MEMORY_HEADROOM)))
            if not len(ok):  # the ones that fit at all
                ok = np.flatnonzero(np.isfinite(prior) & (margin >= 0))
            keys = [self.space.layouts[i].key for i in ok]
            order = sorted(range(len(ok)), key=lambda j: (-prior[ok[j]], keys[j]))
            out += [(self.space.layouts[int(ok[j])], "warm_start") for j in order[: search.warm_start_top_k]]
        seen: set[str] = set()
        return [(lay, src) for lay, src in out if not (lay.key in seen or seen.add(lay.key))]

    # --- learning ----------------------------------------------------------------------------------

    def observe(self, row: Any) -> bool:
        """Learn a finished trial's memory: a peak (completed) or a lower bound (oom). Returns whether
        the memory model changed (then the caller stores ``self.calibration``)."""
        layout = Layout(**row.layout)
        self._where[layout.key] = self._scaled(layout)
        if row.status == "oom":
            # A lower bound, never the peak: it needed more than the device has, and CUDA names the
            # failing allocation, which came on top of what was in use (an OOM row's peak bytes: what
            # the backend saw allocated when it failed).
            requested = float((row.error or {}).get("bytes_requested") or 0)
            need = max(float(self.cluster.device_memory), float(row.peak_memory_bytes or 0) + requested)
            old = self.ooms.get(layout.key)
            self.ooms[layout.key] = (self.parts(layout)[1], max(need, old[1] if old else 0.0))
        elif row.status == "completed" and row.peak_memory_bytes:
            mparts = self.parts(layout)[1]
            peak = float(row.peak_memory_bytes)
            if getattr(row, "memory_measure", None) == "cuda.max_memory_allocated":
                # Like with like: torch's allocator counts tensors only, the prediction also carries the
                # fixed CUDA allowance (context, NCCL, workspaces; tuner OVERHEAD_BYTES): add it back.
                peak += mparts[cal.MEMORY_PARTS.index("overhead")]
            self.peaks[layout.key] = (mparts, peak)
        else:
            return False
        self._fit_memory()
        return True

    def _fit_memory(self) -> None:
        """Part weights from the measured peaks (the OOMs teach locally: api.engine._memory);
        ``memory_sigma``: the weights' held-out error, what the figures report (the headroom is
        the local GP's sd)."""
        parts = np.array([p for p, _ in self.peaks.values()]).reshape(-1, len(cal.MEMORY_PARTS))
        peaks = np.array([b for _, b in self.peaks.values()])
        prior = self.inherited_mem_w if self.inherited_mem_w is not None else PRIOR_MEM_W
        result = cal.judge_memory(parts, peaks, prior, n_oom=len(self.ooms))
        self.mem_w = np.array([result["weights"][k] for k in cal.MEMORY_PARTS])
        err = result["loo_rms_log_error"] if result["accepted"] else result["prior_rms_log_error"]
        sigma = err if err is not None and len(peaks) >= 3 else max(self.memory_sigma, MEMORY_SIGMA)
        self.memory_sigma = max(sigma, 0.01)
        self._store(memory=result, memory_sigma=self.memory_sigma)

    def maybe_calibrate(self, completed: list[Any]) -> dict[str, Any] | None:
        """Refit the time model when the completed search rows reach the next REFIT_AT mark; returns
        the calibration to store (now in force), or None when nothing was refitted."""
        n = len(completed)
        if n < REFIT_AT[0] or n <= self._fitted_at or (n not in REFIT_AT and n < REFIT_AT[-1]):
            return None
        if n >= REFIT_AT[-1] and n - self._fitted_at < 50:
            return None
        self._fitted_at = n
        recent = sorted(completed, key=lambda t: t.number)[-MAX_FIT_SAMPLES:]
        parts = np.array([self.parts(Layout(**t.layout))[0] for t in recent])
        measured = np.array([float(t.step_time_s) for t in recent])
        priors = {"analytical": PRIOR_TIME_W}
        if self.inherited_time_w is not None:
            priors["inherited"] = self.inherited_time_w
        result = cal.judge_time(parts, measured, priors)
        self.time_w = np.array([result["weights"][k] for k in cal.TIME_PARTS])
        return self._store(time=result)

    def inherit(self, earlier: list[dict[str, Any]]) -> None:
        """Start from what earlier sweeps on this cluster learned: ``earlier`` holds, per sweep, its id,
        calibration and (layout, residual) pairs (api.engine._learned)."""
        if not earlier:
            return
        self.learned_from = [e["sweep_id"] for e in earlier]
        times = [e["calibration"]["time"] for e in earlier if e["calibration"].get("time", {}).get("accepted")]
        if times:  # the newest accepted one; its per-step constant is another model's, so it is dropped
            w = np.array([times[0]["weights"][k] for k in cal.TIME_PARTS])
            w[-1] = 0.0
            self.inherited_time_w = w
            self.time_w = w.copy()
        mems = [e["calibration"] for e in earlier if e["calibration"].get("memory", {}).get("accepted")]
        if mems:
            self.inherited_mem_w = np.array([mems[0]["memory"]["weights"][k] for k in cal.MEMORY_PARTS])
            self.mem_w = self.inherited_mem_w.copy()
            self.memory_sigma = float(mems[0].get("memory_sigma", MEMORY_SIGMA))
        programs = [e["calibration"]["programs"] for e in earlier if (e["calibration"].get("programs") or {}).get("weights")]
        if programs:  # the surrogate's per-program weights of the newest sweep that fitted them
            self.inherited_programs = programs[0]
        for e in earlier:
            res = e["residuals"]
            if res:
                mean = statistics.fmean(r for _, r in res)
                self.inherited_residuals += [(x, r - mean) for x, r in res]
        self._store(learned_from=self.learned_from)

    def forget_inherited(self) -> None:
        """Drop what ``inherit`` took (the sweep turned out to run on another cluster)."""
        if self.inherited_time_w is not None and np.allclose(self.time_w, self.inherited_time_w):
            self.time_w = PRIOR_TIME_W.copy()
        self.inherited_time_w, self.inherited_mem_w = None, None
        self.inherited_residuals, self.learned_from, self.inherited_programs = [], [], None
        self.memory_sigma = MEMORY_SIGMA
        self._fit_memory()
        self._store(learned_from=[])

    def residuals(self, rows: list[Any]) -> list[tuple[Layout, float]]:
        """log(measured / predicted) tokens/s of completed rows under the calibration now in force."""
        out = []
        for t in rows:
            if t.status == "completed" and t.tokens_per_s_per_device:
                p = self.predict(Layout(**t.layout))
                if p.tokens_per_s_per_device:
                    out.append((Layout(**t.layout), math.log(t.tokens_per_s_per_device / p.tokens_per_s_per_device)))
        return out

    def _store(self, **sections: Any) -> dict[str, Any]:
        # "in_force": the weights every prediction of this version is made with (inherited ones
        # included, which no fit section records), so a reader can re-predict under it (predict_under).
        in_force = {"time": cal.named(self.time_w, cal.TIME_PARTS), "memory": cal.named(self.mem_w, cal.MEMORY_PARTS)}
        self.calibration = {**self.calibration, **sections, "in_force": in_force, "version": self.version + 1}
        return self.calibration
