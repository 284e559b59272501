"""Context and expert parallelism on CPU gloo ranks equal the single-process computation.

Every rank also computes the single-process reference itself (same seed), so the comparison needs no
result shipping (the train-loop test at the end compares with workers.train.reference_losses). Tolerances are fp32 ones: the parallel runs compute the same sums in another order
(attention split into two masked chunk calls instead of one causal call, gradients summed over ranks
by a reduce-scatter/all-reduce, expert matmuls over other row groupings), so results differ by a few
ulps per accumulation; over <= a few hundred terms that stays below rtol=1e-5 / atol=1e-6 (about 100
fp32 epsilons), while any mistake in masks, chunk order or routing moves values by >= 1e-3.
"""

from __future__ import annotations

import copy
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from tests.helpers.dist import run_ranks
from tuner import MODEL_PRESETS, Layout, cluster_spec, model_spec, training_spec
from workers import TrialRequest
from workers._cp import (
    apply_context_parallel,
    attend_local_chunks,
    chunk_ids,
    chunk_positions,
    group_of,
    shard_sequence,
)
from workers._ep import apply_expert_parallel, expert_parameters
from workers.model import MoE, Transformer, causal_sdpa, synthetic_batch

RTOL, ATOL = 1e-5, 1e-6  # fp32, see the module docstring
# After AdamW steps parameters are not compared element by element, for a measured reason: Adam's
# first update of a gradient element g is lr*g/(|g|+eps) with eps=1e-8, whose slope near g=0 is
# lr/eps, so an element with |g| ~ eps turns a 4e-10 reduction-order difference of its gradient into
# a 1.8e-6 parameter difference (seen on tiny-moe, w2 of layer 0; at worst lr*dg/(4*eps), 2.5e-5 for
# dg=1e-9).
# Instead every step's loss and every reduced gradient (at the updated parameters) are checked at
# RTOL/ATOL, and so is the loss of the trained parameters on a fresh batch.
LR = 1e-3


