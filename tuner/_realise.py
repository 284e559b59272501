"""How the workers realise a layout, part by part: the one description that the memory and time
models read and that ``workers.parallelize.parallelize_model`` asserts.

``realise(layout, model, cluster, training)`` returns a ``Realisation`` or raises ``LayoutError``
naming what the workers cannot run; ``check_supported(layout, model, capabilities)`` is the workers'
own pre-launch check (``parallelize_model`` calls it: one rule, here, not a copy). Two layouts that
run the identical program have equal Realisations (``Layout`` knobs that change nothing are not
fields). What the workers do for each parallelism, and why: docs/tuner.md, "Realisation".
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, NamedTuple

from tuner._errors import LayoutError
from tuner._layout import Layout, microbatches
from tuner._specs import ClusterSpec, ModelSpec, TrainingSpec

FP32, BF16 = 4, 2
ADAM_STATE_BYTES = 8  # AdamW momentum + variance in fp32 (the master weights are the parameters)


@dataclass(frozen=True)
class StateSharding:
    """One class of parameters on a rank (dense, or routed experts): over how many ranks its
    gradients are averaged and its weights / gradients / optimizer state are sharded (1 =
    replicated), in which bytes per element. The model-parallel split of the tensors themselves
    (tp, ep, pp) comes first and is not counted here."""

    reduce_group: int  # data ranks whose gradients are averaged (1: none)
    weights: int  # fp32 master weights at rest
    grads: int  # gradients the optimizer steps on
    optimizer: int  # AdamW state
    weight_bytes: int = FP32
    grad_bytes: int = FP32
    optimizer_bytes: int = ADAM_STATE_BYTES

    def __post_init__(self) -> None:
        for f in ("reduce_group", "weights", "grads", "optimizer"):
            v = getattr(self, f)
            assert isinstance(v, int) and v >= 1, (f, v)
            assert v in (1, self.reduce_group), (f, v, self.reduce_group)  # sharding is over the data group


@dataclass(frozen=True)
class Collective:
    """One recurring collective: ``op`` over the ranks of ``axes`` moving ``payload``, ``per``
    what, and whether the step waits for it (``blocking``) or it overlaps compute."""

    op: Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"]
    axes: str  # e.g. "tp", "dp*cp*ep"
    payload: str  # what moves, e.g. "layer activations", "kv", "unit grads"
    per: str  # e.g. "layer fwd+bwd", "micro-batch", "step"
    blocking: bool


@dataclass(frozen=True)
class Realisation:
    """What the workers build and hold for one layout (see the module docstring)."""

    tp: int
    cp: int
    ep: int
    dp: int
    pp: int
    stages: int  # pp * vpp
    schedule: str | None  # None without pipelining
    microbatches: int
    mbs: int
    recompute: Literal["none", "selective", "full"]
    sp: bool
    data_parallel: Literal["none", "replicate", "fsdp"]  # torch's replicate (ZeRO-0) or FSDP2
    dense: StateSharding
    experts: StateSharding | None
    compute_bytes: int  # parameters and activations in compute
    gathered: Literal["none", "stage", "unit"]  # FSDP/replicate compute copies of the weights
    fsdp_buffer_units: int  # ZeRO-3: units whose unsharded weights FSDP holds at once
    grad_sync: Literal["none", "every_microbatch", "last_microbatch"]
    grads_held_unsharded: bool  # full-size gradients kept between micro-batches
    unsharded_grad_bytes: int
    autocast_weight_copies: bool
    experts_tp: bool
    logits_sharded: bool
    cp_kv: Literal["none", "kv_heads"]  # full-sequence K/V saved per layer under cp, kv_heads-sized
    swiglu_saved: int
    collectives: tuple[Collective, ...]

    def __post_init__(self) -> None:
        assert self.stages % self.pp == 0 and self.microbatches >= 1
        assert (self.data_parallel == "none") == (self.dense.reduce_group == 1), self
        assert (self.schedule is None) == (self.pp == 1), self
        assert not (self.grads_held_unsharded and self.microbatches == 1), self
        assert self.gathered != "unit" or self.fsdp_buffer_units > 0, self


@dataclass(frozen=True)
class Capabilities:
    """What a workload (workers/workload.py: the model code a trial trains) declares it can realise,
    as plain data so that the tuner refuses a layout it cannot run before any process starts (valid
    means runnable). The built-in model realises everything (the defaults)."""

    workload: str = "builtin"
    tp: bool = True
    sp: bool = True
    pp: bool = True
    cp: bool = True
    ep: bool = True
    ac: tuple[str, ...] = ("none", "selective", "full")
    replicated_kv: bool = True  # tp > kv_heads (tp % kv_heads == 0): k/v projections kept whole

    def __post_init__(self) -> None:
        for f in ("tp", "sp", "pp", "cp", "ep", "replicated_kv"):
            if not isinstance(getattr(self, f), bool):
                raise TypeError(f"Capabilities.{f} must be a bool, got {getattr(self, f)!r}")
        object.__setattr__(self, "ac", tuple(self.ac))
        if "none" not in self.ac or not set(self.ac) <= {"none", "selective", "full"}:
            raise ValueError(f"Capabilities.ac must hold 'none' and only none/selective/full, got {self.ac!r}")

    def refusal(self, layout: Layout, model: ModelSpec) -> str | None:
        """Why this workload cannot realise ``layout`` of ``model``, or None."""
        for axis in ("tp", "pp", "cp", "ep"):
            if getattr(layout, axis) > 1 and not getattr(self, axis):
                return f"workload {self.workload!r} does not support {axis} ({axis}={getattr(layout, axis)})"
        if layout.sp and layout.tp > 1 and not self.sp:
            return f"workload {self.workload!r} does not support sequence parallelism (sp=True)"
        if layout.ac not in self.ac:
            return f"workload {self.workload!r} does not support ac={layout.ac!r} (supports {', '.join(self.ac)})"
        if layout.tp > model.kv_heads and not self.replicated_kv:
            return (f"workload {self.workload!r} needs tp={layout.tp} to divide kv_heads={model.kv_heads} "
                    "(it cannot keep k/v projections whole)")
        return None

    def space_limits(self) -> dict[str, tuple]:
        """The search-space restriction that keeps every enumerated layout realisable."""
        out: dict[str, tuple] = {axis: (1,) for axis in ("tp", "pp", "cp", "ep") if not getattr(self, axis)}
        if not self.sp or not self.tp:
            out["sp"] = (False,)
        if tuple(self.ac) != ("none", "selective", "full"):
            out["ac"] = tuple(self.ac)
        return out


def builtin_capabilities(model: ModelSpec) -> Capabilities:
    """What the built-in model (workers/model.py) realises for ``model``'s shape.

    Every axis for every shape ModelSpec describes (explicit head_dim, q/k/v biases, per-head q/k
    RMSNorm, GeGLU, sandwich norms: workers/parallelize.py ``block_tp_plan``), except sequence
    parallelism with a shared expert: its sigmoid gate would need the whole sequence on every tp rank
    beside the experts' sequence shard, which the built-in TP plan does not build. The transformers
    workload (workers/workload_hf.py) declares its own."""
    return _builtin_capabilities(not model.shared_expert_ffn)


@lru_cache(maxsize=2)
def _builtin_capabilities(sp: bool) -> Capabilities:
    return Capabilities(workload="builtin", sp=sp)


def builtin_refusal(layout: Layout, model: ModelSpec) -> str | None:
    """Why the built-in model cannot train ``model`` under ``layout`` (``builtin_capabilities``,
    with the reason named), or None. A whole shape it does not build: non-SwiGLU experts (no
    supported Hugging Face architecture has them)."""
    if model.is_moe and model.mlp != "swiglu":
        return f"the built-in model's experts are SwiGLU, not mlp={model.mlp!r}: use the transformers workload"
    if layout.tp > 1 and layout.sp and model.shared_expert_ffn:
        return (f"the built-in model realises a shared expert (shared_expert_ffn={model.shared_expert_ffn}) "
                f"only without sp (tp={layout.tp}, sp=True)")
    return builtin_capabilities(model).refusal(layout, model)


def check_supported(layout: Layout, model: ModelSpec, capabilities: Capabilities | None = None) -> None:
    """Raise LayoutError (naming the values) for what the workers cannot build; the check
    ``parallelize_model`` runs before touching the model. ``capabilities``: what the trial's
    workload declares (None: the built-in model, ``builtin_refusal``)."""
    if capabilities is not None and (why := capabilities.refusal(layout, model)) is not None:
        raise LayoutError(why)
    if (capabilities is None or capabilities.workload == "builtin") and (why := builtin_refusal(layout, model)):
        raise LayoutError(why)
    tp = layout.tp
    if tp > 1 and model.kv_heads % tp and tp % model.kv_heads:
        raise LayoutError(f"tp={tp} and kv_heads={model.kv_heads}: neither divides the other")
    if tp > 1 and model.heads % tp:
        raise LayoutError(f"tp={tp} does not divide heads={model.heads}")
    ffn = model.expert_ffn if model.is_moe else model.ffn
    if tp > 1 and ffn % tp:
        raise LayoutError(f"tp={tp} does not divide {'expert_ffn' if model.is_moe else 'ffn'}={ffn}")
    if layout.ep > 1 and (not model.is_moe or model.experts % layout.ep):
        raise LayoutError(f"ep={layout.ep} needs a MoE model whose experts ({model.experts}) it divides")


@lru_cache(maxsize=1024)
def _collectives(tp: bool, sp: bool, moe: bool, cp: bool, ep: bool, pp: bool, dp_axes: str, dp_kind: str, sync: str,
                 zero3: bool, *, logits_sharded: bool) -> tuple[Collective, ...]:
    """The recurring collectives of a layout with these axes (> 1) and data-parallel program."""
    out = []
    if tp:
        tp_op = ("all_gather", "reduce_scatter") if sp else ("all_reduce",)
        for op in tp_op:
            out.append(Collective(op, "tp", "layer activations (attention and MLP)", "layer fwd+bwd", True))
        if moe:
            out.append(Collective("all_reduce", "tp", "routed tokens' expert outputs (top_k copies)",
                                  "layer fwd+bwd", True))
        if logits_sharded:
            out.append(Collective("all_reduce", "tp", "loss-parallel max and sum-exp per token", "micro-batch", True))
        else:
            out.append(Collective("all_gather", "tp", "logits (V/tp per rank -> V)", "micro-batch fwd", True))
    if cp:
        out.append(Collective("all_gather", "cp", "kv (kv_heads)", "layer fwd", True))
        out.append(Collective("reduce_scatter", "cp", "kv grads (kv_heads)", "layer bwd", True))
    if ep:
        out.append(Collective("all_to_all", "ep", "routed tokens (dispatch + combine)", "layer fwd+bwd", True))
    if pp:
        out.append(Collective("send_recv", "pp", "stage activations / grads", "micro-batch", True))
    if dp_kind != "none":
        per = "micro-batch" if sync == "every_microbatch" else "step"
        if dp_kind == "replicate":
            out.append(Collective("all_reduce", dp_axes, "unit grads", per, False))
        else:
            out.append(Collective("reduce_scatter", dp_axes, "unit grads", per, False))
            out.append(Collective("all_gather", dp_axes, "unit weights", "micro-batch fwd+bwd" if zero3 else "step",
                                  False))
    return tuple(out)


class Holding(NamedTuple):
    """How a rank holds its model states: the Realisation fields of the same names (see there), which
    depend on the layout only through the degrees, ZeRO and the micro-batch count (``holding``)."""

    tp: int
    data_parallel: str
    dense: StateSharding
    experts: StateSharding | None
    compute_bytes: int
    gathered: str
    fsdp_buffer_units: int
    grad_sync: str
    grads_held_unsharded: bool
    unsharded_grad_bytes: int
    autocast_weight_copies: bool


def holding(tp: int, cp: int, ep: int, dp: int, zero: int, microbatches: int, precision: str, device_kind: str,
            moe: bool, data_parallel: str = "workers", pipelined: bool = False) -> Holding:
    """The model-state part of ``realise`` (the module docstring says what the workers do), for a
    mesh, ZeRO level and micro-batch count of a model (``moe``) trained in ``precision`` on
    ``device_kind`` devices; the memory model reads it per (mesh, zero, micro-batches).
    ``data_parallel``: the stack's data-parallel program (tuner/_stack.py), whose collectives the time
    model prices from the same tables: "workers" is the workers'; ``pipelined`` (pp > 1) matters
    only to "fsdp2"."""
    data, one, bf16 = dp * cp * ep, microbatches == 1, precision == "bf16" and device_kind == "cuda"
    if data_parallel == "workers":
        return _holding(tp, data, dp * cp, zero, one, bf16, moe)
    return _stack_holding(tp, data, dp * cp, zero, one, bf16, moe, data_parallel,
                          pipelined and data_parallel == "fsdp2")


@lru_cache(maxsize=4096)
def _stack_holding(tp: int, data: int, expert_data: int, zero: int, one_microbatch: bool, bf16: bool, moe: bool,
                   program: str, pipelined: bool) -> Holding:
    """``holding`` of another stack's data-parallel program, as the workers' holding it equals or as
    what it changes there.

    fsdp2 (torchtitan): without pipelining FSDP2 syncs after every micro-batch, so its ZeRO-1 holds
    as ZeRO-2 does; under torch.distributed.pipelining with m > 1 the stage runs every backward
    without sync and without reshard (torch/distributed/pipelining/stage.py), so every ZeRO level
    holds unsharded fp32 gradients until the step's end and ZeRO-3 keeps each gathered weight after
    its first backward (the whole stage, as ZeRO-1/2 do).
    megatron: ZeRO-1 is the distributed optimizer: bf16 weights whole, the fp32 main-gradient buffer
    whole, the fp32 master weights and AdamW state sharded (6 + 12/d bytes per parameter, Megatron-LM
    docs/source/api-guide/dist_optimizer.md); ZeRO-0 (DDP: 18 bytes) and Megatron-FSDP's ZeRO-2/3
    hold as the workers' do."""
    if program == "fsdp2":
        if not (pipelined and not one_microbatch):
            return _holding(tp, data, expert_data, 2 if zero == 1 else zero, True, bf16, moe)
        held = _holding(tp, data, expert_data, 1 if zero == 2 else zero, False, bf16, moe)
        if held.data_parallel == "fsdp":
            held = held._replace(grad_sync="last_microbatch", grads_held_unsharded=True, gathered="stage",
                                 fsdp_buffer_units=0)
        return held
    held = _holding(tp, data, expert_data, zero, one_microbatch, bf16, moe)
    if program == "megatron" and zero == 1 and data > 1:
        dense = StateSharding(reduce_group=data, weights=data, grads=1, optimizer=data)
        experts = None
        if moe:
            es = expert_data if expert_data > 1 else 1
            experts = StateSharding(reduce_group=expert_data, weights=es, grads=1, optimizer=es)
        held = held._replace(dense=dense, experts=experts, grad_sync="last_microbatch", grads_held_unsharded=False)
    return held


