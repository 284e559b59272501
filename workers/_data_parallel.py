"""Data parallelism for ``workers.parallelize``: FSDP2 for ZeRO-1/2/3, a bucketed all-reduce for
ZeRO-0, and the expert-gradient divisor under expert parallelism (see parallelize's docstring)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from workers.model import MoE, Transformer


def is_expert_param(module: nn.Module, name: str) -> bool:
    return isinstance(module, MoE) and name in ("w1", "w2", "w3")


def apply_fsdp(
    model: Transformer,
    dense_mesh: DeviceMesh,
    expert_mesh: DeviceMesh,
    *,
    zero: int,
    param_dtype: torch.dtype,
) -> None:
    """FSDP2 over the 1-D data meshes (ZeRO-1/2/3, see the module docstring)."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    raf = zero == 3
    experts_apart = expert_mesh is not dense_mesh
    for block in model.layers.values():
        if experts_apart:  # experts on their own (smaller) data mesh; ExpertGradScale fixes the divisor
            for mod in block.modules():
                if isinstance(mod, MoE):
                    fully_shard(mod.router, mesh=dense_mesh, reshard_after_forward=raf, mp_policy=mp)
                    fully_shard(mod, mesh=expert_mesh, reshard_after_forward=raf, mp_policy=mp)
        fully_shard(block, mesh=dense_mesh, reshard_after_forward=raf, mp_policy=mp)
    fully_shard(model, mesh=dense_mesh, reshard_after_forward=raf, mp_policy=mp)


@dataclass
class GradSync:
    """ZeRO-0: average gradients over the data group(s) after the last micro-batch, one flat bucket
    per (group, dtype). Works on DTensor gradients (TP) through their local shards."""

    dense_group: dist.ProcessGroup | None
    expert_group: dist.ProcessGroup | None
    divide_factor: int
    params: list[tuple[nn.Parameter, bool]] = field(default_factory=list)  # (param, is_expert)

    @classmethod
    def for_modules(cls, chunks: list[nn.Module], dense, expert, divide_factor: int) -> GradSync:
        sync = cls(dense, expert, divide_factor)
        seen: set[int] = set()
        for chunk in chunks:
            for mod in chunk.modules():
                for name, p in mod.named_parameters(recurse=False):
                    if id(p) not in seen:
                        seen.add(id(p))
                        sync.params.append((p, is_expert_param(mod, name)))
        return sync

    def __call__(self) -> None:
        buckets: dict[tuple[bool, torch.dtype], list[torch.Tensor]] = {}
        for p, is_expert in self.params:
            if p.grad is None:
                continue
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            buckets.setdefault((is_expert, g.dtype), []).append(g)
        for (is_expert, _), grads in buckets.items():
            group = self.expert_group if is_expert else self.dense_group
            flat = torch.cat([g.reshape(-1) for g in grads])
            if group is not None:  # None: experts without data replicas (ep only), still divided
                dist.all_reduce(flat, group=group)
            flat.div_(self.divide_factor)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()


@dataclass
class ExpertGradScale:
    """FSDP averages expert gradients over their dp*cp mesh; the global mean needs a further 1/ep
    (see the module docstring). FSDP's ``set_gradient_divide_factor`` would do it inside the
    reduce-scatter, but it needs ReduceOp.PREMUL_SUM, which gloo lacks: scale the local shards."""

    params: list[nn.Parameter]
    factor: float

    @classmethod
    def for_modules(cls, chunks: list[nn.Module], factor: float) -> ExpertGradScale:
        params = [p for c in chunks for mod in c.modules() for name, p in mod.named_parameters(recurse=False)
                  if is_expert_param(mod, name)]
        return cls(params, factor)

    def __call__(self) -> None:
        for p in self.params:
            if p.grad is not None:
                (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).mul_(self.factor)


def zero1_micro_batch(chunks: list[tuple[int, Transformer]], *, last: bool) -> None:
    """ZeRO-1 accumulation (pp == 1): sync gradients and reshard only on the step's last micro-batch."""
    for _, chunk in chunks:
        if isinstance(chunk, FSDPModule):
            chunk.set_requires_gradient_sync(last)
            chunk.set_reshard_after_backward(last)
