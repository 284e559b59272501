"""A sweep's problem as the engine sees it: the valid layouts, the analytical predictions used for
pruning and warm start, and the calibration fitted from the sweep's own measurements.

Calibration: once a sweep has measured step times, the time model's compute and bandwidth efficiency
factors (tuner.CalibrationFactors) are fitted to them (tuner._stats.fit_calibration) and a memory
scale (median measured/predicted peak, clipped to [0.5, 2]) is taken from real memory measurements.
Both are stored on the sweep and used for every later prediction and pruning decision in it.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from dataclasses import dataclass
from typing import Any

import tuner
from api.engine._space import LayoutSpace
from api.spec import SearchSettings, SweepSpec
from tuner import ClusterSpec, Layout, ModelSpec, SpecError, TrainingSpec
from tuner._stats import fit_calibration

FITTED_FACTORS = ("compute_efficiency", "intra_bw_efficiency", "inter_bw_efficiency")
REFIT_AT = (2, 3, 5, 8, 12, 20, 30, 50, 80, 130, 200)  # refit as measurements accumulate
MAX_FIT_SAMPLES = 40
log = logging.getLogger("meshtune.engine")


@dataclass(frozen=True)
class Prediction:
    memory_bytes: int
    step_time_s: float | None
    tokens_per_s_per_device: float | None
    useful_fraction: float | None
    fits: bool
    prune_cause: str | None

    def columns(self) -> dict[str, Any]:
        return {
            "predicted_memory_bytes": self.memory_bytes,
            "predicted_step_time_s": self.step_time_s,
            "predicted_tokens_per_s_per_device": self.tokens_per_s_per_device,
            "useful_fraction": self.useful_fraction,
        }


def no_valid_layout_message(rejected: dict[str, int], space_fields: dict[str, Any] | None) -> str:
    """Why a search space is empty: the restricting ``space.<field>`` values, then the most common
    rejection reason (and the others with their counts)."""
    reasons = sorted(rejected.items(), key=lambda kv: (-kv[1], kv[0]))
    where = ", ".join(f"space.{k}={v!r}" for k, v in sorted((space_fields or {}).items()))
    head = f"{where}: " if where else "space: "
    top = f"; top rejection reason: {reasons[0][0]} ({reasons[0][1]} of {sum(rejected.values())} layouts)" if reasons else ""
    rest = ", ".join(f"{k}: {v}" for k, v in reasons[1:])
    return (f"{head}the search space leaves no valid layout for this model and cluster{top}"
            + (f" (also: {rest})" if rest else ""))


def check_runnable(spec: SweepSpec) -> None:
    """What a sweep needs before it is stored (SpecError naming the field and value otherwise): at
    least one valid layout in its space, and a backend that resolves. "ray" and "simulate" resolve by
    name (nothing is started); a ``module:attr`` backend is imported and its attribute looked up."""
    Problem.from_spec(spec)
    check_backend(spec.backend)


def check_backend(name: str) -> None:
    from workers.backends import BUILTIN_BACKENDS, _resolve

    if name in BUILTIN_BACKENDS:
        return
    try:
        obj = _resolve(name)
    except tuner.BackendError as exc:
        raise SpecError(str(exc)) from None  # names backend= and the value
    except Exception as exc:  # the module raised while importing: still the user's backend
        raise SpecError(f"backend={name!r} cannot be used: importing it raised {type(exc).__name__}: {exc}") from None
    if not (callable(obj) or callable(getattr(obj, "run", None))):
        raise SpecError(f"backend={name!r} resolves to a {type(obj).__name__}, not a backend class, factory or object")


class Problem:
    def __init__(
        self,
        model: ModelSpec,
        cluster: ClusterSpec,
        training: TrainingSpec,
        *,
        space: Any = None,
        calibration: dict[str, Any] | None = None,
        layouts: list[Layout] | None = None,
        space_fields: dict[str, Any] | None = None,
    ) -> None:
        self.model, self.cluster, self.training = model, cluster, training
        self.listed = layouts is not None  # search.layouts: exactly these, in this order
        if layouts is None:
            enumeration = tuner.enumerate_layouts(model=model, cluster=cluster, training=training, space=space)
            if not enumeration.valid:
                raise SpecError(no_valid_layout_message(enumeration.rejected, space_fields))
            layouts = enumeration.valid
        self.space = LayoutSpace(layouts, cluster.devices)
        self.factors = tuner.CalibrationFactors()
        self.memory_scale = 1.0
        self.calibration = calibration
        if calibration:
            self.factors = tuner.CalibrationFactors(**calibration.get("factors", {}))
            self.memory_scale = float(calibration.get("memory_scale", 1.0))
        self._fitted_at = calibration.get("n_time_samples", 0) if calibration else 0

    @classmethod
    def from_spec(cls, spec: SweepSpec, *, calibration: dict[str, Any] | None = None) -> Problem:
        model, cluster, training = spec.to_problem()
        return cls(model, cluster, training, space=spec.search_space(), calibration=calibration,
                   layouts=spec.listed_layouts(), space_fields=spec.space)

    def raw_memory_bytes(self, layout: Layout) -> int:
        """The memory model's peak per device for ``layout``, before the calibrated scale."""
        return int(tuner.estimate_memory(layout, model=self.model, cluster=self.cluster, training=self.training).total)

    def predict(self, layout: Layout) -> Prediction:
        mem = tuner.estimate_memory(layout, model=self.model, cluster=self.cluster, training=self.training)
        scaled = int(mem.total * self.memory_scale)
        if scaled > self.cluster.device_memory:
            scale = f" x calibrated scale {self.memory_scale:.2f}" if self.memory_scale != 1.0 else ""
            cause = (
                f"pruned by the memory model: predicted {mem.total} bytes{scale} per device exceeds "
                f"device_memory={self.cluster.device_memory}"
            )
            return Prediction(scaled, None, None, None, False, cause)
        est = tuner.estimate_time(layout, model=self.model, cluster=self.cluster, training=self.training,
                                  factors=self.factors)
        useful = est.useful_tokens_per_s / est.tokens_per_s if est.tokens_per_s else None
        return Prediction(scaled, est.step_time_s, est.tokens_per_s_per_device, useful, True, None)

    def warm_start(self, search: SearchSettings) -> list[tuple[Layout, str]]:
        """Reference layouts the user named, then the model's top-k predicted layouts that fit."""
        out: list[tuple[Layout, str]] = []
        refs = getattr(tuner, "REFERENCE_LAYOUTS", {})
        for i, name in enumerate(search.reference_layouts):
            ref = refs.get(name) if hasattr(refs, "get") else None
            layout = getattr(ref, "layout", ref)
            if isinstance(layout, dict):
                layout = Layout(**layout)
            if not isinstance(layout, Layout):
                raise SpecError(f"search.reference_layouts[{i}]={name!r} is not a known reference layout")
            layout = tuner.canonical_layout(layout, training=self.training)  # the space lists canonical twins
            if layout.key not in self.space.index:  # valid (checked on submission) but outside ``space``
                log.warning("reference layout %s (%s) is outside the sweep's space; not enqueued", name, layout.key)
                continue
            out.append((layout, "reference"))
        if search.warm_start_top_k > 0:
            scored = []
            for layout in self.space.layouts:
                p = self.predict(layout)
                if p.fits and p.tokens_per_s_per_device:
                    scored.append((-p.tokens_per_s_per_device, layout.key, layout))
            scored.sort(key=lambda x: (x[0], x[1]))
            out += [(lay, "warm_start") for _, _, lay in scored[: search.warm_start_top_k]]
        seen: set[str] = set()
        return [(lay, src) for lay, src in out if not (lay.key in seen or seen.add(lay.key))]

    def maybe_calibrate(self, completed: list[Any]) -> dict[str, Any] | None:
        """Refit from completed trial rows when their number reaches the next REFIT_AT mark; returns
        the calibration to store (and now uses it), or None when nothing changed."""
        n = len(completed)
        if n < REFIT_AT[0] or n <= self._fitted_at or (n not in REFIT_AT and n < REFIT_AT[-1]):
            return None
        if n >= REFIT_AT[-1] and n - self._fitted_at < 50:
            return None
        self._fitted_at = n
        recent = sorted(completed, key=lambda t: t.number)[-MAX_FIT_SAMPLES:]
        samples = [(Layout(**t.layout), t.step_time_s) for t in recent]

        def predict(layout: Layout, factors: Any) -> float:
            return tuner.estimate_time(layout, model=self.model, cluster=self.cluster, training=self.training,
                                       factors=factors).step_time_s

        base = tuner.CalibrationFactors()
        before = fit_calibration(samples, predict=predict, base=base, fields=())[1]
        factors, after = fit_calibration(samples, predict=predict, base=base, fields=FITTED_FACTORS)
        # Against the UNSCALED model: a row's stored prediction includes whatever scale was in force
        # when it was inserted, so measured/stored x current scale would compound across refits.
        real_mem = [
            t.peak_memory_bytes / raw
            for t in completed
            if not t.simulated and t.peak_memory_bytes and (raw := self.raw_memory_bytes(Layout(**t.layout)))
        ]
        self.factors = factors
        if real_mem:
            self.memory_scale = min(2.0, max(0.5, statistics.median(real_mem)))
        self.calibration = {
            "factors": dataclasses.asdict(factors),
            "fitted": list(FITTED_FACTORS),
            "n_time_samples": n,
            "rms_log_error_before": before,
            "rms_log_error_after": after,
            "memory_scale": self.memory_scale,
            "n_memory_samples": len(real_mem),
        }
        return self.calibration