@lru_cache(maxsize=4096)
def _holding(tp: int, data: int, expert_data: int, zero: int, one_microbatch: bool, bf16: bool, moe: bool) -> Holding:
    """``holding`` of ``data`` (dense) and ``expert_data`` (routed experts) data ranks."""
    zero = zero if data > 1 else 0  # no data axis: nothing to shard or reduce
    dp_kind = "none" if data == 1 else ("replicate" if zero == 0 else "fsdp")
    # The same rule with and without pipelining (decision 6, workers.rank_model._SyncingStage).
    if dp_kind == "none":
        sync = "none"
    elif zero in (2, 3) or one_microbatch:
        sync = "every_microbatch"
    else:
        sync = "last_microbatch"
    if zero == 1 and one_microbatch:
        zero = 2  # the same program: one reduce-scatter after the only backward
    shard = data if zero >= 1 else 1
    dense = StateSharding(reduce_group=data, weights=shard, grads=shard, optimizer=shard)
    experts = None
    if moe:
        eshard = expert_data if zero >= 1 else 1
        experts = StateSharding(reduce_group=expert_data, weights=eshard, grads=eshard, optimizer=eshard)
    # ZeRO-0 (replicate) computes on the weights themselves in fp32, on one bf16 copy of them from
    # the first forward to the last backward in bf16: the same hold as ZeRO-1/2's gathered weights.
    if zero == 3:
        gathered = "unit"
    elif dp_kind == "none" or (zero == 0 and not bf16):
        gathered = "none"
    else:
        gathered = "stage"
    return Holding(
        tp=tp, data_parallel=dp_kind, dense=dense, experts=experts, compute_bytes=BF16 if bf16 else FP32,
        gathered=gathered, fsdp_buffer_units=2 if zero == 3 else 0, grad_sync=sync,
        grads_held_unsharded=sync == "last_microbatch", unsharded_grad_bytes=FP32,
        autocast_weight_copies=bf16 and dp_kind == "none",
    )


