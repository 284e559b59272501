"""Published layouts of large training runs, with what their authors reported.

Usable as sweep seeds and to sanity-check the analytical model: it must find each one feasible and
predict a utilisation near the reported one. ``mfu_kind`` says which utilisation a paper reports:
"model" (PaLM-style model FLOPs, no recompute) or "hardware" (Megatron's formula, which counts the
recomputed forward). Knobs a paper does not state (schedule, ZeRO stage, recompute) are marked as
assumptions in ``notes``. Each row is costed for the stack it names in ``training.stack``
(tuner/_stack.py): ``megatron`` for all of them, the stack of Megatron-LM's fused kernels that these
runs used (Megatron-LM itself; BLOOM's Megatron-DeepSpeed; Llama 3's own stack, whose fused SwiGLU,
GQA attention and Megatron-style sequence parallelism it shares), so that ``meshtune plan --stack
megatron`` plans them as they are checked here.
"""

from __future__ import annotations

from dataclasses import dataclass

from tuner._layout import Layout, check_layout
from tuner._presets import cluster_spec, model_spec
from tuner._specs import ClusterSpec, GiB, ModelSpec, TrainingSpec


@dataclass(frozen=True)
class ReferenceLayout:
    name: str
    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    layout: Layout
    reported_mfu: float  # fraction of peak, of the kind ``mfu_kind``
    mfu_kind: str  # "model" or "hardware"
    reported_tflops_per_device: float
    source: str
    notes: str = ""

    @property
    def reported_tokens_per_s_per_device(self) -> float:
        """Derived from the reported FLOP rate and the paper's own FLOPs-per-token convention."""
        from tuner._formulas import model_flops_per_token, recompute_flops_per_token_per_layer

        per_token = model_flops_per_token(self.model)
        if self.mfu_kind == "hardware":
            per_token += self.model.layers * recompute_flops_per_token_per_layer(self.model, self.layout.ac)
        return self.reported_tflops_per_device * 1e12 / per_token


