"""Training stacks: what the runtime a layout is trained with does that changes its memory and time.

One small frozen dataclass per stack (``Stack``), each property with its source. ``training.stack``
names one (``STACKS``); the one memory model (tuner/_memory.py) and the one time model
(tuner/_timing.py) read it, and so do the model states (``tuner._realise.holding``). ``meshtune`` is
meshtune's own workers (what a sweep measures, and what tests/workers/test_memory_harness.py checks the memory
model against); ``torchtitan`` and ``megatron`` are those frameworks as meshtune's exports configure
them (tuner/_export_titan.py, tuner/_export_megatron.py). The long story is docs/stacks.md.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from tuner._errors import SpecError

# Collectives of the data-parallel program of one ZeRO level, in three slots: (hidable once per step,
# exposed once per step, hidable once per micro-batch), each slot a count of (all-gathers of the
# weights, reduce-scatters of the gradients, all-reduces of the gradients) of the rank's largest
# stage. tuner/_timing.py prices the collectives and tuner._timing.step_time hides what is hidable.
Counts = tuple[int, int, int]
Program = tuple[Counts, Counts, Counts]
_ = (0, 0, 0)
AG, RS, AR, AG_RS, AG2_RS = (1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 1, 0), (2, 1, 0)

# The workers (tuner/_realise.py; the same with and without pipelining, decision 6 there):
#   ZeRO-0: torch's replicate, per-unit all-reduces overlapped with the last backward.
#   ZeRO-1: gradients accumulate unsharded, one reduce-scatter in the last backward, one all-gather
#     of the updated shards in the next forward.
#   ZeRO-2: reduce-scatter every backward, so every forward all-gathers again.
#   ZeRO-3: all-gather forward and backward, reduce-scatter, per micro-batch.
WORKERS: dict[int, Program] = {0: (AR, _, _), 1: (AG_RS, _, _), 2: (_, _, AG_RS), 3: (_, _, AG2_RS)}
# torchtitan without pipelining: FSDP2 syncs after every micro-batch of its gradient accumulation
# (torchtitan/train.py runs each one's backward with the sync on), its ZeRO-1/2 keep the weights
# gathered from forward to backward (fsdp_reshard_after_forward "never", tuner/_export_titan.py).
FSDP2: dict[int, Program] = {0: (_, _, AR), 1: (_, _, AG_RS), 2: (_, _, AG_RS), 3: (_, _, AG2_RS)}
# torch.distributed.pipelining driving FSDP itself (torch/distributed/pipelining/stage.py, torchtitan):
# every backward runs without gradient sync and without reshard, and one reduce-scatter (all-reduce
# at ZeRO-0) runs after the schedule's last backward (``perform_reduce_grad``), nothing left to hide
# it behind. ZeRO-1/2 then gather once per step; ZeRO-3 reshards after each forward, and a module's
# gather is needed by each forward that follows a forward and each backward that follows a forward:
# m + 1 gathers per step whatever the schedule (a run of k forwards costs k, or k - 1 after a
# backward, plus the backward after it).
PIPELINING: dict[int, Program] = {0: (_, AR, _), 1: (AG, RS, _), 2: (AG, RS, _), 3: (AG, RS, AG)}
# Megatron-LM as meshtune's export configures it (tuner/_export_megatron.py: --overlap-grad-reduce
# whenever there are data ranks, not --overlap-param-gather), the same with and without pipelining:
#   ZeRO-0: DDP, one all-reduce of the fp32 main gradients per step, bucket by bucket as the last
#     micro-batch's backward produces them (megatron/core/distributed/distributed_data_parallel.py,
#     ``no_sync`` for the others).
#   ZeRO-1: --use-distributed-optimizer: one reduce-scatter per step, overlapped the same way, and
#     after the optimizer step one all-gather of the updated bf16 weights, exposed without
#     --overlap-param-gather (megatron/core/optimizer/distrib_optimizer.py).
#   ZeRO-2: Megatron-FSDP ``optim_grads``: gradients reduce-scattered after every micro-batch's
#     backward, overlapped (megatron_fsdp.py: ``grad_reduce_every_bprop``; it forces
#     overlap_grad_reduce), the updated weights all-gathered once per step, exposed.
#   ZeRO-3: Megatron-FSDP ``optim_grads_params``: all-gather forward and backward and reduce-scatter
#     per micro-batch, overlapped (it forces overlap_param_gather too).
MEGATRON: dict[int, Program] = {0: (AR, _, _), 1: (RS, AG, _), 2: (_, AG, RS), 3: (_, _, AG2_RS)}

DATA_PARALLEL = ("workers", "fsdp2", "megatron")


@dataclass(frozen=True)
class Stack:
    """What one training runtime does that changes a layout's memory and time (validated here; each
    stack below cites where each value comes from).

    ``attention``: the attention kernel. "flash" keeps the fp32 log-sum-exp instead of the scores and
    skips the causal mask's masked half (Dao et al. 2022); "materialised" keeps the softmax output
    and computes all of s² at the matmuls' rate (Megatron 2021, Narayanan et al. 2021).
    ``repeats_kv``: without context parallelism the attention repeats K and V to the query heads
    before the kernel, which saves them so (GQA kernels take kv_heads-sized K and V).
    ``fused_norms``: RMSNorm is one kernel that keeps its input and 1/rms; unfused (torch's composite
    RMSNorm) it also keeps the normalised input and the fp32 reciprocal RMS per token.
    ``swiglu_saved``: ffn-wide tensors SwiGLU keeps per token: 4 eagerly (gate, silu(gate), up,
    product), 3 fused (gate and up, and the product, the down projection's input).
    ``sequence_parallel``: "dtensor": the all-gather hands the attention and the MLP the whole
    sequence and their matmuls save it; "megatron": they save their sequence shard and all-gather it
    again in the backward, overlapped with the input-gradient GEMM (Korthikanti et al. 2022 Sec. 4.2.2),
    exposed only where the gather outlasts that GEMM (tuner/_timing.py).
    ``data_parallel``: the data-parallel program per ZeRO level (the tables above, and
    ``tuner._realise.holding`` for what the model states hold): "workers", "fsdp2" (torchtitan's
    FSDP2, deferred to the step's end under torch.distributed.pipelining), "megatron".
    ``reduce_bytes``: bytes per gradient element in the data-parallel reduction.
    ``dgrad_overlap``: a column-parallel linear's backward (qkv, fc1, the output head) issues the
    tensor-parallel reduction of its input gradient (reduce-scatter under sequence parallelism, else
    all-reduce) asynchronously and computes its weight gradient meanwhile, so the reduction is hidden
    up to that GEMM's time; the row-parallel linears' backward all-gather (under sequence
    parallelism) stays exposed.
    ``end_stages``: the embedding and the output head with the loss can be pipeline stages of their
    own, without a decoder layer (a layout may have up to layers + 2 stages); the partition balances
    them by compute like any stage (tuner/_partition.py).
    ``interleavings``: the virtual stages per pipeline rank that the search space tries with this
    stack where it names none (``SearchSpace.vpp`` unset).
    """

    name: str
    attention: Literal["flash", "materialised"]
    repeats_kv: bool
    fused_norms: bool
    swiglu_saved: int
    sequence_parallel: Literal["dtensor", "megatron"]
    data_parallel: Literal["workers", "fsdp2", "megatron"]
    reduce_bytes: int
    dgrad_overlap: bool
    end_stages: bool
    interleavings: tuple[int, ...]
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise SpecError(f"stack.name must be a non-empty string, got {self.name!r}")
        choices = {"attention": ("flash", "materialised"), "sequence_parallel": ("dtensor", "megatron"),
                   "data_parallel": DATA_PARALLEL, "swiglu_saved": (3, 4), "reduce_bytes": (2, 4)}
        for f, allowed in choices.items():
            v = getattr(self, f)
            if isinstance(v, bool) or v not in allowed:
                raise SpecError(f"stack.{f} must be one of {allowed}, got {v!r}")
        for f in ("repeats_kv", "fused_norms", "dgrad_overlap", "end_stages"):
            if not isinstance(getattr(self, f), bool):
                raise SpecError(f"stack.{f} must be true or false, got {getattr(self, f)!r}")
        v = self.interleavings
        if (not isinstance(v, tuple) or not v
                or any(isinstance(x, bool) or not isinstance(x, int) or x < 2 for x in v)):
            raise SpecError(f"stack.interleavings must be a non-empty tuple of integers >= 2, got {v!r}")

    @property
    def flash(self) -> bool:
        return self.attention == "flash"

    @property
    def saves_gathered(self) -> bool:
        return self.sequence_parallel == "dtensor"

    def program(self, zero: int, pipelined: bool) -> Program:
        """The data-parallel collectives of ``zero`` (see the tables above)."""
        if self.data_parallel == "workers":
            return WORKERS[zero]
        if self.data_parallel == "fsdp2":
            return (PIPELINING if pipelined else FSDP2)[zero]
        return MEGATRON[zero]

    def to_dict(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


STACKS: dict[str, Stack] = {s.name: s for s in (
    Stack(
        name="meshtune",
        description="meshtune's own workers (workers/model.py, workers/parallelize.py): what a sweep measures",
        attention="flash",  # torch SDPA, causal (workers/model.py causal_sdpa)
        repeats_kv=True,  # workers/model.py repeat_kv before SDPA (measured: tests/workers/test_memory_harness.py)
        fused_norms=False,  # nn.RMSNorm, composite on the CPU ranks the harness measures
        swiglu_saved=4,  # workers/model.py: w2(silu(w1 x) * w3 x), eager
        sequence_parallel="dtensor",  # DTensor SequenceParallel (workers/parallelize.py)
        data_parallel="workers",  # FSDP2 / replicate synced per ZeRO level (tuner/_realise.py, decision 6)
        reduce_bytes=4,  # FSDP2 MixedPrecisionPolicy(reduce_dtype=float32)
        # DTensor's ColwiseParallel: autograd runs the input gradient's reduction after the linear's
        # backward, both GEMMs done (workers/parallelize.py; no async TP)
        dgrad_overlap=False,
        end_stages=False,  # workers/parallelize.py split_stages: every stage holds a decoder layer
        interleavings=(2, 4),
    ),
    Stack(
        name="torchtitan",
        description="torchtitan 0.2 (pytorch/torchtitan), as meshtune's torchtitan export configures it",
        attention="flash",  # models/attention.py: SDPA on the cuDNN / flash backends
        repeats_kv=False,  # models/llama3/model/model.py: SDPA with enable_gqa=True, K/V not repeated
        fused_norms=False,  # models/llama3/model/model.py: nn.RMSNorm, the workers' module
        swiglu_saved=4,  # models/llama3/model/model.py: w2(F.silu(w1(x)) * w3(x)), eager without compile
        sequence_parallel="dtensor",  # models/llama3/infra/parallelize.py apply_tp: SequenceParallel + DTensor
        data_parallel="fsdp2",  # FSDP2 fully_shard; torch.distributed.pipelining's stage syncs at the step's end
        reduce_bytes=4,  # config/job_config.py: mixed_precision_reduce = "float32"
        # DTensor's ColwiseParallel as the workers' (async TP needs torch.compile: the export sets neither)
        dgrad_overlap=False,
        end_stages=False,  # the export splits the layers as the workers do (tuner/_export_titan.py)
        interleavings=(2, 4),
    ),
    Stack(
        name="megatron",
        description="Megatron-LM (megatron-core 0.16, Transformer Engine), as meshtune's Megatron export "
                    "configures it",
        attention="flash",  # TE DotProductAttention: flash / cuDNN fused attention (--attention-backend auto)
        repeats_kv=False,  # TE's attention takes num_gqa_groups K/V heads
        fused_norms=True,  # TE RMSNorm / LayerNormLinear: input and rsigma
        swiglu_saved=3,  # --bias-swiglu-fusion (default on): fc1's [gate, up] and the fc2 input
        sequence_parallel="megatron",  # tensor_parallel/layers.py: the backward re-gathers the input
        data_parallel="megatron",  # DDP / distributed optimizer / Megatron-FSDP (tables above)
        reduce_bytes=4,  # megatron/training/arguments.py: bf16 accumulates and reduces gradients in fp32
        # megatron/core/tensor_parallel/layers.py LinearWithGradAccumulationAndAsyncCommunication.backward:
        # the reduce-scatter (all-reduce without SP) of grad_input is issued async_op=True "before the
        # weight gradient computation" and waited on after it (TE's LayerNormLinear/Linear alike)
        dgrad_overlap=True,
        # --pipeline-model-parallel-layout takes an embedding-only first and a loss-only last stage
        # ("E|t...|...|L", megatron/core/transformer/pipeline_parallel_layer_layout.py; the export writes
        # it: tuner/_export_megatron.py); Llama 3 split its 405B so (Dubey et al. 2024 Sec. 3.3.2)
        end_stages=True,
        # Megatron's recipes of the largest models interleave 8 virtual stages (Megatron-Bridge's Llama 3.1
        # 405B H100 recipe: pp8 vpp8), as Llama 3's 405B did (8 chunks per rank, the ends among them)
        interleavings=(2, 4, 8),
    ),
)}

DEFAULT_STACK = "meshtune"


def check_stack(name: object, *, field: str = "training.stack") -> str:
    """``name`` if it names a stack, else SpecError naming ``field`` and the value."""
    if not isinstance(name, str) or name not in STACKS:
        raise SpecError(f"{field}={name!r} is not a known stack (known: {', '.join(sorted(STACKS))})")
    return name


def stack_of(training: object) -> Stack:
    """The stack a TrainingSpec names (``training.stack``)."""
    return STACKS[getattr(training, "stack", DEFAULT_STACK)]