def realise(layout: Layout, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
            capabilities: Capabilities | None = None) -> Realisation:
    """The workers' realisation of ``layout`` (see the module docstring); LayoutError if they
    cannot run it (``capabilities``: the trial's workload, see ``check_supported``)."""
    check_supported(layout, model, capabilities)
    m = microbatches(layout, training)
    held = holding(layout.tp, layout.cp, layout.ep, layout.dp, layout.zero, m, training.precision,
                   cluster.device_kind, model.is_moe)
    tp, cp, ep, pp, sp = layout.tp, layout.cp, layout.ep, layout.pp, layout.sp
    dp_axes = "*".join(a for a, n in (("dp", layout.dp), ("cp", cp), ("ep", ep)) if n > 1)
    return Realisation(
        cp=cp, ep=ep, dp=layout.dp, pp=pp, stages=layout.stages,
        schedule=layout.schedule if pp > 1 else None,
        microbatches=m, mbs=layout.mbs, recompute=layout.ac, sp=sp,
        **held._asdict(),
        experts_tp=model.is_moe and tp > 1,
        logits_sharded=tp > 1,
        cp_kv="kv_heads" if cp > 1 else "none",
        swiglu_saved=4,
        collectives=_collectives(tp > 1, sp, model.is_moe, cp > 1, ep > 1, pp > 1, dp_axes, held.data_parallel,
                                 held.grad_sync, held.gathered == "unit", logits_sharded=tp > 1),
    )
