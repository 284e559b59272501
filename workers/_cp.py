"""Context parallelism: the sequence split over the cp group, attention over all-gathered K/V.

Llama 3's scheme (Dubey et al. 2024, Sec. 3.3.2): the sequence is cut into 2*cp chunks, rank r
keeps chunks r and 2*cp-1-r (equal causal work), and each attention layer all-gathers the
un-repeated (kv_heads-sized) K and V over cp and attends with SDPA's grouped-query form. Ours, not
torch's ``context_parallel``, because that one shards only the CUDA SDPA kernels and raises on CPU;
this path runs on gloo and NCCL alike. Parameter gradients are then averaged over cp like a data
axis. Details: docs/workers.md, "Context parallelism".
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

# torch 2.13 renamed the single-tensor collectives; keep the older names working (torch >= 2.8).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_of(mesh: DeviceMesh | ProcessGroup) -> tuple[ProcessGroup, int, int]:
    """(process group, its size, this rank's index in it) of a 1-D DeviceMesh or a ProcessGroup."""
    if isinstance(mesh, DeviceMesh):
        if mesh.ndim != 1:
            raise ValueError(f"expected a 1-D device mesh, got ndim={mesh.ndim} ({mesh.mesh_dim_names})")
        return mesh.get_group(), mesh.size(), mesh.get_local_rank()
    return mesh, dist.get_world_size(mesh), dist.get_rank(mesh)


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two global chunks (of 2*cp) that ``rank`` holds: r and 2cp-1-r (load-balanced causal)."""
    assert 0 <= rank < cp, (rank, cp)
    return rank, 2 * cp - 1 - rank


def _global_chunk_order(cp: int) -> list[int]:
    """For global chunk g, its index in the gathered [rank, local-chunk] order (rank*2 + j)."""
    return [2 * g if g < cp else 2 * (2 * cp - 1 - g) + 1 for g in range(2 * cp)]


def chunk_positions(seq: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Global token positions held by cp ``rank``: its two chunks of length seq / (2*cp), in order."""
    if seq % (2 * cp):
        raise ValueError(f"seq_len={seq} is not divisible by 2*cp={2 * cp} (load-balanced context parallel)")
    c = seq // (2 * cp)
    return torch.cat([torch.arange(g * c, (g + 1) * c, device=device) for g in chunk_ids(cp, rank)])


def shard_sequence(
    tokens: torch.Tensor, targets: torch.Tensor, cp_mesh: DeviceMesh | ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This cp rank's (tokens, targets, global positions) of a [batch, seq, ...] batch.

    Positions are the global token indices (for RoPE), shape [seq / cp].
    """
    _, cp, rank = group_of(cp_mesh)
    if targets.shape[:2] != tokens.shape[:2]:
        raise ValueError(f"targets shape {tuple(targets.shape)} does not match tokens {tuple(tokens.shape)}")
    positions = chunk_positions(tokens.shape[1], cp, rank, tokens.device)
    return tokens[:, positions], targets[:, positions], positions


class _GatherSeq(torch.autograd.Function):
    """All-gather along a new leading dim; backward reduce-scatters (sums) the gradient back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, size: int) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        x = x.contiguous()
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))  # concatenated form (gloo has no stacked one)
        _all_gather_single(out, x, group=group)
        return out.view(size, *x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        out = grad.new_empty(grad.shape[1:])
        _reduce_scatter_single(out, grad.flatten(0, 1).contiguous(), group=ctx.group)
        return out, None, None


@functools.lru_cache(maxsize=64)
def _bool_mask(c: int, g: int, device: torch.device) -> torch.Tensor:
    return torch.ones(c, (g + 1) * c, dtype=torch.bool, device=device).tril(diagonal=g * c)


def chunk_mask(c: int, g: int, device: torch.device) -> torch.Tensor | object:
    """Causal mask of chunk g's c queries against the keys [0, (g+1)c): query i sees key <= g*c+i."""
    if device.type == "cuda":  # lets SDPA use flash / memory-efficient kernels with lower-right alignment
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(c, (g + 1) * c)
    return _bool_mask(c, g, device)


def attend_local_chunks(
    q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, chunks: tuple[int, int]
) -> torch.Tensor:
    """Causal attention of the local queries (global chunks ``chunks``, c rows each) against the whole
    sequence's keys/values in global order (kv heads may be fewer than q's: grouped-query). Keys after chunk g are masked for all of its queries, so
    they are not even passed: every rank's work is c*c*(2cp+1) score entries."""
    c = q.shape[2] // 2
    outs = []
    for j, g in enumerate(chunks):
        n_keys = (g + 1) * c
        outs.append(
            F.scaled_dot_product_attention(
                q[:, :, j * c : (j + 1) * c],
                k_all[:, :, :n_keys],
                v_all[:, :, :n_keys],
                attn_mask=chunk_mask(c, g, q.device),
                enable_gqa=k_all.shape[1] != q.shape[1],
            )
        )
    return torch.cat(outs, dim=2)


class ContextParallelAttention:
    """``Attention.attn_fn`` under context parallelism; q: [batch, heads, seq/cp, head_dim] and k, v:
    [batch, kv_heads, seq/cp, head_dim] (un-repeated) holding this rank's chunks ``chunk_ids(cp, rank)``
    (as cut by ``shard_sequence``)."""

    def __init__(self, group: ProcessGroup, cp: int, rank: int) -> None:
        self.group, self.cp, self.rank = group, cp, rank
        self.chunks = chunk_ids(cp, rank)
        self._order = _global_chunk_order(cp)

    def gather_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the whole sequence in global order: [batch, kv_heads, seq, head_dim] each."""
        b, h, s_local, d = k.shape
        c = s_local // 2
        kv = _GatherSeq.apply(torch.stack((k, v)), self.group, self.cp)  # [cp, 2, b, h, 2c, d]
        kv = kv.view(self.cp, 2, b, h, 2, c, d).permute(1, 2, 3, 0, 4, 5, 6).reshape(2, b, h, 2 * self.cp, c, d)
        kv = kv[:, :, :, self._order].reshape(2, b, h, 2 * self.cp * c, d)
        return kv[0], kv[1]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if isinstance(q, DTensor) or isinstance(k, DTensor):
            raise TypeError("context parallel attention needs plain local q/k/v (TP plans with use_local_output=True)")
        assert q.shape[2] % 2 == 0 and k.shape[2] == q.shape[2], (q.shape, k.shape)
        k_all, v_all = self.gather_kv(k, v)  # kv heads only: SDPA groups the query heads over them
        return attend_local_chunks(q, k_all, v_all, self.chunks)


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh | ProcessGroup) -> None:
    """Make every Attention of ``model`` attend over the cp group; feed it ``shard_sequence`` batches
    (and their positions to ``model.forward``). Order-free with respect to the other parallelisms:
    it only swaps the attention kernel."""
    from workers.model import Attention

    attn_fn = ContextParallelAttention(*group_of(cp_mesh))  # stateless: one for every layer
    for module in model.modules():
        if isinstance(module, Attention):
            module.attn_fn = attn_fn
