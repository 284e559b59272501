"""The figures a probe measured on a cluster (``ProbedFigures``), the value a ``ClusterSpec`` holds.

tuner/_probe.py derives them from a probe's raw timings and lists them beside the datasheet's; the
time and memory models read them wherever they are present. What each figure means: docs/tuner.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tuner._errors import SpecError

TIERS = ("intra", "domain", "inter")  # AxisPlacement.link: the node, the fast domain, the network
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


@dataclass(frozen=True)
class LinkFigure:
    """One collective on one tier of links, measured on a group of ``group`` ranks: the formula's
    bandwidth (bytes/s, one direction) and latency (seconds per message step)."""

    tier: str
    op: str
    bandwidth: float
    latency: float
    group: int

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise SpecError(f"probed.links.tier must be one of {TIERS}, got {self.tier!r}")
        if self.op not in OPS:
            raise SpecError(f"probed.links.op must be one of {OPS}, got {self.op!r}")
        _positive("probed.links.bandwidth", self.bandwidth)
        _non_negative("probed.links.latency", self.latency)


@dataclass(frozen=True)
class LayerFigure:
    """Per micro-batch under tensor parallelism ``tp`` (sequence parallel ``sp``): seconds of one
    layer's forward+backward beyond its modelled matmuls, attention and collectives (``layer_s`` +
    ``layer_per_seq_s`` x sequences), and the same for the embedding, head and loss together."""

    tp: int
    sp: bool
    layer_s: float
    layer_per_seq_s: float
    ends_s: float
    ends_per_seq_s: float

    def __post_init__(self) -> None:
        for f in ("layer_s", "layer_per_seq_s", "ends_s", "ends_per_seq_s"):
            _non_negative(f"probed.layers.{f}", getattr(self, f))


@dataclass(frozen=True)
class ProbedFigures:
    """What a probe measured; None (or empty) where it measured nothing (the datasheet stands)."""

    matmul_flops: float | None = None
    attention_flops: float | None = None
    compute_sharing: float | None = None  # >= 1: a device's compute when all of its node's compute vs alone
    links: tuple[LinkFigure, ...] = ()
    layers: tuple[LayerFigure, ...] = ()
    step_s: float | None = None
    step_layer_s: float | None = None
    dp_overlap: float | None = None
    recompute: tuple[tuple[str, float], ...] = ()  # (ac, what a layer's extra takes under it / without it)
    grad_sync_unit_s: float | None = None  # ZeRO-0 (replicate): a unit's all-reduce beyond the modelled one
    fsdp_unit_s: float | None = None  # ZeRO>=1: a unit's all-gather or reduce-scatter beyond the modelled one
    memory_overhead_bytes: int | None = None
    allocator_overhead: float | None = None
    dtype: str = ""  # the dtype the compute figures were measured in
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for f in ("matmul_flops", "attention_flops"):
            if getattr(self, f) is not None:
                _positive(f"probed.{f}", getattr(self, f))
        if self.compute_sharing is not None:
            _positive("probed.compute_sharing", self.compute_sharing)
            if self.compute_sharing < 1:
                raise SpecError(f"probed.compute_sharing must be at least 1, got {self.compute_sharing!r}")
        for f in ("step_s", "step_layer_s", "allocator_overhead", "grad_sync_unit_s", "fsdp_unit_s"):
            if getattr(self, f) is not None:
                _non_negative(f"probed.{f}", getattr(self, f))
        if self.dp_overlap is not None and not 0 <= self.dp_overlap <= 1:
            raise SpecError(f"probed.dp_overlap must be within [0, 1], got {self.dp_overlap!r}")
        if self.memory_overhead_bytes is not None:
            _non_negative("probed.memory_overhead_bytes", self.memory_overhead_bytes)
        object.__setattr__(self, "links", tuple(_as(LinkFigure, x, "probed.links") for x in self.links))
        object.__setattr__(self, "layers", tuple(_as(LayerFigure, x, "probed.layers") for x in self.layers))
        object.__setattr__(self, "notes", tuple(str(x) for x in self.notes))
        recompute = tuple((str(ac), float(r)) for ac, r in (self.recompute or ()))
        for ac, r in recompute:
            if ac not in ("selective", "full"):
                raise SpecError(f"probed.recompute: {ac!r} is not an activation checkpointing (selective, full)")
            _positive(f"probed.recompute.{ac}", r)
        object.__setattr__(self, "recompute", recompute)

    def link(self, tier: str, op: str) -> LinkFigure | None:
        for x in self.links:
            if x.tier == tier and x.op == op:
                return x
        return None

    def layer(self, tp: int, sp: bool) -> LayerFigure | None:
        """The figure of (tp, sp), else the nearest probed tp (in log2) with the same sp, else None."""
        same = [x for x in self.layers if x.sp == (sp and tp > 1)] or list(self.layers)
        if not same:
            return None
        return min(same, key=lambda x: (abs(math.log2(x.tp) - math.log2(tp)), x.tp))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ProbedFigures:
        return _as(cls, data, "probed")


def _as(cls: type, value: Any, where: str) -> Any:
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise SpecError(f"{where} must be a mapping, got {value!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise SpecError(f"{where}.{unknown[0]} is not a known field (known: {', '.join(sorted(names))})")
    data = dict(value)
    for key in ("links", "layers", "notes", "recompute"):
        if key in data and isinstance(data[key], list):
            data[key] = tuple(data[key])
    try:
        return cls(**data)
    except TypeError as exc:
        raise SpecError(f"{where}: {exc}") from None


def _positive(name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
        raise SpecError(f"{name} must be a positive number, got {v!r}")


def _non_negative(name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
        raise SpecError(f"{name} must be a non-negative number, got {v!r}")
