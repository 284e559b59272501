"""Choosing a trial backend by name: ``get_backend("ray" | "simulate" | "module:attr", **kwargs)``.

Built-ins are imported lazily (the Ray backend pulls in ray; simulate imports nothing heavy).
Anything importable as ``module:attr`` plugs in (a class, an instance with ``run``, or a factory),
so users bring their own launcher (Slurm, Kubernetes) without forking meshtune; a thin adapter
supplies a plug-in's missing ``name``, ``capacity()`` and ``close()`` and checks its results.
Unknown names and broken specs raise ``BackendError`` naming the spec. The plug-in contract:
docs/workers.md, "Backends".
"""

from __future__ import annotations

import importlib
from typing import Any

from tuner import BackendError
from workers._contract import Backend, TrialRequest, TrialResult

BUILTIN_BACKENDS: dict[str, str] = {
    "ray": "workers.ray_backend:RayBackend",
    "simulate": "workers.simulate:SimulateBackend",
}


class PluggedBackend:
    """Completes a user's backend object to the full ``Backend`` protocol and checks its results."""

    def __init__(self, inner: Any, *, spec: str) -> None:
        self.inner = inner
        self.spec = spec
        self.name = str(getattr(inner, "name", None) or spec)

    def run(self, request: TrialRequest) -> TrialResult:
        result = self.inner.run(request)
        if isinstance(result, dict):
            result = TrialResult.from_dict(result)
        if not isinstance(result, TrialResult):
            raise BackendError(
                f"backend {self.spec!r}.run() returned {type(result).__name__}, expected TrialResult"
            )
        return result

    def capacity(self) -> int:
        cap = getattr(self.inner, "capacity", None)
        return int(cap()) if callable(cap) else 1

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if callable(close):
            close()


def resolve_backend(spec: str) -> Any:
    """The object a ``module:attr`` spec names, imported; ``BackendError`` naming the spec if none."""
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        known = ", ".join(sorted(BUILTIN_BACKENDS))
        raise BackendError(f"backend={spec!r} is not a known backend ({known}) nor a 'module:attr' path")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendError(f"backend={spec!r}: cannot import module {module_name!r} ({exc})") from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise BackendError(f"backend={spec!r}: {module_name!r} has no attribute {attr_path!r}") from None
    return obj


def get_backend(name: str, **kwargs: Any) -> Backend:
    """The backend called ``name`` ("ray", "simulate" or "module:attr"), built with ``kwargs``."""
    if not isinstance(name, str) or not name.strip():
        raise BackendError(f"backend must be a non-empty name, got {name!r}")
    name = name.strip()
    spec = BUILTIN_BACKENDS.get(name, name)
    obj = resolve_backend(spec)
    if isinstance(obj, type):
        backend = obj(**kwargs)
    elif callable(getattr(obj, "run", None)):
        if kwargs:
            raise BackendError(f"backend={name!r} is an instance; it takes no options (got {sorted(kwargs)})")
        backend = obj
    elif callable(obj):
        backend = obj(**kwargs)
    else:
        raise BackendError(f"backend={name!r} resolves to a {type(obj).__name__}, not a backend class or factory")
    if not callable(getattr(backend, "run", None)):
        raise BackendError(f"backend={name!r} gave a {type(backend).__name__} without a run(request) method")
    if name in BUILTIN_BACKENDS:
        return backend
    return PluggedBackend(backend, spec=name)
