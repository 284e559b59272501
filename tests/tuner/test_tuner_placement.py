"""Placement: mesh order, groups, node boundaries, and torch's init_device_mesh rank convention."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tuner import (
    AXES,
    Layout,
    LayoutError,
    Problem,
    cluster_spec,
    model_spec,
    place,
    plan,
    training_spec,
)
from tuner._placement import _nodes_spanned


def cluster(nodes: int, per_node: int):
    return cluster_spec({"preset": "cpu-local", "nodes": nodes, "devices_per_node": per_node})


def test_default_order_and_mesh_names() -> None:
    p = place(Layout(tp=2, dp=2, pp=2), cluster(2, 4))
    assert p.order == AXES == ("tp", "cp", "ep", "dp", "pp")
    assert p.mesh_dim_names == ("pp", "dp", "ep", "cp", "tp")
    assert p.mesh_shape == (2, 2, 1, 1, 2)
    assert p.groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert p.groups("dp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert p.groups("pp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert (p.axes["tp"].intra_node, p.axes["dp"].intra_node, p.axes["pp"].intra_node) == (True, True, False)
    assert p.axes["pp"].nodes == 2 and p.axes["tp"].stride == 1 and p.axes["pp"].stride == 4
    assert p.summary == "tp:intra dp:intra pp:inter"
    assert p.rank_devices[5] == (1, 1) and len(p.rank_devices) == 8


@pytest.mark.parametrize("degrees", [(2, 1, 1, 3, 2), (3, 2, 1, 2, 1), (1, 2, 2, 1, 3), (2, 2, 1, 1, 3)])
def test_groups_match_a_row_major_mesh(degrees: tuple[int, ...]) -> None:
    """torch's init_device_mesh(shape, mesh_dim_names) numbers ranks row-major over the shape:
    the groups of each named dim of arange(world).reshape(shape) must be Placement's groups."""
    tp, cp, ep, dp, pp = degrees
    world = tp * cp * ep * dp * pp
    p = place(Layout(tp=tp, cp=cp, ep=ep, dp=dp, pp=pp), cluster(1, world), allow_tp_across_nodes=True)
    mesh = np.arange(world).reshape(p.mesh_shape)
    for dim, name in enumerate(p.mesh_dim_names):
        moved = np.moveaxis(mesh, dim, -1).reshape(-1, p.mesh_shape[dim])
        assert sorted(tuple(int(x) for x in row) for row in moved) == sorted(p.groups(name))
    for r in range(world):
        coords = p.coords(r)
        assert np.ravel_multi_index(tuple(coords[a] for a in p.mesh_dim_names), p.mesh_shape) == r


def test_custom_order_puts_dp_innermost() -> None:
    p = place(Layout(tp=2, dp=4), cluster(2, 4), order=("dp", "tp", "cp", "ep", "pp"), allow_tp_across_nodes=True)
    assert p.mesh_dim_names[-1] == "dp"
    assert p.groups("dp")[0] == (0, 1, 2, 3) and p.axes["dp"].intra_node
    assert p.groups("tp")[0] == (0, 4) and not p.axes["tp"].intra_node
    with pytest.raises(LayoutError, match="permutation"):
        place(Layout(tp=2, dp=4), cluster(2, 4), order=("tp", "dp"))


def test_tp_across_nodes_is_refused_unless_allowed() -> None:
    with pytest.raises(LayoutError, match=r"tp=8 .*devices_per_node=4"):
        place(Layout(tp=8), cluster(2, 4))
    p = place(Layout(tp=8), cluster(2, 4), allow_tp_across_nodes=True)
    assert not p.axes["tp"].intra_node and p.axes["tp"].nodes == 2
    # tp=3 on nodes of 4: groups (3,4,5) straddle a node boundary even though 3 < 4.
    with pytest.raises(LayoutError, match="tp=3"):
        place(Layout(tp=3, dp=4), cluster(3, 4))


def test_nodes_spanned_matches_brute_force() -> None:
    for stride, size, per_node in itertools.product((1, 2, 3, 4, 6, 8), (1, 2, 3, 4, 5), (1, 2, 3, 4, 8)):
        world = stride * size * 6
        want = max(
            len({(b + k * stride) // per_node for k in range(size)})
            for b in range(world) if (b // stride) % size == 0 and b + (size - 1) * stride < world
        )
        assert _nodes_spanned(stride, size, per_node, world) == want, (stride, size, per_node)


def test_plan_never_puts_tp_across_nodes_by_default() -> None:
    """6 nodes x 2 devices (12, not a power of two): every planned layout's TP groups stay in a node."""
    model = model_spec("small")
    c = cluster(6, 2)
    training = training_spec({"global_batch": 24, "precision": "fp32"})
    result = plan(problem=Problem(model=model, cluster=c, training=training))
    assert result.entries and result.rejected.get("tp crosses nodes", 0) > 0
    seen_tp = set()
    for e in result.entries + result.infeasible:
        seen_tp.add(e.layout.tp)
        for group in e.placement.groups("tp"):
            assert len({e.placement.rank_devices[r][0] for r in group}) == 1
    assert seen_tp == {1, 2}  # tp=4 would span two nodes; tp=3, 6, 12 do not divide heads=8
    allowed = plan(problem=Problem(model=model, cluster=c, training=training), allow_tp_across_nodes=True)
    assert "tp crosses nodes" not in allowed.rejected
    assert len(allowed.entries) + len(allowed.infeasible) > len(result.entries) + len(result.infeasible)
