"""A Llama-style decoder (RMSNorm, RoPE, GQA through SDPA, SwiGLU, optional top-k MoE) from a ModelSpec.

It also builds the published shapes a ModelSpec describes (tuner/_hf.py): explicit head_dim, q/k/v
biases, per-head q/k norms, GeGLU and sandwich norms, a gated shared expert. It is a look-alike, not
those models' code: the transformers workload (workers/workload_hf.py) trains the real one. Written
so the parallelisms apply from outside, torchtitan-style: ``layers`` keyed by global index,
attention reshaping with -1 heads, swappable ``Attention.attn_fn`` (given un-repeated K/V) and
``MoE.experts_fn``, explicit ``positions``. Details: docs/workers.md, "The built-in model".
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tuner import BUILTIN_INIT_STD, BUILTIN_NORM_EPS, BUILTIN_QK_NORM_EPS, ModelSpec
from tuner import BUILTIN_ROPE_THETA as ROPE_THETA


def repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [batch, kv_heads, seq, head_dim] repeated to q's heads (grouped-query attention, Ainslie
    et al. 2023, Sec. 2.2): kv head j serves query heads [j*rep, (j+1)*rep). The ratio comes from the
    local shapes, so it holds under tensor parallelism (heads/tp vs kv_heads/tp, or 1 kv head per rank
    when tp > kv_heads)."""
    rep, rem = divmod(q.shape[1], k.shape[1])
    assert rem == 0 and k.shape[1] == v.shape[1], (q.shape, k.shape, v.shape)
    if rep == 1:
        return k, v
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention of q [batch, heads, seq, head_dim] over un-repeated k, v
    [batch, kv_heads, seq, head_dim]. The repeat is explicit rather than SDPA's ``enable_gqa``: on CPU
    (torch 2.13) that gives the same output but sums dk/dv in another order (a few ulps apart)."""
    return F.scaled_dot_product_attention(q, *repeat_kv(q, k, v), is_causal=True)


def rope_angles(head_dim: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [seq, head_dim/2] for rotary embeddings (Su et al. 2021, Eq. 34)."""
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x: [batch, seq, heads, head_dim]."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.head_dim = spec.head_dim
        self.wq = nn.Linear(spec.hidden, spec.heads * spec.head_dim, bias=spec.qkv_bias)
        self.wk = nn.Linear(spec.hidden, spec.kv_heads * spec.head_dim, bias=spec.qkv_bias)
        self.wv = nn.Linear(spec.hidden, spec.kv_heads * spec.head_dim, bias=spec.qkv_bias)
        self.wo = nn.Linear(spec.heads * spec.head_dim, spec.hidden, bias=False)
        # Qwen3's RMSNorm of each query and key head (one head_dim weight shared by the heads).
        self.q_norm = nn.RMSNorm(spec.head_dim, eps=BUILTIN_QK_NORM_EPS) if spec.qk_norm else None
        self.k_norm = nn.RMSNorm(spec.head_dim, eps=BUILTIN_QK_NORM_EPS) if spec.qk_norm else None
        self.attn_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = causal_sdpa

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds heads/tp query and kv heads.
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # k, v stay un-repeated (kv heads only): attn_fn does grouped-query attention itself.
        out = self.attn_fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU or GeGLU with tanh GELU (Shazeer 2020), or the GPT-style GELU MLP."""

    def __init__(self, hidden: int, ffn: int, kind: str = "swiglu") -> None:
        super().__init__()
        self.kind = kind
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False) if kind != "gelu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is None:
            return self.w2(F.gelu(self.w1(x)))
        if self.kind == "geglu":
            return self.w2(F.gelu(self.w1(x), approximate="tanh") * self.w3(x))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def local_experts(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, counts: list[int]
) -> torch.Tensor:
    """SwiGLU of tokens grouped by expert: rows [sum(counts[:e]), +counts[e]) go through expert e."""
    outs, start = [], 0
    for e, n in enumerate(counts):
        xe = x[start : start + n]
        outs.append((F.silu(xe @ w1[e]) * (xe @ w3[e])) @ w2[e])
        start += n
    return torch.cat(outs) if outs else x[:0]


class MoE(nn.Module):
    """Top-k routed experts (softmax over the k chosen logits, as Mixtral). No auxiliary loss: runs are
    a few steps long and routing balance is not what a layout measurement is about."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.experts = spec.experts
        self.top_k = spec.top_k
        self.router = nn.Linear(spec.hidden, spec.experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(spec.experts, spec.hidden, spec.expert_ffn))
        self.w3 = nn.Parameter(torch.empty(spec.experts, spec.hidden, spec.expert_ffn))
        self.w2 = nn.Parameter(torch.empty(spec.experts, spec.expert_ffn, spec.hidden))
        # experts_fn(tokens_sorted_by_expert, counts_per_expert) -> outputs in the same order.
        self.experts_fn: Callable[[torch.Tensor, list[int]], torch.Tensor] = (
            lambda xs, counts: local_experts(xs, self.w1, self.w2, self.w3, counts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router(x)
        weights, chosen = logits.topk(self.top_k, dim=-1)
        weights = weights.softmax(dim=-1, dtype=torch.float32).type_as(x)
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.experts).tolist()
        token_of = order // self.top_k
        out_sorted = self.experts_fn(x[token_of], counts)
        out = torch.zeros_like(x).index_add_(0, token_of, out_sorted * weights.reshape(-1)[order, None])
        return out.reshape(shape)


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, index: int = 0) -> None:
        super().__init__()
        # A MoE model's ``dense_layers`` (Qwen-MoE's mlp_only_layers) get a dense MLP of ``ffn``.
        moe = spec.is_moe and index not in spec.dense_layers
        self.attention_norm = nn.RMSNorm(spec.hidden, eps=BUILTIN_NORM_EPS)
        self.attention = Attention(spec)
        self.ffn_norm = nn.RMSNorm(spec.hidden, eps=BUILTIN_NORM_EPS)
        self.feed_forward: nn.Module = MoE(spec) if moe else FeedForward(spec.hidden, spec.ffn, spec.mlp)
        # Gemma 2/3's sandwich norms: each sub-layer's output is normalised before the residual add.
        sandwich = spec.norms_per_layer == 4
        self.post_attention_norm = nn.RMSNorm(spec.hidden, eps=BUILTIN_NORM_EPS) if sandwich else None
        self.post_ffn_norm = nn.RMSNorm(spec.hidden, eps=BUILTIN_NORM_EPS) if sandwich else None
        # Qwen2-MoE's shared expert: a dense MLP of every token beside the routed experts, outside
        # the MoE module so that data parallelism treats it as dense (workers/_data_parallel.py).
        shared = moe and spec.shared_expert_ffn > 0
        self.shared_expert = FeedForward(spec.hidden, spec.shared_expert_ffn, spec.mlp) if shared else None
        self.shared_expert_gate = nn.Linear(spec.hidden, 1, bias=False) if shared and spec.shared_expert_gate else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = self.attention(self.attention_norm(x), cos, sin)
        x = x + (self.post_attention_norm(h) if self.post_attention_norm is not None else h)
        h = self.ffn_norm(x)
        out = self.feed_forward(h)
        if self.shared_expert is not None:
            shared = self.shared_expert(h)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(h)) * shared
            out = out + shared
        return x + (self.post_ffn_norm(out) if self.post_ffn_norm is not None else out)


