"""The workload contract: the model code a trial trains, and what meshtune needs to lay it out.

A ``Workload`` has a name, ``build(model, training) -> Parts`` (random weights, called identically
on every rank under a ``torch.device`` context) and ``capabilities`` (a ``tuner.Capabilities``, or a
function of the ModelSpec): the layouts it can realise, all others refused before a process starts.
``Parts`` is the model cut where parallelisation needs it: embedding, ordered blocks, final norm,
output head, a ``context`` module, one block's TP plan and the loss. ``WorkloadModel`` arranges
them as the built-in Transformer is; ``builtin_parts`` is the built-in model cut to this contract.
The workloads a spec can name: workers/workload_registry.py. The contract in full (TP plan values,
head counts): docs/workers.md, "Workloads".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from tuner import Capabilities, ModelSpec, SpecError, TrainingSpec, builtin_capabilities

TP_STYLES = ("colwise", "rowwise", "sequence_parallel", "sequence_gather", "head_norm")


@dataclass
class Parts:
    """What a workload's ``build`` returns (see the module docstring)."""

    embed: nn.Module  # token ids [b, s] -> hidden [b, s, h]
    blocks: Sequence[nn.Module]  # in order; block(h, **context) -> h
    norm: nn.Module | None  # the final norm (None: none)
    head: nn.Linear  # hidden -> logits [b, s, vocab]
    context: nn.Module | None = None  # context(h, positions) -> dict of keyword arguments for every block
    tp_plan: Mapping[str, str | ParallelStyle] = field(default_factory=dict)
    kv_projections: tuple[str, str] | None = None  # block fqns of the k and v projections (tp > kv_heads)
    on_tp: Callable[[nn.Module, int, int], None] | None = None  # (block, q heads, kv heads) per tp rank
    selective_ac: str | None = None  # the block's sub-module that ac="selective" recomputes
    # None: mean token cross-entropy (vocab-parallel under tp). A callable (logits, targets) -> loss
    # sees whole logits, so a workload with its own loss cannot declare tp.
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None


@dataclass(frozen=True)
class Workload:
    name: str
    build: Callable[[ModelSpec, TrainingSpec], Parts]
    capabilities: Capabilities | Callable[[ModelSpec], Capabilities] = field(default_factory=Capabilities)

    def capabilities_for(self, model: ModelSpec) -> Capabilities:
        caps = self.capabilities(model) if callable(self.capabilities) else self.capabilities
        if not isinstance(caps, Capabilities):
            raise TypeError(f"capabilities must be a tuner.Capabilities, got {type(caps).__name__}")
        return caps


class WorkloadError(SpecError):
    """The ``workload`` field names something that cannot be imported or does not meet the contract."""


# --- the built-in model, cut to the contract -----------------------------------------------------


