"""The layout space a sweep searches, and the proposers that walk it.

Optuna sees a layout as a few categorical knobs with fixed choice sets (the union over the tuner's
valid layouts), dp derived from the device count. A sampled combination is projected onto the
nearest valid, not yet measured layout; Optuna's history only ever pairs real layouts with their
real outcome. ``grid`` and ``random`` walk the valid layouts without Optuna.

Why knobs, the projection and no Optuna grid: docs/engine.md#layout-space.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import numpy as np

from tuner import Layout

KNOBS = ("tp", "pp", "cp", "ep", "zero", "mbs", "ac", "sp", "sched")
AC_ORDER = {"none": 0.0, "selective": 1.0, "full": 2.0}
OBJECTIVES = {"single": ("maximize",), "nsga2": ("maximize", "minimize")}


def sched_of(layout: Layout) -> str:
    return f"interleaved{layout.vpp}" if layout.schedule == "interleaved" else layout.schedule


def knob_values(layout: Layout) -> dict[str, Any]:
    return {
        "tp": layout.tp, "pp": layout.pp, "cp": layout.cp, "ep": layout.ep, "zero": layout.zero,
        "mbs": layout.mbs, "ac": layout.ac, "sp": layout.sp, "sched": sched_of(layout),
    }


def _features(v: dict[str, Any], dp: float) -> list[float]:
    sched = str(v["sched"])
    return [
        math.log2(v["tp"]), math.log2(v["pp"]), math.log2(v["cp"]), math.log2(v["ep"]), math.log2(max(dp, 1e-9)),
        float(v["zero"]) / 2, math.log2(v["mbs"]), AC_ORDER[v["ac"]], float(bool(v["sp"])),
        {"gpipe": 0.0, "1f1b": 0.5}.get(sched, 1.0), math.log2(int(sched[11:])) if sched.startswith("interleaved") else 0.0,
    ]


class LayoutSpace:
    """The valid layouts of a sweep (tuner enumeration order), indexed by key, with knob choices."""

    def __init__(self, layouts: Sequence[Layout], devices: int) -> None:
        assert layouts, "a layout space needs at least one layout"
        self.layouts = list(layouts)
        self.devices = devices
        self.index = {lay.key: i for i, lay in enumerate(self.layouts)}
        # One key per distinct program: the enumeration and search.layouts give canonical layouts
        # (tuner.canonical_layout), so no two entries are twins and none is proposed twice.
        assert len(self.index) == len(self.layouts), "a layout space lists each layout once"
        values = [knob_values(lay) for lay in self.layouts]
        self.choices: dict[str, list[Any]] = {
            k: sorted({v[k] for v in values}, key=lambda x: (str(type(x)), x)) for k in KNOBS
        }
        self._features = np.array([_features(v, lay.dp) for v, lay in zip(values, self.layouts, strict=True)])
        # Each knob's value as an index into its choices: layouts a knob apart differ in one column.
        self.codes = np.array([[self.choices[k].index(v[k]) for k in KNOBS] for v in values], dtype=np.int16)

    def neighbours(self, i: int) -> np.ndarray:
        """Indices of the layouts that differ from layout ``i`` in exactly one knob (a Hamming distance
        of 1 over KNOBS; the data-parallel degree follows from the others)."""
        return np.flatnonzero((self.codes != self.codes[i]).sum(axis=1) == 1)

    def __len__(self) -> int:
        return len(self.layouts)

    def distributions(self) -> dict[str, Any]:
        from optuna.distributions import CategoricalDistribution

        return {k: CategoricalDistribution(c) for k, c in self.choices.items()}

    def params(self, layout: Layout) -> dict[str, Any]:
        return knob_values(layout)

    def nearest(self, params: dict[str, Any], exclude: set[str]) -> Layout | None:
        """The valid layout closest to ``params`` whose key is not in ``exclude`` (None if none left)."""
        dp = self.devices / (params["tp"] * params["pp"] * params["cp"] * params["ep"])
        target = np.array(_features(params, dp))
        dist = np.abs(self._features - target).sum(axis=1)
        for i in np.argsort(dist, kind="stable"):
            lay = self.layouts[int(i)]
            if lay.key not in exclude:
                return lay
        return None


class ListProposer:
    """``grid`` (enumeration order) or ``random`` (seeded shuffle): the next unseen layout."""

    def __init__(self, space: LayoutSpace, *, shuffle_seed: int | None) -> None:
        self.order = list(space.layouts)
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(self.order)
        self._pos = 0

    def propose(self, exclude: set[str]) -> tuple[Layout, Any] | None:
        while self._pos < len(self.order):
            lay = self.order[self._pos]
            self._pos += 1
            if lay.key not in exclude:
                return lay, None
        return None

    def tell(self, layout: Layout, handle: Any, *, values: Sequence[float] | None, violation: float,
             status: str | None = None) -> None:
        return None


class OptunaProposer:
    """An in-memory Optuna study over the knobs (tpe, gp, nsga2), rebuilt from the store on resume."""

    def __init__(self, space: LayoutSpace, *, sampler: str, seed: int, max_trials: int) -> None:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.space = space
        self.dists = space.distributions()
        self.multi = sampler == "nsga2"
        if sampler == "tpe":
            smp: Any = optuna.samplers.TPESampler(seed=seed, n_startup_trials=min(10, max(3, max_trials // 5)))
        elif sampler == "gp":
            smp = optuna.samplers.GPSampler(seed=seed, n_startup_trials=min(10, max(3, max_trials // 5)))
        elif sampler == "nsga2":
            smp = optuna.samplers.NSGAIISampler(seed=seed, population_size=min(50, max(8, max_trials // 3)))
        else:
            raise AssertionError(f"unexpected sampler {sampler!r}")
        self.study = optuna.create_study(
            sampler=smp, directions=list(OBJECTIVES["nsga2" if self.multi else "single"])
        )

    def propose(self, exclude: set[str]) -> tuple[Layout, Any] | None:
        from optuna.trial import TrialState

        trial = self.study.ask(self.dists)
        layout = self.space.nearest(trial.params, exclude)
        if layout is None:
            self.study.tell(trial, state=TrialState.FAIL)
            return None
        if self.space.params(layout) == trial.params:
            return layout, trial
        self.study.tell(trial, state=TrialState.FAIL)  # projected: the real layout is added on its result
        return layout, None

    def tell(self, layout: Layout, handle: Any, *, values: Sequence[float] | None, violation: float,
             status: str | None = None) -> None:
        """``violation`` > 0 = infeasible (pruned, oom, timeout, crash, nan: told COMPLETE with penalty
        values and a positive constraint, so TPE learns; the loop never sends None any more, which
        would be told FAIL — ignored by TPE)."""
        import optuna
        from optuna.trial import TrialState

        if values is None:
            if handle is not None:
                self.study.tell(handle, state=TrialState.FAIL)
            return
        vals = list(values) if self.multi else list(values[:1])
        if handle is not None:
            handle.set_constraint("memory", float(violation))
            self.study.tell(handle, vals)
        else:
            self.study.add_trial(optuna.trial.create_trial(
                params=self.space.params(layout), distributions=self.dists, values=vals,
                constraints={"memory": float(violation)},
            ))