def _gpt(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    """The GPT shapes of Narayanan et al. 2021: vocab 51200, sequence 2048, 4h GeLU MLP, tied head."""
    return ModelSpec(name, layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn=4 * hidden,
                     vocab=51200, seq_len=2048, tied_embeddings=True, mlp="gelu")


def _selene(nodes: int) -> ClusterSpec:
    # Selene: DGX A100 80GB nodes, NVSwitch, 8 x 200 Gb/s HDR InfiniBand per node (Narayanan 2021 Sec. 5).
    return cluster_spec({"preset": "a100-80g", "name": "selene", "nodes": nodes})


_NARAYANAN = "Narayanan et al. 2021, Efficient Large-Scale LM Training on GPU Clusters (SC'21), Table 1"
# Sec. 5.1: "we use the interleaved pipeline schedule with the scatter/gather optimization enabled".
# The scatter/gather optimisation sends 1/t of each stage boundary's activation (Sec. 4.1), which is
# what sequence parallelism's p2p costs here (sp=True stands for it; SP's TP traffic is the same volume).
_MEGATRON_NOTES = ("stated (Sec. 5.1): interleaved schedule, scatter/gather (as sp); assumed: vpp 2 (the "
                   "smallest interleaving), mbs 1, full recompute, no ZeRO (Megatron 2021 had no distributed optimizer); "
                   "costed as today's Megatron-LM (stack megatron: flash attention, the gradient all-reduce "
                   "overlapped, the column-parallel input gradients reduced behind the weight-gradient GEMMs), "
                   "where the 2021 run materialised the scores, reduced after the pipeline flush and reduced the "
                   "input gradients before computing the weight gradients (the asynchronous TP all-reduce came later)")


def _llama3(name: str, *, nodes: int, dp: int, cp: int, seq: int, mfu: float, tflops: float, row: int,
            ac: str = "none") -> ReferenceLayout:
    """A row of Dubey et al. 2024, Table 4: tp8 pp16, a 16M-token batch (16,384 sequences of 8K or
    128 of 128K), BF16 MFU after Chowdhery et al. (PaLM's convention, Sec. 3.3.2)."""
    return ReferenceLayout(
        name=name,
        model=model_spec({"preset": "llama3-405b", "seq_len": seq}),
        # 8 H100 (80 GB, 700 W) per node, 400 Gb/s RoCE per GPU (Dubey et al. 2024, Sec. 3.3.1).
        cluster=cluster_spec({"preset": "h100-sxm", "name": "llama3-cluster", "nodes": nodes}),
        training=TrainingSpec(global_batch=16 * 2**20 // seq, stack="megatron"),
        layout=Layout(tp=8, cp=cp, pp=16, dp=dp, mbs=1, zero=2, sp=True, ac=ac, schedule="interleaved", vpp=8),
        reported_mfu=mfu, mfu_kind="model", reported_tflops_per_device=tflops,
        source=f"Dubey et al. 2024, The Llama 3 Herd of Models, Table 4 (row {row}: {nodes * 8:,} GPUs, seq {seq:,})",
        notes=("stated: tp8 pp16, the cp and dp of the row, 16M-token batch, no activation checkpointing at 8K "
               "(Sec. 3.3.2), the CP all-gather exposed, the embedding and the output head with the loss on "
               "chunks of their own (Sec. 3.3.2: the first and the last stage hold a layer fewer); assumed: a "
               "fused SwiGLU, attention-block recompute at 128K (see "
               "tuner/_references.py), interleaved with vpp 8 (126 layers + the 2 ends = 16 stages x 8 chunks "
               "of one each), FSDP without resharding after "
               "forward as ZeRO-2 (stack megatron: Megatron-FSDP optim_grads, gradients reduce-scattered after every "
               "micro-batch, the one program under which the 8K row fits without recompute), sequence parallel"),
    )


_REFS = (
    ReferenceLayout(
        name="megatron-18b-256-a100",
        model=_gpt("gpt-18.4b", 40, 6144, 48),
        cluster=_selene(32),
        training=TrainingSpec(global_batch=1024, stack="megatron"),
        layout=Layout(tp=8, pp=1, dp=32, mbs=1, ac="full"),
        reported_mfu=0.43, mfu_kind="hardware", reported_tflops_per_device=135.0,
        source=_NARAYANAN + ", 18.4B row", notes=_MEGATRON_NOTES,
    ),
    ReferenceLayout(
        name="megatron-145b-1536-a100",
        model=_gpt("gpt-145.6b", 80, 12288, 96),
        cluster=_selene(192),
        training=TrainingSpec(global_batch=2304, stack="megatron"),
        layout=Layout(tp=8, pp=8, dp=24, mbs=1, ac="full", sp=True, schedule="interleaved", vpp=2),
        reported_mfu=0.47, mfu_kind="hardware", reported_tflops_per_device=148.0,
        source=_NARAYANAN + ", 145.6B row", notes=_MEGATRON_NOTES,
    ),
    ReferenceLayout(
        name="megatron-530b-2520-a100",
        model=_gpt("gpt-529.6b", 105, 20480, 128),
        cluster=_selene(315),
        training=TrainingSpec(global_batch=2520, stack="megatron"),
        layout=Layout(tp=8, pp=35, dp=9, mbs=1, ac="full", sp=True, schedule="interleaved", vpp=2),
        reported_mfu=0.52, mfu_kind="hardware", reported_tflops_per_device=163.0,
        source=_NARAYANAN + ", 529.6B row", notes=_MEGATRON_NOTES,
    ),
    ReferenceLayout(
        name="megatron-1t-3072-a100",
        model=_gpt("gpt-1t", 128, 25600, 160),
        cluster=_selene(384),
        training=TrainingSpec(global_batch=3072, stack="megatron"),
        layout=Layout(tp=8, pp=64, dp=6, mbs=1, ac="full", sp=True, schedule="interleaved", vpp=2),
        reported_mfu=0.52, mfu_kind="hardware", reported_tflops_per_device=163.0,
        source=_NARAYANAN + ", 1T row", notes=_MEGATRON_NOTES,
    ),
    _llama3("llama3-405b-8k-h100", nodes=1024, dp=128 // 2, cp=1, seq=8192, mfu=0.43, tflops=430.0, row=1),
    _llama3("llama3-405b-16k-h100", nodes=2048, dp=128, cp=1, seq=8192, mfu=0.41, tflops=400.0, row=2),
    # 128K: the paper says no activation checkpointing only for 8K sequences (Sec. 3.3.2: "we could
    # pre-train Llama 3 on 8K sequences without activation checkpointing"). Without it the 128K row
    # keeps each layer's all-gathered K/V as well and the memory model gives 83.4 GiB of 80, so
    # attention-block recompute (ac=selective, the least there is) is ASSUMED; it decides this row:
    # with ac=none the model predicts 45% MFU (+18%).
    _llama3("llama3-405b-128k-h100", nodes=2048, dp=8, cp=16, seq=131072, mfu=0.38, tflops=380.0, row=3,
            ac="selective"),
    ReferenceLayout(
        name="bloom-176b-384-a100",
        model=model_spec("bloom-176b"),
        # Jean Zay: 48 nodes of 8 A100 80GB with NVLink; 4 x 100 Gb/s Omni-Path per node = 6.25 GB/s per GPU.
        cluster=ClusterSpec("jean-zay", nodes=48, devices_per_node=8, device_memory=80 * GiB,
                            peak_flops=312e12, intra_node_bandwidth=300e9, inter_node_bandwidth=6.25e9),
        training=TrainingSpec(global_batch=2048, stack="megatron"),
        layout=Layout(tp=4, pp=12, dp=8, mbs=2, zero=1, ac="full"),
        reported_mfu=0.50, mfu_kind="hardware", reported_tflops_per_device=156.0,
        source="BigScience 2022, BLOOM (arXiv:2211.05100), Sec. 3.4: tp4 pp12 dp8, ZeRO-1, 156 TFLOP/s of 312",
        notes="assumed: 1F1B, mbs 2, full recompute (Megatron-DeepSpeed's FLOP count includes it)",
    ),
)

REFERENCE_LAYOUTS: dict[str, ReferenceLayout] = {r.name: r for r in _REFS}

for _r in _REFS:  # every reference must be a valid layout of its own problem
    check_layout(_r.layout, model=_r.model, cluster=_r.cluster, training=_r.training)