class Transformer(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(spec.vocab, spec.hidden)
        self.layers = nn.ModuleDict({str(i): Block(spec, i) for i in range(spec.layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(spec.hidden, eps=BUILTIN_NORM_EPS)
        self.output: nn.Linear | None = nn.Linear(spec.hidden, spec.vocab, bias=False)
        if spec.tied_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def init_weights(self, seed: int) -> None:
        """Deterministic init from ``seed`` (identical on every rank before any sharding)."""
        # The generator lives where the weights do (a 1B model drawn on the host would take seconds);
        # CPU and CUDA draw different numbers, identical on every rank of one device type.
        device = next(self.parameters()).device
        gen = torch.Generator(device=device).manual_seed(seed)
        std = BUILTIN_INIT_STD
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith(".bias"):  # q/k/v biases
                    p.zero_()
                elif p.dim() == 1:  # norm weights
                    p.fill_(1.0)
                else:
                    # Residual-out projections scaled by depth (GPT-2, Radford et al. 2019, Sec. 2.3).
                    scale = (2 * self.spec.layers) ** -0.5 if name.endswith(("wo.weight", "w2.weight", ".w2")) else 1.0
                    p.copy_(torch.randn(p.shape, generator=gen, device=device) * std * scale)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``tokens``: int ids [b, s] on the first stage, hidden states [b, s, h] on later stages."""
        if positions is None:  # the full sequence (under sequence parallelism h is a shard of it)
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        cos, sin = rope_angles(self.spec.head_dim, positions)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def synthetic_batch(spec: ModelSpec, *, batch: int, step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of shape [batch, seq_len] for ``step``, identical for every layout.

    Each sequence follows x[t+1] = (a*x[t] + c) mod vocab with its own (a, c): learnable, so losses fall
    and layouts that train differently show it. Ranks slice their part of the global batch.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    a = torch.randint(1, spec.vocab, (batch, 1), generator=gen)
    c = torch.randint(0, spec.vocab, (batch, 1), generator=gen)
    x0 = torch.randint(0, spec.vocab, (batch, 1), generator=gen)
    seq = [x0]
    for _ in range(spec.seq_len):
        seq.append((a * seq[-1] + c) % spec.vocab)
    full = torch.cat(seq, dim=1)
    return full[:, :-1].contiguous(), full[:, 1:].contiguous()