class RopeContext(nn.Module):
    """The built-in blocks' context: rotary cos/sin of the positions (workers.model.rope_angles)."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim

    def forward(self, h: torch.Tensor, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        from workers.model import rope_angles

        cos, sin = rope_angles(self.head_dim, positions)
        return {"cos": cos, "sin": sin}


def builtin_parts(model: ModelSpec, training: TrainingSpec) -> Parts:
    """``workers.model.Transformer`` as Parts, weights as the built-in path draws them, its block plan
    that of ``workers.parallelize.block_tp_plan`` in the contract's styles: q/k/v and w1 (and w3, the
    gate of SwiGLU and GeGLU alike; the GELU MLP has none) column-split, wo/w2 row-split, Qwen3's
    per-head q/k norms as ``head_norm``, a shared expert split as the dense MLP is. Not in it: the
    routed experts (``workers._ep.apply_expert_tensor_parallel`` splits their stacked weights, which
    no block-plan style names) and Gemma's sandwich norms under sp (kept sequence-sharded with a
    local output there, which no style names either)."""
    from workers.model import Transformer

    t = Transformer(model)
    if not t.output.weight.is_meta:  # check_workload builds on the meta device: nothing to draw there
        t.init_weights(training.seed)
    plan: dict[str, str] = {
        "attention.wq": "colwise", "attention.wk": "colwise", "attention.wv": "colwise", "attention.wo": "rowwise",
        "attention_norm": "sequence_parallel", "ffn_norm": "sequence_parallel",
        "attention": "sequence_gather", "feed_forward": "sequence_gather",
    }
    gated = model.mlp != "gelu"  # workers.model.FeedForward: w3 for swiglu and geglu
    if not model.is_moe or model.dense_layers:  # a dense MLP in some block (a MoE block's are parameters)
        plan.update({"feed_forward.w1": "colwise", "feed_forward.w2": "rowwise"})
        if gated:
            plan["feed_forward.w3"] = "colwise"
    if model.qk_norm:
        plan.update({"attention.q_norm": "head_norm", "attention.k_norm": "head_norm"})
    if model.is_moe and model.shared_expert_ffn:
        plan.update({"shared_expert.w1": "colwise", "shared_expert.w2": "rowwise"})
        if gated:
            plan["shared_expert.w3"] = "colwise"
    return Parts(embed=t.tok_embeddings, blocks=list(t.layers.values()), norm=t.norm, head=t.output,
                 context=RopeContext(model.head_dim), tp_plan=plan,
                 kv_projections=("attention.wk", "attention.wv"), selective_ac="attention")


# The built-in model's own limits for each shape (tuner._realise.builtin_capabilities / builtin_refusal).
BUILTIN = Workload(name="builtin", build=builtin_parts, capabilities=builtin_capabilities)


def contract_problem(parts: Any, caps: Capabilities, model: ModelSpec) -> str | None:
    """Why ``parts`` does not meet the contract, or None."""
    if not isinstance(parts, Parts):
        return f"build(model, training) returned {type(parts).__name__}, not workers.workload.Parts"
    for f in ("embed", "head"):
        if not isinstance(getattr(parts, f), nn.Module):
            return f"Parts.{f} must be an nn.Module, got {type(getattr(parts, f)).__name__}"
    if not isinstance(parts.head, nn.Linear):
        return f"Parts.head must be an nn.Linear (it is split over the vocabulary), got {type(parts.head).__name__}"
    if parts.head.out_features != model.vocab:
        return f"Parts.head has {parts.head.out_features} outputs but model.vocab={model.vocab}"
    blocks = list(parts.blocks)
    if len(blocks) != model.layers or not all(isinstance(b, nn.Module) for b in blocks):
        return f"Parts.blocks must be model.layers={model.layers} nn.Modules, got {len(blocks)}"
    for f in ("norm", "context"):
        if getattr(parts, f) is not None and not isinstance(getattr(parts, f), nn.Module):
            return f"Parts.{f} must be an nn.Module or None, got {type(getattr(parts, f)).__name__}"
    for key, style in dict(parts.tp_plan).items():
        if not (style in TP_STYLES or isinstance(style, ParallelStyle)):
            return f"Parts.tp_plan[{key!r}]={style!r} is not one of {', '.join(TP_STYLES)} nor a ParallelStyle"
    if caps.tp and not parts.tp_plan:
        return "capabilities declare tp but Parts.tp_plan is empty"
    if caps.tp and parts.loss is not None:
        return "capabilities declare tp but Parts.loss is custom (tp keeps logits vocab-sharded: cross-entropy only)"
    if caps.tp and caps.replicated_kv and parts.kv_projections is None and model.kv_heads < model.heads:
        return "capabilities declare replicated_kv but Parts.kv_projections is None"
    if "selective" in caps.ac and not (parts.selective_ac and all(hasattr(b, parts.selective_ac) for b in blocks)):
        return f"capabilities declare ac='selective' but Parts.selective_ac={parts.selective_ac!r} is not a block sub-module"
    if caps.cp or caps.ep:
        return "context and expert parallelism are realised for the built-in model only: declare cp=False, ep=False"
    return None


# --- the generic model and its tensor parallelism ------------------------------------------------


class WorkloadModel(nn.Module):
    """Parts arranged as ``workers.model.Transformer`` is (``tok_embeddings``, ``layers`` keyed by
    global index, ``norm``, ``output``), so the pipeline split, activation checkpointing and data
    parallelism of ``workers.parallelize`` apply to it unchanged."""

    def __init__(self, parts: Parts, spec: ModelSpec, capabilities: Capabilities) -> None:
        super().__init__()
        self.spec, self.capabilities = spec, capabilities
        self.tok_embeddings: nn.Module | None = parts.embed
        self.layers = nn.ModuleDict({str(i): b for i, b in enumerate(parts.blocks)})
        self.norm: nn.Module | None = parts.norm
        self.output: nn.Linear | None = parts.head
        self.context = parts.context
        self.tp_plan = dict(parts.tp_plan)
        self.kv_projections, self.on_tp = parts.kv_projections, parts.on_tp
        self.selective_ac = parts.selective_ac
        self.loss = parts.loss

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        ctx = self.context(h, positions) if self.context is not None else {}
        for layer in self.layers.values():
            h = layer(h, **ctx)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def apply_tensor_parallel(self, tp_mesh, *, sp: bool) -> None:
        """This chunk's TP/SP: the root as the built-in model's, then each block's plan."""
        from workers.parallelize import ReplicatedKV, apply_root_tp

        apply_root_tp(self, tp_mesh, sp=sp)
        tp, kv_heads = tp_mesh.size(), self.spec.kv_heads
        replicate_kv = kv_heads % tp != 0
        for block in self.layers.values():
            plan = {k: s for k, v in self.tp_plan.items()
                    if (s := _style(v, sp)) is not None
                    and not (replicate_kv and self.kv_projections and k in self.kv_projections)}
            parallelize_module(block, tp_mesh, plan)
            if replicate_kv:
                for fqn in self.kv_projections:
                    parent, _, leaf = fqn.rpartition(".")
                    owner = block.get_submodule(parent) if parent else block
                    setattr(owner, leaf, ReplicatedKV(getattr(owner, leaf), head_dim=self.spec.head_dim,
                                                      kv_heads=kv_heads, tp_mesh=tp_mesh))
            if self.on_tp is not None:
                self.on_tp(block, self.spec.heads // tp, max(1, kv_heads // tp))


class GatherSequence(ParallelStyle):
    """Under sequence parallelism: the module's hidden-state input (its first positional argument,
    else ``hidden_states=``) arrives as a sequence shard and is gathered (a Replicate DTensor), as
    ``PrepareModuleInput`` does for a fixed signature."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def gather(x):
            if isinstance(x, DTensor):
                return x.redistribute(device_mesh, [Replicate()])
            if isinstance(x, torch.Tensor):
                return DTensor.from_local(x, device_mesh, [Shard(1)], run_check=False).redistribute(
                    device_mesh, [Replicate()])
            return x

        def hook(mod, args, kwargs):
            if args:
                return (gather(args[0]), *args[1:]), kwargs
            if "hidden_states" in kwargs:
                return args, {**kwargs, "hidden_states": gather(kwargs["hidden_states"])}
            raise ValueError(f"sequence_gather on {type(mod).__name__}: no positional nor hidden_states input")

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


def _style(value: str | ParallelStyle, sp: bool) -> ParallelStyle | None:
    if isinstance(value, ParallelStyle):
        return value
    if value == "colwise":
        return ColwiseParallel()
    if value == "rowwise":
        return RowwiseParallel(output_layouts=Shard(1) if sp else Replicate())
    if value == "sequence_parallel":
        return SequenceParallel() if sp else None
    if value == "sequence_gather":
        return GatherSequence() if sp else None
    if value == "head_norm":  # the heads dim as the "sequence" dim: Replicate weight, Partial grad summed
        return SequenceParallel(sequence_dim=2, use_local_output=True)
    raise ValueError(f"unknown tp_plan style {value!r}")


def capabilities_of(model: nn.Module) -> Capabilities | None:
    """What ``parallelize_model`` checks a layout against (None: the built-in model)."""
    return getattr(model, "capabilities", None)