def _spawn(fn, world: int, *args) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` fresh gloo ranks; a rank's exception fails the test."""
    run_ranks(world, fn, *args, timeout_s=180)


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, atol: float = ATOL) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=atol, msg=lambda m: f"{what}: {m}")


# --- context parallel ----------------------------------------------------------------------------


_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_chunk_attention_of_every_rank_equals_full_causal_attention(cp, device):
    """Single process, no collectives: every rank's local chunk attention against the full K/V, the
    sum of their losses backpropagated, equals one causal SDPA (the CUDA path uses a lower-right bias)."""
    b, h, s, d = 2, 3, 48, 8
    gen = torch.Generator().manual_seed(cp)
    q, k, v, gout = (torch.randn(b, h, s, d, generator=gen).to(device) for _ in range(4))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = causal_sdpa(*ref)
    (out_ref * gout).sum().backward()
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    total = 0.0
    for rank in range(cp):
        pos = chunk_positions(s, cp, rank, torch.device(device))
        out = attend_local_chunks(full[0][:, :, pos], full[1], full[2], chunk_ids(cp, rank))
        _close(out, out_ref[:, :, pos], f"rank {rank} output")
        total = total + (out * gout[:, :, pos]).sum()
    total.backward()
    for name, t, r in zip("qkv", full, ref, strict=True):
        _close(t.grad, r.grad, f"d{name}")
    with pytest.raises(ValueError, match=r"seq_len=50 is not divisible by 2\*cp=4"):
        chunk_positions(50, 2, 0)


def _check_cp_attention(group, kv_heads: int = 6) -> None:
    """attn_fn over the cp ``group`` (a 1-D mesh or a ProcessGroup) vs one causal SDPA call; with
    kv_heads < 6 query heads, k/v are passed un-repeated (grouped-query attention)."""
    _, cp, rank = group_of(group)
    b, h, s, d = 2, 6, 48, 8
    gen = torch.Generator().manual_seed(cp)
    q, gout = (torch.randn(b, h, s, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, kv_heads, s, d, generator=gen) for _ in range(2))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = causal_sdpa(*ref)
    (out_ref * gout).sum().backward()

    tokens = torch.arange(s).expand(b, s)
    _, _, pos = shard_sequence(tokens, tokens, group)
    c = s // (2 * cp)
    g0, g1 = chunk_ids(cp, rank)
    assert pos.tolist() == list(range(g0 * c, (g0 + 1) * c)) + list(range(g1 * c, (g1 + 1) * c))
    every = [torch.empty_like(pos) for _ in range(cp)]
    dist.all_gather(every, pos, group=group_of(group)[0])
    assert sorted(torch.cat(every).tolist()) == list(range(s)), "cp shards must cover the sequence once"

    holder = torch.nn.Module()
    holder.attention = Transformer(MODEL_PRESETS["tiny"]).layers["0"].attention
    apply_context_parallel(holder, group)
    loc = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
    k_all, v_all = holder.attention.attn_fn.gather_kv(loc[1].detach(), loc[2].detach())
    assert k_all.shape == v_all.shape == (b, kv_heads, s, d), "the cp gather must move only the kv heads"
    torch.testing.assert_close(k_all, k, rtol=0, atol=0)  # global order restored exactly
    saved: list[tuple[int, ...]] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        out = holder.attention.attn_fn(*loc)
    # GQA-aware: what the backward keeps of the whole sequence is kv_heads-sized; no
    # K/V repeated to the query heads over more than the local queries' own positions.
    assert (b, kv_heads, (2 * cp - rank) * c, d) in saved  # the later chunk sees keys up to its end
    if kv_heads < h:
        assert not [x for x in saved if len(x) == 4 and x[1] == h and x[2] > s // cp], saved
    (out * gout[:, :, pos]).sum().backward()
    _close(out, out_ref[:, :, pos], f"cp{cp} attention output")
    for name, lt, rt in zip("qkv", loc, ref, strict=True):
        _close(lt.grad, rt.grad[:, :, pos], f"cp{cp} attention d{name}")


def _check_cp_model(cp_mesh) -> None:
    """A tiny model's loss and gradients under context parallel vs the single process."""
    _, cp, _ = group_of(cp_mesh)
    spec = MODEL_PRESETS["tiny"]
    ref = Transformer(spec)
    ref.init_weights(0)
    model = copy.deepcopy(ref)
    tokens, targets = synthetic_batch(spec, batch=2, step=0, seed=0)

    loss_ref = F.cross_entropy(ref(tokens).flatten(0, 1), targets.flatten())
    loss_ref.backward()

    apply_context_parallel(model, cp_mesh)
    tl, gl, pos = shard_sequence(tokens, targets, cp_mesh)
    loss = F.cross_entropy(model(tl, pos).flatten(0, 1), gl.flatten())
    loss.backward()
    # Equal token counts per cp rank: the global mean loss/gradient is the mean over the cp ranks.
    loss = loss.detach()
    dist.all_reduce(loss, group=cp_mesh.get_group())
    _close(loss / cp, loss_ref.detach(), f"cp{cp} model loss")
    for (name, p), (_, pr) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        dist.all_reduce(p.grad, group=cp_mesh.get_group())
        _close(p.grad / cp, pr.grad, f"cp{cp} model grad {name}")


def _cp_checks(rank: int, world: int) -> None:
    _check_cp_attention(dist.group.WORLD)  # cp=4 over every rank, given as a plain ProcessGroup
    _check_cp_attention(dist.group.WORLD, kv_heads=1)  # GQA 6:1, un-repeated k/v through the gather
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    _check_cp_attention(mesh["cp"], kv_heads=2)  # cp=2 with GQA 6:2, both dp replicas at once
    _check_cp_model(mesh["cp"])


@pytest.mark.slow
def test_context_parallel_cp4_cp2_attention_and_cp2_model_match_single_process():
    """cp4 attention fwd/bwd; cp2 attention fwd/bwd; cp2 tiny-model loss and all gradients."""
    _spawn(_cp_checks, 4)


# --- expert parallel -----------------------------------------------------------------------------


def _moe_case(ref: MoE, ep_moe: MoE, x_all: torch.Tensor, gout_all: torch.Tensor, ep_mesh, what: str) -> None:
    """Forward/backward of rank ``rank``'s slice x_all[rank] through ep_moe vs ref over all of x_all."""
    ref.zero_grad()
    ep_moe.zero_grad()
    x_ref = x_all.clone().requires_grad_()
    out_ref = ref(x_ref)
    (out_ref * gout_all).sum().backward()

    rank, group = ep_mesh.get_local_rank(), ep_mesh.get_group()
    x = x_all[rank].clone().requires_grad_()
    out = ep_moe(x)
    (out * gout_all[rank]).sum().backward()
    _close(out, out_ref[rank], f"{what}: output")
    _close(x.grad, x_ref.grad[rank], f"{what}: dx")
    # The router is replicated and its tokens are split over the ranks: sum its gradient.
    dist.all_reduce(ep_moe.router.weight.grad, group=group)
    _close(ep_moe.router.weight.grad, ref.router.weight.grad, f"{what}: d router")
    n_local = ref.experts // ep_mesh.size()
    for name in ("w1", "w2", "w3"):
        full = getattr(ref, name).grad[rank * n_local : (rank + 1) * n_local]
        _close(getattr(ep_moe, name).grad, full, f"{what}: d {name}")


def _check_ep_layer(ep_mesh) -> None:
    """One MoE layer's forward/backward under expert parallel vs the single process."""
    spec, world = MODEL_PRESETS["tiny-moe"], ep_mesh.size()
    gen = torch.Generator().manual_seed(0)
    ref = MoE(spec)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    ep_moe = copy.deepcopy(ref)
    apply_expert_parallel(ep_moe, ep_mesh)
    assert ep_moe.w1.shape[0] == spec.experts // world
    assert {id(p) for p in expert_parameters(ep_moe)} == {id(ep_moe.w1), id(ep_moe.w2), id(ep_moe.w3)}

    x_all = torch.randn(world, 2, 8, spec.hidden, generator=gen)
    gout = torch.randn(world, 2, 8, spec.hidden, generator=gen)
    # The case must send tokens across ranks both ways, or it would not test the all-to-all.
    chosen = ref.router(x_all).topk(spec.top_k, dim=-1).indices // (spec.experts // world)
    for r in range(world):
        assert set(chosen[r].unique().tolist()) == set(range(world)), "routing does not cross ranks"
    _moe_case(ref, ep_moe, x_all, gout, ep_mesh, "random routing")

    # Skewed: every token of every rank picks experts 0 and 1 (rank 0's): rank 1's experts get no
    # tokens at all and rank 0 sends nothing away (zero-sized splits).
    with torch.no_grad():
        for m in (ref, ep_moe):
            m.router.weight.zero_()
            m.router.weight[0, 0] = m.router.weight[1, 0] = 1.0
            m.router.weight[0, 1] = 0.5
    x_skew = torch.randn(world, 1, 3, spec.hidden, generator=gen)
    x_skew[..., 0] = x_skew[..., 0].abs() + 1.0
    _moe_case(ref, ep_moe, x_skew, gout[:, :1, :3], ep_mesh, "skewed routing")


def _check_ep_dp_train(mesh, steps: int) -> None:
    """tiny-moe under ep2 x dp2, AdamW steps, vs the single process: losses, gradients, parameters."""
    spec, world = MODEL_PRESETS["tiny-moe"], mesh.size()
    ep_rank, n_local = mesh["ep"].get_local_rank(), spec.experts // 2
    data_rank = mesh["dp"].get_local_rank() * 2 + ep_rank
    ref = Transformer(spec)
    ref.init_weights(0)
    model = copy.deepcopy(ref)
    apply_expert_parallel(model, mesh["ep"])
    experts = {id(p) for p in expert_parameters(model)}
    initial = [p.detach().clone() for p in model.parameters()]
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)

    def mine(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:  # this rank's part of a reference tensor
        return full[ep_rank * n_local : (ep_rank + 1) * n_local] if id(p) in experts else full

    per_rank = 2
    for step in range(steps):
        tokens, targets = synthetic_batch(spec, batch=per_rank * world, step=step, seed=0)
        loss_ref = F.cross_entropy(ref(tokens).flatten(0, 1), targets.flatten())
        loss_ref.backward()

        sl = slice(data_rank * per_rank, (data_rank + 1) * per_rank)
        loss = F.cross_entropy(model(tokens[sl]).flatten(0, 1), targets[sl].flatten())
        loss.backward()
        loss = loss.detach()
        dist.all_reduce(loss)
        _close(loss / world, loss_ref.detach(), f"loss at step {step}")
        for (name, p), pr in zip(model.named_parameters(), ref.parameters(), strict=True):
            # Same divisor (data ranks); experts sum over dp only: the all-to-all already summed over ep.
            dist.all_reduce(p.grad, group=mesh["dp"].get_group() if id(p) in experts else None)
            p.grad /= world
            _close(p.grad, mine(p, pr.grad), f"grad {name} at step {step}")
        opt_ref.step()
        opt_ref.zero_grad()
        opt.step()
        opt.zero_grad()
    for (name, p), p0 in zip(model.named_parameters(), initial, strict=True):
        assert (p.detach() - p0).abs().max() > LR / 2, f"{name} was not trained"  # Adam moves each by ~lr
    tokens, targets = synthetic_batch(spec, batch=per_rank * world, step=steps, seed=0)
    with torch.no_grad():
        loss_ref = F.cross_entropy(ref(tokens).flatten(0, 1), targets.flatten())
        sl = slice(data_rank * per_rank, (data_rank + 1) * per_rank)
        loss = F.cross_entropy(model(tokens[sl]).flatten(0, 1), targets[sl].flatten())
    dist.all_reduce(loss)
    _close(loss / world, loss_ref, f"loss after {steps} AdamW steps")


def _ep_checks(rank: int, world: int, steps: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    _check_ep_layer(mesh["ep"])  # ep=2, both dp replicas at once
    _check_ep_dp_train(mesh, steps)


@pytest.mark.slow
def test_expert_parallel_ep2_layer_and_ep2_dp2_training_match_single_process():
    """ep2 MoE layer fwd/bwd (random and skewed routing); tiny-moe ep2 x dp2, 3 AdamW steps."""
    _spawn(_ep_checks, 4, 3)


# --- end to end through the train loop (workers.train.train_trial) --------------------------------

# The numerics suite's rule (tests/workers/test_workers_numerics.py): fp32 layouts differ from the reference
# only in reduction order; loss and global gradient norm (Adam hides gradient-scale bugs from losses)
# within rtol 1e-5 over 4 steps. Measured here: <= 1.7e-7 (loss), <= 5e-8 (gradient norm).
E2E_RTOL = 1e-5
E2E_STEPS = 4
E2E_LAYOUTS = {
    "cp2-dp2": ("tiny", Layout(cp=2, dp=2)),
    "ep2-dp2": ("tiny-moe", Layout(ep=2, dp=2)),
    "ep2-dp2-zero3": ("tiny-moe", Layout(ep=2, dp=2, zero=3)),  # FSDP2 of experts over dp only
    "cp2-ep2": ("tiny-moe", Layout(cp=2, ep=2)),  # experts reduce over cp, dense over cp*ep
    # TP inside the experts (w1/w3 columns, w2 rows over tp) together with EP; ZeRO with
    # EP and no expert replicas (dp*cp = 1: dense sharded over ep, experts unsharded).
    "tp2-ep2": ("tiny-moe", Layout(tp=2, ep=2)),
    "ep4-zero3": ("tiny-moe", Layout(ep=4, zero=3)),
    "tp2-ep2-sp-zero1": ("tiny-moe", Layout(tp=2, ep=2, sp=True, zero=1)),
}


def _e2e_request(model: str, layout: Layout) -> TrialRequest:
    return TrialRequest(
        model=model_spec(model),
        cluster=cluster_spec({"preset": "cpu-local", "devices_per_node": layout.world_size}),
        training=training_spec({"global_batch": 8, "precision": "fp32", "lr": 1e-3, "seed": 7}),
        layout=layout,
        warmup_steps=1,
        measure_steps=E2E_STEPS - 1,
        options={"grad_norm": True},
    )


def _e2e_trials(rank: int, world: int, requests: dict[str, TrialRequest]) -> dict[str, object]:
    from workers.train import train_trial

    out: dict[str, object] = {}
    for name, request in requests.items():
        try:
            report = train_trial(request, device=torch.device("cpu"))
            out[name] = (report.losses, report.grad_norms)
        except Exception:  # one broken layout must not hide the others' results
            out[name] = traceback.format_exc()[-3000:]
    return out


@pytest.mark.slow
def test_cp_and_ep_layouts_train_like_the_single_process_reference():
    from workers.train import reference_losses

    refs = {m: reference_losses(_e2e_request(m, Layout()), steps=E2E_STEPS) for m in ("tiny", "tiny-moe")}
    for losses, _ in refs.values():  # steps must differ far more than the tolerance
        assert max(losses) - min(losses) > 1000 * E2E_RTOL * max(losses)
    requests = {name: _e2e_request(m, layout) for name, (m, layout) in E2E_LAYOUTS.items()}
    results = run_ranks(4, _e2e_trials, requests, timeout_s=400)
    for name, (m, _) in E2E_LAYOUTS.items():
        ref_losses, ref_norms = refs[m]
        for rank, per_rank in enumerate(results):
            got = per_rank[name]
            assert not isinstance(got, str), f"{name} failed on rank {rank}:\n{got}"
            assert got[0] == pytest.approx(ref_losses, rel=E2E_RTOL), f"{name} losses, rank {rank}"
            assert got[1] == pytest.approx(ref_norms, rel=E2E_RTOL), f"{name} gradient norms, rank {rank}"
