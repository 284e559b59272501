"""Placement of a layout's mesh axes on the node/device topology.

Ranks are numbered node-major (rank r lives on node ``r // devices_per_node``, local device
``r % devices_per_node``), which is what torchrun/Ray launchers give. The mesh axes are ordered
innermost-first by how chatty they are (TP > CP > EP > DP > PP by default, Narayanan et al. 2021
Sec. 3.3 / Llama 3 Sec. 3.3.2): the innermost axis gets stride 1, so its groups are contiguous
ranks and stay inside a node whenever they fit, and inside a fast domain (whole nodes on one scale-up
fabric, ``ClusterSpec.fast_domain_devices``) when they do not: the chattiest axis gets the fastest link
at every tier (node, fast domain, network). torch's ``init_device_mesh(shape, mesh_dim_names)``
numbers ranks row-major, i.e. its LAST dimension is contiguous: ``mesh_dim_names`` is therefore the
placement order reversed (outermost first).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING

from tuner._errors import LayoutError
from tuner._specs import ClusterSpec

if TYPE_CHECKING:  # a layout is placed by its degrees; the layout rules use the placement
    from tuner._layout import Layout

AXES = ("tp", "cp", "ep", "dp", "pp")  # the mesh axes in default placement order, innermost (chattiest) first


@dataclass(frozen=True)
class AxisPlacement:
    """Where one mesh axis's groups fall. ``nodes`` (``domains``) is the most nodes (fast domains)
    any one group spans."""

    name: str
    size: int
    stride: int  # distance in ranks between consecutive members of a group
    intra_node: bool  # every group lies inside one node
    nodes: int
    in_domain: bool = True  # every group lies inside one fast domain (implied by intra_node)
    domains: int = 1

    @property
    def link(self) -> str:
        """The tier its groups talk over: ``intra`` (node), ``domain`` (fast domain), ``inter`` (network)."""
        return "intra" if self.intra_node else "domain" if self.in_domain else "inter"


@dataclass(frozen=True)
class Placement:
    order: tuple[str, ...]  # innermost (stride 1) first
    mesh_dim_names: tuple[str, ...]  # outermost first: what init_device_mesh takes
    mesh_shape: tuple[int, ...]
    axes: dict[str, AxisPlacement]
    devices_per_node: int
    summary: str
    devices_per_domain: int = 0  # 0: the node (no fast-domain tier)

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh_shape)

    @cached_property
    def rank_devices(self) -> tuple[tuple[int, int], ...]:
        """rank -> (node, local device index) that the launcher must realise."""
        d = self.devices_per_node
        return tuple((r // d, r % d) for r in range(self.world_size))

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinate of ``rank`` along every axis."""
        return {a: (rank // ax.stride) % ax.size for a, ax in self.axes.items()}

    def group(self, axis: str, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s group along ``axis`` (ordered by their coordinate on it)."""
        ax = self.axes[axis]
        base = rank - ((rank // ax.stride) % ax.size) * ax.stride
        return tuple(base + k * ax.stride for k in range(ax.size))

    def groups(self, axis: str) -> list[tuple[int, ...]]:
        """Every group along ``axis``; together they partition the ranks."""
        ax = self.axes[axis]
        return [self.group(axis, r) for r in range(self.world_size) if (r // ax.stride) % ax.size == 0]


def _nodes_spanned(stride: int, size: int, per_node: int, world: int) -> int:
    """Most nodes covered by one group {b, b+stride, ..., b+(size-1)*stride} over all bases b."""
    if size == 1:
        return 1
    if stride % per_node == 0:
        return size  # every member on its own node
    span = stride * size
    if per_node % span == 0:
        return 1  # whole blocks of groups fit in one node
    if span % per_node == 0 and per_node % stride == 0:
        return span // per_node  # groups interleave over whole nodes
    # General case: the node pattern depends only on the base modulo per_node.
    worst = 1
    for b in range(min(world, math.lcm(per_node, span))):
        if (b // stride) % size == 0:
            worst = max(worst, len({(b + k * stride) // per_node for k in range(size)}))
    return worst


@lru_cache(maxsize=4096)
def _place(sizes: tuple[int, ...], order: tuple[str, ...], per_node: int, per_domain: int | None = None) -> Placement:
    """``per_domain``: devices of one fast domain (a multiple of ``per_node``; None: the node)."""
    world = math.prod(sizes)
    per_domain = per_domain or per_node
    by_name = dict(zip(AXES, sizes, strict=True))
    axes: dict[str, AxisPlacement] = {}
    stride = 1
    for name in order:
        size = by_name[name]
        nodes = _nodes_spanned(stride, size, per_node, world)
        # Domains are blocks of whole nodes, so a group inside one node is inside one domain.
        if nodes == 1 or per_domain == per_node:
            domains = nodes
        else:
            domains = _nodes_spanned(stride, size, per_domain, world)
        axes[name] = AxisPlacement(name, size, stride, nodes == 1, nodes, domains == 1, domains)
        stride *= size
    summary = " ".join(f"{a}:{axes[a].link}" for a in order if axes[a].size > 1) or "single device"
    names = tuple(reversed(order))
    return Placement(
        order=order,
        mesh_dim_names=names,
        mesh_shape=tuple(by_name[a] for a in names),
        axes=axes,
        devices_per_node=per_node,
        summary=summary,
        devices_per_domain=0 if per_domain == per_node else per_domain,
    )


def check_order(order: tuple[str, ...]) -> tuple[str, ...]:
    order = tuple(order)
    if sorted(order) != sorted(AXES):
        raise LayoutError(f"placement order must be a permutation of {AXES}, got {order!r}")
    return order


def place(
    layout: Layout,
    cluster: ClusterSpec,
    *,
    order: tuple[str, ...] = AXES,
    allow_tp_across_nodes: bool = False,
) -> Placement:
    """Map ``layout``'s mesh onto ``cluster``; raise LayoutError if a TP group would leave a node
    (its fast domain, where the cluster has one: NVL72's NVLink joins trays as a node's joins GPUs)."""
    if layout.world_size != cluster.devices:
        raise LayoutError(
            f"layout world size {layout.world_size} does not equal the device count {cluster.devices}"
        )
    order = check_order(order)
    p = _place((layout.tp, layout.cp, layout.ep, layout.dp, layout.pp), order, cluster.devices_per_node,
               cluster.domain_devices)
    if not allow_tp_across_nodes and not p.axes["tp"].in_domain:
        raise LayoutError(
            f"tp={layout.tp} groups would cross nodes (devices_per_node={cluster.devices_per_node}"
            + (f", fast_domain_devices={cluster.domain_devices}" if cluster.fast_domain_devices else "")
            + "); pass allow_tp_across_nodes to allow it"
        )
    return p
