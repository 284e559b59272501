"""Expert parallelism: each ep rank holds experts/ep experts; tokens travel to them by all-to-all.

GShard-style dispatch/combine (Lepikhin et al. 2021, Sec. 2.2) without a capacity limit (no token
dropped: the single-device MoE up to reduction order), inside the data dimension (DeepSpeed-MoE,
Rajbhandari et al. 2022): the router and the dense weights stay replicated. Expert gradients are
reduced over the dp ranks of the same ep index with the dense divisor dp*ep. Call
``apply_expert_parallel`` after ``init_weights`` and before FSDP and the optimizer;
``apply_expert_tensor_parallel`` splits every expert over tp (Megatron's MLP split). The gradient
algebra and the tp-inside-experts data flow: docs/workers.md, "Expert parallelism".
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from workers._cp import group_of


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over dim 0 with uneven splits; backward sends gradients the way back."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: ProcessGroup
    ) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        out = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return out, None, None, None


class ExpertParallelExperts:
    """``MoE.experts_fn`` under expert parallelism: (tokens sorted by global expert id, counts per
    global expert) -> expert outputs in the same order, computed on the ranks that own the experts."""

    def __init__(self, moe: nn.Module, group: ProcessGroup, ep: int, rank: int) -> None:
        self.moe, self.group, self.ep, self.rank = moe, group, ep, rank
        self.local = moe.experts // ep

    def __call__(self, xs: torch.Tensor, counts: list[int]) -> torch.Tensor:
        from workers.model import local_experts

        ep, n_local = self.ep, self.local
        assert len(counts) == ep * n_local, (len(counts), ep, n_local)
        # 1. How many tokens each source rank sends to each of my experts: [src, local expert].
        send_counts = torch.tensor(counts, dtype=torch.int64, device=xs.device)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        recv = recv_counts.view(ep, n_local)
        # 2. Dispatch: experts are contiguous per owner, so the sorted tokens split by owner directly.
        in_splits = [sum(counts[d * n_local : (d + 1) * n_local]) for d in range(ep)]
        out_splits = recv.sum(dim=1).tolist()
        received = _AllToAll.apply(xs, out_splits, in_splits, self.group)  # [src][local expert] order
        # 3. Regroup by local expert (stable: source order kept within an expert), run, undo.
        expert_of_row = torch.arange(n_local, device=xs.device).repeat(ep).repeat_interleave(recv.flatten())
        perm = expert_of_row.argsort(stable=True)
        out = local_experts(received[perm], self.moe.w1, self.moe.w2, self.moe.w3, recv.sum(dim=0).tolist())
        out = out[perm.argsort()]
        # 4. Combine: send the outputs back to the ranks the tokens came from.
        return _AllToAll.apply(out, in_splits, out_splits, self.group)


class SumGradOverGroup(torch.autograd.Function):
    """Megatron's "f" (Shoeybi et al. 2019, Sec. 3): identity forward, backward sums the gradient
    over ``group``. Used by expert TP here and by the replicated K/V projections in parallelize."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _AllReduce(torch.autograd.Function):
    """Megatron's "g": forward sums the partial outputs over ``group``, backward is the identity."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


class TensorParallelExperts:
    """``MoE.experts_fn`` over ffn-sharded experts: ``inner`` (local or expert-parallel) computes
    partial outputs, summed over the tp group (see the module docstring)."""

    def __init__(self, inner, group: ProcessGroup) -> None:
        self.inner, self.group = inner, group

    def __call__(self, xs: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return _AllReduce.apply(self.inner(SumGradOverGroup.apply(xs, self.group), counts), self.group)


def apply_expert_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh | ProcessGroup) -> None:
    """Keep this tp rank's ffn/tp slice of every expert (w1/w3 columns, w2 rows) in every MoE of
    ``model``; after ``apply_expert_parallel`` when both apply (it wraps the all-to-all)."""
    from workers.model import MoE

    group, tp, rank = group_of(tp_mesh)
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        ffn = module.w1.shape[2]
        if ffn % tp:
            raise ValueError(f"tp={tp} does not divide expert_ffn={ffn}")
        lo, hi = rank * ffn // tp, (rank + 1) * ffn // tp
        for name, dim in (("w1", 2), ("w3", 2), ("w2", 1)):
            full = getattr(module, name)
            part = full.detach().narrow(dim, lo, hi - lo).clone()
            setattr(module, name, nn.Parameter(part, requires_grad=full.requires_grad))
        module.experts_fn = TensorParallelExperts(module.experts_fn, group)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh | ProcessGroup) -> None:
    """Keep this ep rank's block of experts in every MoE of ``model`` and route tokens by all-to-all."""
    from workers.model import MoE

    group, ep, rank = group_of(ep_mesh)
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        if module.experts % ep:
            raise ValueError(f"ep={ep} does not divide experts={module.experts}")
        n_local = module.experts // ep
        if module.w1.shape[0] != module.experts:
            raise ValueError(f"MoE already holds {module.w1.shape[0]} of {module.experts} experts (ep applied twice?)")
        lo, hi = rank * n_local, (rank + 1) * n_local
        for name in ("w1", "w2", "w3"):
            full = getattr(module, name)
            setattr(module, name, nn.Parameter(full.detach()[lo:hi].clone(), requires_grad=full.requires_grad))
        module.experts_fn = ExpertParallelExperts(module, group, ep, rank)


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The routed-expert weights of ``model`` (sharded over ep; data-parallel reduce over dp only)."""
    from workers.model import MoE

    return [p for m in model.modules() if isinstance(m, MoE) for p in (m.w1, m.w2, m.w3)]
