"""Parameter importance of a sweep, from Optuna's importance evaluators over the stored trials.

The sweep's own Optuna study may live elsewhere (or be gone); the dashboard rebuilds a throw-away
in-memory study from the completed trials with ``add_trials`` and asks ``get_param_importances``.
Default evaluator: PED-ANOVA (Watanabe et al. 2023, "PED-ANOVA: efficiently quantifying
hyperparameter importance in arbitrary subspaces"): which knobs separate the top 10% of layouts from
the rest; it needs no scikit-learn and takes ~0.3 s for 2,000 trials. ``evaluator="fanova"``
(Hutter et al. 2014) needs scikit-learn. Results are cached per (sweep, completed-trial count).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from api._lru import LRU

# Layout knobs a sampler varies; a parameter with one value in the sweep carries no information.
PARAMS = ("tp", "pp", "dp", "cp", "ep", "zero", "mbs", "ac", "sp", "schedule", "vpp")
MIN_TRIALS = 5

_IMPORTANCES: LRU[dict[str, Any]] = LRU(max_entries=64)


def _study_from(trials: Sequence[dict[str, Any]], params: list[str]):
    import optuna
    from optuna.distributions import CategoricalDistribution
    from optuna.trial import create_trial

    distributions = {
        p: CategoricalDistribution(sorted({t["layout"][p] for t in trials}, key=str)) for p in params
    }
    study = optuna.create_study(direction="maximize", storage=optuna.storages.InMemoryStorage())
    study.add_trials([
        create_trial(
            params={p: t["layout"][p] for p in params},
            distributions=distributions,
            value=float(t["tokens_per_s_per_device"]),
        )
        for t in trials
    ])
    return study


def param_importance(
    load: Callable[[], Sequence[dict[str, Any]]], *, cache_key: Any = None, evaluator: str = "pedanova",
    seed: int = 0,
) -> dict[str, Any]:
    """``{"params": [...], "importance": [...], "evaluator": ..., "note": ...}`` sorted by importance.

    ``load()`` returns the trial rows; it is not called when ``cache_key`` (which should change
    whenever the sweep's results do, e.g. include its trial counts) is already cached. Too few
    completed trials, or no parameter that varies, gives empty lists and a note saying why.
    """
    def build() -> dict[str, Any]:
        done = [t for t in load() if t["status"] == "completed" and t.get("tokens_per_s_per_device")]
        return _compute(done, evaluator=evaluator, seed=seed)

    return build() if cache_key is None else _IMPORTANCES.get_or_build((cache_key, evaluator, seed), build)


def _compute(done: list[dict[str, Any]], *, evaluator: str, seed: int) -> dict[str, Any]:
    empty: dict[str, Any] = {"params": [], "importance": [], "evaluator": evaluator, "trials": len(done)}
    if len(done) < MIN_TRIALS:
        return empty | {"note": f"needs at least {MIN_TRIALS} completed trials, this sweep has {len(done)}"}
    params = [p for p in PARAMS if len({t["layout"].get(p) for t in done}) > 1]
    if not params:
        return empty | {"note": "no layout parameter varies between the completed trials"}
    import optuna
    from optuna.importance import FanovaImportanceEvaluator, PedAnovaImportanceEvaluator

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = _study_from(done, params)
    try:
        ev = FanovaImportanceEvaluator(seed=seed) if evaluator == "fanova" else PedAnovaImportanceEvaluator()
        scores = optuna.importance.get_param_importances(study, evaluator=ev, params=params)
    except (ValueError, RuntimeError, ImportError) as exc:  # constant objective, fanova without sklearn
        return empty | {"note": f"importance not computable: {exc}"}
    return {
        "params": list(scores),
        "importance": [round(float(v), 4) for v in scores.values()],
        "evaluator": evaluator,
        "trials": len(done),
        "note": None,
    }
