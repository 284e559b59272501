"""What a sweep is checked for before it is stored: a space with at least one valid layout, one of
them predicted to fit, and a backend that resolves. All of it is the tuner's analysis of the sweep's
``tuner.Problem``: nothing of the engine's sweep model (``SweepModel``: surrogate features,
calibration) is built to refuse a spec.
"""

from __future__ import annotations

from typing import Any

import tuner
from api.spec import SweepSpec
from tuner import Layout, SpecError


def no_valid_layout_message(rejected: dict[str, int], space_fields: dict[str, Any] | None,
                            refusal: str | None = None) -> str:
    """Why a search space is empty: the restricting ``space.<field>`` values, then the most common
    rejection reason (and the others with their counts); ``refusal``: what the workload said of the
    layouts it refused (``tuner.Enumeration.refusal``)."""
    reasons = sorted(rejected.items(), key=lambda kv: (-kv[1], kv[0]))
    where = ", ".join(f"space.{k}={v!r}" for k, v in sorted((space_fields or {}).items()))
    head = f"{where}: " if where else "space: "
    top = f"; top rejection reason: {reasons[0][0]} ({reasons[0][1]} of {sum(rejected.values())} layouts)" if reasons else ""
    rest = ", ".join(f"{k}: {v}" for k, v in reasons[1:])
    return (f"{head}the search space leaves no valid layout for this model and cluster{top}"
            + (f" (also: {rest})" if rest else "") + (f"; the workload: {refusal}" if refusal else ""))


def enumerate_space(problem: tuner.Problem, *, space_fields: dict[str, Any] | None) -> tuner.Enumeration:
    """The problem's enumeration (only what its workload runs: ``problem.capabilities``); SpecError
    (``no_valid_layout_message``) when it holds no valid layout."""
    enumeration = tuner.enumerate_layouts(problem=problem)
    if not enumeration.valid:
        raise SpecError(no_valid_layout_message(enumeration.rejected, space_fields, enumeration.refusal))
    return enumeration


def check_runnable(spec: SweepSpec) -> None:
    """What a sweep needs before it is stored (SpecError naming the field and value otherwise): at
    least one valid layout in its space, one of them predicted to fit in device memory (what
    ``meshtune plan`` says of the same problem), and a backend that resolves. "ray" and "simulate"
    resolve by name (nothing is started); a ``module:attr`` backend is imported and its attribute
    looked up."""
    problem = spec.to_problem()
    layouts = spec.listed_layouts()
    enumeration = enumerate_space(problem, space_fields=spec.space) if layouts is None else None
    check_fits(problem, layouts=layouts, enumeration=enumeration)
    check_backend(spec.backend)


def check_fits(problem: tuner.Problem, *, layouts: list[Layout] | None,
               enumeration: tuner.Enumeration | None) -> None:
    """SpecError naming ``cluster`` when the memory model says that no layout of the problem fits (a
    sweep would prune every layout and measure nothing): the plan's own verdict and reasons.
    ``layouts``: the sweep's listed ones (search.layouts), else ``enumeration``: its space's."""
    if layouts is not None:
        fits = any(tuner.estimate_memory(lay, model=problem.model, cluster=problem.cluster,
                                         training=problem.training).fits for lay in layouts)
        rejected = {} if fits else {tuner.R_MEMORY: len(layouts)}
    else:
        planned = tuner.plan(problem=problem, enumeration=enumeration)
        fits, rejected = bool(planned.entries), planned.rejected
    if fits:
        return
    c = problem.cluster
    reasons = ", ".join(f"{k} {v:,}" for k, v in sorted(rejected.items(), key=lambda kv: (-kv[1], kv[0])))
    raise SpecError(
        f"cluster: No layout fits in device memory: {problem.model.name} on {c.nodes} x {c.devices_per_node} "
        f"{c.name} ({c.device_memory / 2**30:,.1f} GiB each) — rejected: "
        f"{reasons}; give more nodes, a device with more memory, or a smaller batch (`meshtune plan` shows the same)")


def check_backend(name: str) -> None:
    from workers import BUILTIN_BACKENDS, resolve_backend

    if name in BUILTIN_BACKENDS:
        return
    try:
        obj = resolve_backend(name)
    except tuner.BackendError as exc:
        raise SpecError(str(exc)) from None  # names backend= and the value
    except Exception as exc:  # the module raised while importing: still the user's backend
        raise SpecError(f"backend={name!r} cannot be used: importing it raised {type(exc).__name__}: {exc}") from None
    if not (callable(obj) or callable(getattr(obj, "run", None))):
        raise SpecError(f"backend={name!r} resolves to a {type(obj).__name__}, not a backend class, factory or object")


