"""The workloads a spec's ``workload:`` can name: ``builtin``, ``hf`` (workers/workload_hf.py) or an
importable ``module:attr`` ``Workload`` (the contract: workers/workload.py). ``check_workload`` is the
sweep spec's check before anything is stored or launched; ``build_model`` is what the ranks call."""

from __future__ import annotations

import functools
import importlib
import re

import torch
from torch import nn

from tuner import Capabilities, ModelSpec, SpecError, TrainingSpec
from workers.workload import BUILTIN, Workload, WorkloadError, WorkloadModel, contract_problem

_MODULE_ATTR = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def resolve(name: str) -> Workload:
    """The Workload that ``workload=name`` selects; WorkloadError (one line naming it) otherwise."""
    where = f"workload={name!r}"
    if name == "builtin":
        return BUILTIN
    if name == "hf":
        try:
            from workers.workload_hf import HF
        except ImportError as exc:
            raise WorkloadError(f"{where} needs the transformers package ({exc})") from None
        return HF
    if not isinstance(name, str) or not _MODULE_ATTR.match(name):
        raise WorkloadError(f"{where} is not 'builtin', 'hf' nor an importable 'module:attr' path")
    module, attr = name.split(":", 1)
    try:
        obj = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's module's, named
        raise WorkloadError(f"{where}: cannot import module {module!r} ({type(exc).__name__}: {exc})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise WorkloadError(f"{where}: module {module!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not isinstance(obj, Workload):
        raise WorkloadError(f"{where} is a {type(obj).__name__}, not a workers.workload.Workload "
                            "(name, build(model, training) -> Parts, capabilities)")
    return obj


@functools.lru_cache(maxsize=64)
def check_workload(name: str, model: ModelSpec, training: TrainingSpec) -> Capabilities:
    """Resolve ``name``, take its capabilities for ``model`` and build it on the meta device (no
    memory) to check that what ``build`` returns meets the contract. WorkloadError naming the field
    and value otherwise. The check the sweep spec runs before anything is stored or launched."""
    workload = resolve(name)
    where = f"workload={name!r}"
    try:
        caps = workload.capabilities_for(model)
    except (TypeError, ValueError) as exc:
        raise WorkloadError(f"{where}: {exc}") from None
    if name == "builtin":
        return caps
    try:
        with torch.device("meta"):
            parts = workload.build(model, training)
    except SpecError as exc:
        raise WorkloadError(f"{where}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the user's build failed: name it, no traceback
        raise WorkloadError(f"{where}: build(model, training) raised {type(exc).__name__}: {exc}") from None
    why = contract_problem(parts, caps, model)
    if why is not None:
        raise WorkloadError(f"{where}: {why}")
    return caps


def build_model(spec: ModelSpec, training: TrainingSpec, device: torch.device, workload: str = "builtin") -> nn.Module:
    """The model of ``workload``, built identically on every rank (seeded from ``training.seed``):
    the built-in ``Transformer`` exactly as before the contract existed, or a ``WorkloadModel``."""
    torch.manual_seed(training.seed)
    if workload == "builtin":
        from workers.model import Transformer

        with torch.device(device):
            model = Transformer(spec)
        model.init_weights(training.seed)
        return model
    w = resolve(workload)
    caps = w.capabilities_for(spec)
    with torch.device(device):
        parts = w.build(spec, training)
    why = contract_problem(parts, caps, spec)
    if why is not None:
        raise WorkloadError(f"workload={workload!r}: {why}")
    return WorkloadModel(parts, spec, caps)
