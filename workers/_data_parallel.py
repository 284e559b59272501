"""Data parallelism for ``workers.parallelize``: FSDP2 for ZeRO-1/2/3, torch's FSDP-based
``replicate`` for ZeRO-0, and the expert-gradient divisor under expert parallelism (see
parallelize's docstring and tuner/_realise.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
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
    """FSDP2 over the 1-D data meshes (ZeRO-1/2/3), or for ZeRO-0 torch's FSDP-based ``replicate``
    (DDP's semantics: replicated weights, gradients all-reduced per unit as its backward finishes,
    overlapped with the rest of the backward; the same units, hooks and MixedPrecisionPolicy as FSDP,
    so no autocast copies of the weights). One unit per block, one for the rest of the model."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    if zero == 0:
        def wrap(module: nn.Module, mesh: DeviceMesh) -> None:
            replicate(module, mesh=mesh, mp_policy=mp)
    else:
        def wrap(module: nn.Module, mesh: DeviceMesh) -> None:
            fully_shard(module, mesh=mesh, reshard_after_forward=zero == 3, mp_policy=mp)
    experts_apart = expert_mesh is not dense_mesh
    for block in model.layers.values():
        if experts_apart:  # experts on their own (smaller) data mesh; ExpertGradScale fixes the divisor
            for mod in block.modules():
                if isinstance(mod, MoE):
                    wrap(mod.router, dense_mesh)
                    wrap(mod, expert_mesh)
        wrap(block, dense_mesh)
    wrap(model, dense_mesh)


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
    """ZeRO-0/1 accumulation (pp == 1): sync gradients and reshard only on the step's last
    micro-batch (DDP's ``no_sync`` for the others); the unsharded fp32 gradients accumulate."""
    for _, chunk in chunks:
        if isinstance(chunk, FSDPModule):
            chunk.set_requires_gradient_sync(last)
            chunk.set_reshard_after_backward(last)
