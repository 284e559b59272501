"""The cited formulas of the memory and time models, each once: short pure functions of numbers
(or of a ModelSpec's shapes), each with its source. The composing models (tuner/_memory.py,
tuner/_timing.py, tuner/_partition.py) and the measured MFU (workers/aggregate.py) call these; no
other module writes a FLOP count, a ZeRO share or a collective's cost again.
"""

from __future__ import annotations

from tuner._specs import ModelSpec

# --- model states ---------------------------------------------------------------------------------

# Bytes per parameter for (weights, gradients, optimizer states) of AdamW.
# bf16 mixed precision: 2 + 2 + 12 (fp32 master, momentum, variance), Rajbhandari et al. 2020 Sec. 3.1.
# fp32: 4 + 4 + 8 (momentum, variance).
STATE_BYTES = {"bf16": (2, 2, 12), "fp32": (4, 4, 8)}


def sharded_bytes(numel: float, elt: int, group: int) -> float:
    """Bytes of ``numel`` elements of ``elt`` bytes split evenly over ``group`` ranks (ZeRO's 1/Nd,
    Rajbhandari et al. 2020 Sec. 5)."""
    return elt * numel / group


def zero_model_state_bytes(
    psi: float, nd: int, stage: int, precision: str = "bf16"
) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes of Ψ params under ZeRO ``stage`` over Nd ranks (Rajbhandari
    et al. 2020, Fig. 1: 16Ψ, 4Ψ+12Ψ/Nd, 2Ψ+14Ψ/Nd, 16Ψ/Nd for bf16 Adam)."""
    p, g, k = STATE_BYTES[precision]
    return (
        sharded_bytes(psi, p, nd if stage >= 3 else 1),
        sharded_bytes(psi, g, nd if stage >= 2 else 1),
        sharded_bytes(psi, k, nd if stage >= 1 else 1),
    )


# --- activations ----------------------------------------------------------------------------------


def korthikanti_layer_activation_bytes(
    s: int, b: int, h: int, a: int, t: int = 1, *, sp: bool = False, recompute: str = "none"
) -> float:
    """Activation bytes of one GPT layer, 16-bit, with dropout (Korthikanti et al. 2022, Table 2)."""
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    score = 0.0 if recompute == "selective" else 5 * a * s / h
    if sp:
        return s * b * h / t * (34 + score)
    return s * b * h * (10 + 24 / t + score / t)


def layer_activation_bytes(
    *,
    s: int,
    b: int,
    h: int,
    a: int,
    kv_dim: int,
    ffn: int,
    mlp: str = "swiglu",
    t: int = 1,
    sp: bool = False,
    ac: str = "none",
    elt: int = 2,
    dropout: bool = False,
    flash: bool = True,
    moe_top_k: int = 0,
    experts: int = 0,
    cp: int = 1,
    swiglu_saved: int = 4,
    kv_repeated: bool = False,
    eager_norms: bool = False,
    gathered_inputs: bool = False,
    ep: int = 1,
    head_dim: int = 0,
    q_dim: int = 0,
    norms: int = 2,
    qk_norm_head_dim: int = 0,
    shared_ffn: int = 0,
) -> float:
    """One layer's saved activations for one micro-batch of b sequences of s tokens (this rank's CP
    share), generalising Korthikanti et al. 2022 Sec. 4 to GQA, SwiGLU, MoE, no dropout, flash attention.

    With ``mlp='gelu', ffn=4h, kv_dim=h, dropout, not flash, elt=2`` and ac none or full it is exactly
    their Table 2. meshtune's "selective" is attention-block recompute, not Korthikanti's (which drops
    only the 5as²b scores, nothing under flash attention): the workers (workers/parallelize.py
    ``apply_ac``) checkpoint the whole attention sub-layer, so it keeps only that sub-layer's input
    (and the norm's input before it) and drops Q, K, V, the scores or log-sum-exp and the
    out-projection's input.

    What eager torch saves beyond Korthikanti's count (each measured by workers/memory_probe.py's
    saved-tensor hooks, tests/workers/test_memory_harness.py): ``eager_norms``: torch's composite RMSNorm
    keeps the normalised input before the weight (elt·h) and the fp32 reciprocal RMS (4 B) per token
    and norm; ``kv_repeated``: the attention saves K and V repeated to the query heads;
    ``gathered_inputs``: under sequence parallelism DTensor's all-gather hands the attention and the
    MLP the whole sequence and their matmuls save it (Megatron re-gathers it in the backward instead);
    ``head_dim``: the kv heads one rank keeps when t > kv_heads (one per rank, ReplicatedKV).

    Shapes of published models (tuner/_hf.py): ``q_dim`` the query and attention-output width
    heads x head_dim (0: h); ``norms`` RMSNorms per layer (Gemma's sandwich norms: 4, each keeping its
    input); ``qk_norm_head_dim`` (0: none) the per-head query/key RMSNorms (their inputs, and eagerly
    the normalised input and the fp32 rstd per head row); ``shared_ffn`` a shared expert beside the routed ones (a dense MLP of that width on
    every token, plus its gate's output).
    """
    q_dim = q_dim or h
    sbh, sb = s * b * h, s * b
    if ac == "full":  # only the layer input is kept (Korthikanti Table 2, "full recompute")
        return elt * sbh / (t if sp else 1)
    # Outside the TP region: two norm inputs, attention input, MLP input (+ 1-byte dropout masks).
    norm_inputs = elt * norms * sbh + (2 * sbh if dropout else 0)
    norm_saved = norms * (elt * sbh + 4 * sb) if eager_norms else 0.0
    attn_in = mlp_in = elt * sbh
    # Inside the TP region (sharded by t): Q, K, V, the attention output fed to the out projection.
    # Under CP the attention keeps the all-gathered K and V of the whole sequence (cp·s tokens).
    kv = h if kv_repeated else max(kv_dim, t * head_dim)
    # Under CP (workers/_cp.py) the two chunks' outputs are concatenated head-major, so the out
    # projection's input is a copy of them: one more sbh.
    sbq = s * b * q_dim
    attn = elt * ((2 if cp == 1 else 3) * sbq + 2 * cp * s * b * kv)
    if qk_norm_head_dim:  # q/k RMSNorms: their inputs; eagerly also the normalised input and the rstd
        qk = sbq + s * b * kv
        attn += elt * qk * (2 if eager_norms else 1) + (4 * qk / qk_norm_head_dim if eager_norms else 0)
    if flash:  # flash attention keeps the fp32 log-sum-exp per query instead of the scores (Dao 2022)
        attn += 4 * a * s * b
    else:  # softmax output (+ dropout mask and output): Korthikanti's 5as²b
        attn += (elt + (3 if dropout else 0)) * a * s * s * b
    if ac == "selective":  # attention-block recompute: all of it is recomputed in the backward
        attn = 0.0
    # MLP: GeLU keeps the up-projection and GeLU outputs (Korthikanti); eager SwiGLU (workers/model.py)
    # keeps four ffn-wide tensors: the gate (silu's input), silu(gate) and the up projection (the
    # product's inputs) and the product (w2's input); a fused one (Megatron's bias_swiglu) three.
    per_token = (swiglu_saved if mlp == "swiglu" else 2) * ffn
    routed = 0.0  # MoE tensors every tp rank holds whole (the experts see the whole sequence)
    if moe_top_k:
        # workers/model.py MoE, per routed copy (top_k per token): the expert's ffn-wide tensors (split
        # over tp with the experts' ffn dim), and, whole on every tp rank, the gathered input row, the
        # expert's output and the weighted output (h each), the routing weight (elt), its fp32 softmax
        # and three int64 index vectors (top-k choice, token of each row, sort order); under EP two
        # more (workers/_ep.py's permutation of the received rows and its inverse).
        rows = moe_top_k * sb
        mlp_bytes = elt * rows * per_token
        routed = elt * rows * 3 * h + rows * (elt + 4 + 8 * (3 + (2 if ep > 1 else 0)))
    else:
        mlp_bytes = elt * sb * per_token
    if shared_ffn:  # the shared expert: a dense MLP of every token, and its sigmoid gate's output
        mlp_bytes += elt * sb * (swiglu_saved if mlp == "swiglu" else 2) * shared_ffn
        routed += elt * sb * 2
    inside = attn + mlp_bytes
    if not sp:
        return norm_inputs + norm_saved + attn_in + mlp_in + routed + inside / t
    seq = (norm_inputs + norm_saved) / t
    if gathered_inputs:  # the checkpointed attention (selective) keeps its sharded argument instead
        seq += (attn_in / t if ac == "selective" else attn_in) + mlp_in
    else:
        seq += (attn_in + mlp_in) / t
    return seq + routed + inside / t


def microbatches_in_flight(schedule: str, pp: int, vpp: int, m: int, rank: int) -> float:
    """Micro-batches whose activations pp ``rank`` holds at its peak, in units of its whole layer set.

    gpipe: all m; 1F1B: min(p - rank, m) (Narayanan et al. 2021 Sec. 2.2.1); interleaved: Megatron's
    2(p-rank-1) + (v-1)p + 1 warm-up chunks of 1/v of the layers, p + (p-1)/v on rank 0 (Korthikanti
    et al. 2022 Sec. 4.2.3).
    """
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved":
        return min(2 * (pp - rank - 1) + (vpp - 1) * pp + 1, m * vpp) / vpp
    return float(min(pp - rank, m))


def cross_entropy_logits_bytes(tokens: float, vocab_local: int, elt: int) -> float:
    """Logits a cross-entropy backward keeps per micro-batch: the fp32 copy 4·s·b·v (Korthikanti et
    al. 2022 Sec. 4.3) plus, when training in 16 bits, the low-precision logits themselves."""
    return tokens * vocab_local * (4 + (elt if elt < 4 else 0))


# --- FLOPs ----------------------------------------------------------------------------------------


def matmul_flops_per_token(weights: float) -> float:
    """Training FLOPs of the matmuls of ``weights`` parameters per token: 2 forward + 4 backward
    (Kaplan et al. 2020 Sec. 2.1; PaLM, Chowdhery et al. 2022, App. B's 6N)."""
    return 6.0 * weights


def backward_gemm_flops_per_token(weights: float) -> float:
    """FLOPs per token of one of the two backward GEMMs of a linear of ``weights`` parameters, its
    input gradient's or its weight gradient's: 2 per weight each (Narayanan et al. 2021, appendix
    "Floating-point operations": the backward needs twice the forward's FLOPs, one GEMM for the
    gradient of the input and one for that of the weight)."""
    return 2.0 * weights


def attention_core_flops_per_token(h: int, s: int, *, causal: bool) -> float:
    """Training FLOPs per token of one layer's scores and softmax·V, 12·h·s (PaLM App. B), h the
    query width heads x head_dim (``ModelSpec.q_dim``; = hidden unless head_dim is explicit). A causal
    kernel that skips the masked half (flash attention, Dao et al. 2022 Sec. 3.1 block-sparse case;
    its benchmarks count causal as half) does half of it: that is the step time's count, the full
    one is PaLM's MFU convention."""
    return 12.0 * h * s * (0.5 if causal else 1.0)


def head_flops_per_token(model: ModelSpec) -> float:
    """Output projection fwd+bwd, 6·h·V per token (2hV forward, 4hV backward); the loss is O(V)."""
    return matmul_flops_per_token(model.hidden * model.vocab)


def layer_flops_per_token(model: ModelSpec, *, causal: bool = False) -> float:
    """Training FLOPs of one layer per token: 6 x active weights + 12·h·s attention (PaLM App. B),
    the attention core halved when ``causal`` (see ``attention_core_flops_per_token``)."""
    active = model.attention_params_per_layer + model.active_mlp_params_per_layer
    return matmul_flops_per_token(active) + attention_core_flops_per_token(model.q_dim, model.seq_len, causal=causal)


def model_flops_per_token(model: ModelSpec) -> float:
    """MFU's numerator per token, PaLM's convention (Chowdhery et al. 2022, App. B): 6N + 12·L·h·s,
    N the weights a token multiplies (active experts, norms, head; not the embedding lookup), no
    recompute, the attention counted in full even though it is causal. Predicted and measured MFU
    (tuner/_timing.py, workers/aggregate.py) both use this one."""
    n = model.active_params - model.embedding_params + (model.embedding_params if model.tied_embeddings else 0)
    return matmul_flops_per_token(n) + model.layers * attention_core_flops_per_token(
        model.q_dim, model.seq_len, causal=False)


def recompute_flops_split(model: ModelSpec, ac: str, *, causal: bool = False) -> tuple[float, float]:
    """(matmul, attention core) FLOPs per token per layer that activation checkpointing re-runs in
    the backward: the forward, a third of each part's training FLOPs (matmul 2 of 6, core 4 of 12).

    full: the whole layer's forward again, 2·(P_attn + P_mlp) + 4·h·s (Korthikanti et al. 2022 Sec. 5).
    selective: meshtune's "selective" is attention-block recompute, not Korthikanti's: the workers
    (workers/parallelize.py ``apply_ac``) checkpoint the whole attention sub-layer (Q, K, V, RoPE,
    SDPA, out-projection), so its forward, 2·P_attn + 4·h·s, runs again.
    """
    if ac == "none":
        return 0.0, 0.0
    core = attention_core_flops_per_token(model.q_dim, model.seq_len, causal=causal) / 3
    weights = model.attention_params_per_layer + (model.active_mlp_params_per_layer if ac == "full" else 0)
    return matmul_flops_per_token(weights) / 3, core


def recompute_flops_per_token_per_layer(model: ModelSpec, ac: str, *, causal: bool = False) -> float:
    """Extra forward FLOPs per token per layer of activation checkpointing (``recompute_flops_split``)."""
    return sum(recompute_flops_split(model, ac, causal=causal))


# --- collectives, pipeline, batch -----------------------------------------------------------------


def allreduce_time(nbytes: float, n: int, bw: float, lat: float) -> float:
    """Ring all-reduce: 2(n-1)/n · bytes / bw + 2(n-1) · latency (Thakur et al. 2005)."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat


def allgather_time(nbytes: float, n: int, bw: float, lat: float) -> float:
    """Ring all-gather or reduce-scatter of a ``nbytes`` whole: (n-1)/n · bytes / bw + (n-1)·latency
    (Thakur et al. 2005)."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / bw + (n - 1) * lat


def alltoall_time(nbytes: float, n: int, bw: float, lat: float) -> float:
    """All-to-all where each rank holds ``nbytes``: (n-1)/n of it leaves the rank, (n-1) messages
    (pairwise exchange, Thakur et al. 2005)."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / bw + (n - 1) * lat


def pipeline_bubble_fraction(pp: int, vpp: int, m: int) -> float:
    """Idle fraction of the ideal time, (p-1)/(v·m) (Narayanan et al. 2021, Sec. 2.2)."""
    return (pp - 1) / (vpp * m)


def useful_fraction(global_batch: int, critical_batch: int | None) -> float:
    """Share of the tokens that buy progress: E_min/E = 1/(1 + B/B_crit) (McCandlish et al. 2018,
    Eq. 2.11: E = E_min(1 + B/B_crit)); ~1 well below B_crit, ~B_crit/B far above it."""
    if critical_batch is None:
        return 1.0
    return 1.0 / (1.0 + global_batch / critical_batch)


def useful_tokens_per_s(tokens_per_s: float, global_batch: int, critical_batch: int | None) -> float:
    """Tokens/s of progress: tokens/s x E_min/E (McCandlish et al. 2018, Sec. 2.2, Eq. 2.11). Far above
    the critical batch it tends to B_crit tokens per step: a bigger batch, or more devices running
    it, buys no more progress."""
    return tokens_per_s * useful_fraction(global_batch, critical_batch)


# --- budget: time and money of a training run (definitions, no model) ------------------------------


def time_to_train_s(train_tokens: float, tokens_per_s: float) -> float:
    """Seconds to train on ``train_tokens`` at a sustained ``tokens_per_s`` (whole job)."""
    return train_tokens / tokens_per_s


def device_hours(devices: int, seconds: float) -> float:
    """Device-hours of ``devices`` held for ``seconds`` (what clouds bill)."""
    return devices * seconds / 3600.0


def cost_per_token(price_per_device_hour: float, devices: int, tokens_per_s: float) -> float:
    """Price of one trained token: the job's price per second over its tokens per second."""
    return price_per_device_hour * devices / 3600.0 / tokens_per_s
