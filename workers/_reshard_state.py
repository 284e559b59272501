"""The torch side of reshard-check: a layout's model + optimizer that can step, DCP state dicts keyed
by single-model FQNs, the deliberate corruption, and the full-state snapshot and comparison.

``Trainer`` builds and steps a layout with the trial's own functions (``workers.rank_model``:
``build_rank_model``, ``rank_batch``, ``train_step``, ``global_loss``) one step at a time without
the trial's measurements, so the losses it reports are the trial's losses for the same steps.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from workers._contract import TrialRequest
from workers.rank_model import build_rank_model, global_loss, rank_batch, train_step
from workers.reshard import TensorMismatch

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

# FQN pieces that depend on the layout, not the model: activation-checkpoint wrappers, and the
# ReplicatedKV wrapper (tp > kv_heads) around wk/wv.
_WRAPPERS = re.compile(r"(?:_checkpoint_wrapped_module\.)|(?<=\.w[kv]\.)linear\.")


def canonical_fqn(name: str) -> str:
    """The single-model FQN of a parameter of a parallelised chunk."""
    return _WRAPPERS.sub("", name)


class Trainer:
    """This rank's share of one layout for reshard-check: ``workers.rank_model.build_rank_model``, as
    every trial builds it, plus ``module``, one shell over the rank's chunks with the single
    model's FQNs. ``step(i)`` trains on the global batch of step ``i`` (``train_step``, the trial's
    step without its measurements) and returns the global loss, on every rank."""

    def __init__(self, request: TrialRequest, device: torch.device) -> None:
        self.rm = build_rank_model(request, device)
        self.optimizer = self.rm.optimizer
        self.dtype = str(self.rm.dtype).removeprefix("torch.")
        self.module = shell([c for _, c in self.rm.par.chunks])

    def step(self, step: int) -> float:
        loss = global_loss(self.rm, train_step(self.rm, *rank_batch(self.rm, step)))
        self.rm.timer.take()  # nothing is measured here: drop the step's compute spans
        return loss

    def close(self) -> None:
        self.rm.schedule = None
        self.optimizer.state.clear()


def shell(chunks: list[nn.Module]) -> nn.Module:
    """One module over this rank's pipeline chunks with the single model's attribute names, so
    every FQN is the unsplit model's (layer keys are global). One chunk is returned as is."""
    if len(chunks) == 1:
        return chunks[0]
    out = nn.Module()
    out.layers = nn.ModuleDict()
    for chunk in chunks:
        for key, layer in chunk.layers.items():
            out.layers[key] = layer
        for name in ("tok_embeddings", "norm", "output"):
            if getattr(chunk, name, None) is not None:
                setattr(out, name, getattr(chunk, name))
    return out


# --- DCP state dicts keyed by single-model FQNs -----------------------------------------------------


def save_state(trainer: Trainer) -> dict[str, Any]:
    """``get_state_dict`` of the trainer for ``dcp.save``/``dcp.load``, keys made canonical
    (ReplicatedKV's ``linear.`` dropped; ``get_state_dict`` already drops the checkpoint wrapper).

    The optimizer state is flattened (``flatten_optimizer_state_dict``: one key per parameter and
    state, param-group settings per parameter, as torchtitan saves it): a nested ``param_groups``
    list holds one rank's FQNs and would not map onto another pipeline split. The layout's own key
    names are kept on the trainer to map back in ``load_state``."""
    model_sd, optim_sd = get_state_dict(trainer.module, trainer.optimizer, options=_OPTIONS)
    trainer._local_names = {  # type: ignore[attr-defined]
        "model": {canonical_fqn(k): k for k in model_sd}, "optim": {canonical_fqn(k): k for k in optim_sd},
    }
    return {"model": {canonical_fqn(k): v for k, v in model_sd.items()},
            "optim": {canonical_fqn(k): v for k, v in optim_sd.items()}}


def load_state(trainer: Trainer, state: dict[str, Any]) -> None:
    local: dict[str, dict[str, str]] = trainer._local_names  # type: ignore[attr-defined]
    set_state_dict(trainer.module, trainer.optimizer,
                   model_state_dict={local["model"][k]: v for k, v in state["model"].items()},
                   optim_state_dict={local["optim"][k]: v for k, v in state["optim"].items()}, options=_OPTIONS)


def corrupt_state(state: dict[str, Any], how: str) -> None:
    """The deliberately wrong reshard, applied after ``dcp.load`` and before ``set_state_dict``.

    "swap-layers": swap the two lowest layers' tensors that this rank holds (model and optimizer
    state), as a shard mapping that is off by one layer would.
    "permute-shards": a wrong shard mapping (``permute_shards``): every rank gets another rank's
    shard of every sharded tensor, so shapes and dtypes are right and the values are in the wrong
    places. Both replace the entries with new tensors: a state dict's tensors may share storage
    with the live parameters (and with each other, for tied weights)."""
    if how == "permute-shards":
        permute_shards(state)
        return
    assert how == "swap-layers", how
    ids = sorted({int(k.split(".")[1]) for k in state["model"] if k.startswith("layers.")})
    if len(ids) < 2:
        return
    a, b = f"layers.{ids[0]}.", f"layers.{ids[1]}."
    for d, prefix in ((state["model"], ""), (state["optim"], "state.")):
        for key in [k for k in d if k.startswith(prefix + a)]:
            other = prefix + b + key[len(prefix + a):]
            if torch.is_tensor(d[key]):
                d[key], d[other] = d[other].clone(), d[key].clone()


def _rotate(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor | None:
    """The local shard of the previous rank of ``group`` (index - 1, cyclic), or None when the
    group's shards differ in shape (an uneven split: no shape-preserving wrong mapping exists)."""
    n, me = dist.get_world_size(group), dist.get_group_rank(group, dist.get_rank())
    shape = torch.tensor(local.shape, dtype=torch.int64)
    shapes = [torch.empty_like(shape) for _ in range(n)]
    dist.all_gather(shapes, shape, group=group)
    if any(not torch.equal(s, shape) for s in shapes):
        return None
    shards = [torch.empty_like(local) for _ in range(n)]
    dist.all_gather(shards, local, group=group)
    return shards[(me - 1) % n]


def permute_shards(state: dict[str, Any]) -> list[str]:
    """Load with a wrong shard mapping: for every DTensor whose placement on a mesh dim of size > 1
    is a shard (``Shard`` or FSDP x TP's ``_StridedShard``), rotate the shard index by one along
    that mesh dim, exchanging the real local shards between ranks (one ``all_gather`` per tensor
    and dim). Returns the keys permuted. Replicated tensors (norms under TP without FSDP, Adam's
    step) and uneven splits are left alone. Collective: every rank of a pipeline stage holds the
    same keys and calls in the same (sorted) order."""
    done = []
    for part in ("model", "optim"):
        d = state[part]
        for key in sorted(d):
            t = d[key]
            if not isinstance(t, DTensor):
                continue
            mesh, placements = t.device_mesh, t.placements
            local = t.to_local().detach().contiguous()
            moved = False
            for dim, placement in enumerate(placements):
                if not isinstance(placement, (Shard, _StridedShard)) or mesh.size(dim) == 1:
                    continue
                rotated = _rotate(local, mesh.get_group(dim))
                if rotated is not None:
                    local, moved = rotated, True
            if moved:
                d[key] = DTensor.from_local(local, mesh, placements, run_check=False, shape=t.shape,
                                            stride=t.stride())
                done.append(f"{part}/{key}")
    return done


# --- full-state snapshot and comparison -------------------------------------------------------------


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().to("cpu", copy=True)


def _entries(trainer: Trainer) -> list[tuple[str, torch.Tensor]]:
    """(key, local tensor) of every parameter and optimizer tensor on this rank, in an order
    identical on every rank of a stage (the order of the full_tensor collectives)."""
    out = []
    for name, p in trainer.module.named_parameters():
        fqn = canonical_fqn(name)
        out.append((f"model/{fqn}", p))
        for k, v in sorted(trainer.optimizer.state.get(p, {}).items()):
            if torch.is_tensor(v):
                out.append((f"optim/{fqn}/{k}", v))
    return out


def _iter_full(trainer: Trainer) -> Iterator[tuple[str, torch.Tensor]]:
    for key, t in _entries(trainer):
        yield key, _full(t)  # one tensor gathered at a time: memory stays one full tensor


def full_state(trainer: Trainer, *, write_dir: str) -> dict[str, int]:
    """Gather every tensor to full and write each key once (by the lowest rank holding it) to
    ``write_dir/rank<r>.pt``. Returns key -> the rank whose file holds it (same on every rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    keys: list[list[str]] = [[] for _ in range(world)]
    dist.all_gather_object(keys, [k for k, _ in _entries(trainer)])
    owner: dict[str, int] = {}
    for r, ks in enumerate(keys):
        for k in ks:
            owner.setdefault(k, r)
    mine = {k: t for k, t in _iter_full(trainer) if owner[k] == rank}
    os.makedirs(write_dir, exist_ok=True)
    torch.save(mine, os.path.join(write_dir, f"rank{rank}.pt"))
    dist.barrier()
    return owner


def _sum(t: torch.Tensor) -> float | None:
    total = t.double().sum().item()
    return total if math.isfinite(total) else None  # stored as JSON: no nan/inf


def _compare(key: str, got: torch.Tensor, ref: torch.Tensor) -> tuple[float | None, TensorMismatch | None]:
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return None, TensorMismatch(key, None, f"saved {ref.dtype} {tuple(ref.shape)}, loaded {got.dtype} {tuple(got.shape)}")
    diff = (got.double() - ref.double()).abs().max().item() if got.numel() else 0.0
    if torch.equal(got.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)):
        return diff, None
    # Only for a mismatch: are the values all there, in the wrong places (a wrong mapping), or not?
    permuted = torch.equal(got.reshape(-1).sort().values, ref.reshape(-1).sort().values)
    detail = "values permuted: the saved values, in other places" if permuted else "values differ"
    return diff, TensorMismatch(key, diff, detail, saved_sum=_sum(ref), loaded_sum=_sum(got))


def compare_full_state(trainer: Trainer, owner: dict[str, int], read_dir: str
                       ) -> tuple[int, list[TensorMismatch], float]:
    """Gather this layout's state to full and compare it bit for bit with the saved one. Returns
    (tensors compared, mismatches, max abs diff), global: identical on every rank."""
    files: dict[int, dict[str, torch.Tensor]] = {}
    seen, found, max_diff = [], [], 0.0
    for key, got in _iter_full(trainer):
        seen.append(key)
        if key not in owner:
            found.append(TensorMismatch(key, None, "not in the saved state"))
            continue
        r = owner[key]
        if r not in files:
            files[r] = torch.load(os.path.join(read_dir, f"rank{r}.pt"), mmap=True, weights_only=True)
        diff, bad = _compare(key, got, files[r][key])
        if diff is not None:
            max_diff = max(max_diff, diff) if diff == diff else float("inf")
        if bad is not None:
            found.append(bad)
    world = dist.get_world_size()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (seen, [vars(m) for m in found], max_diff))
    every: set[str] = set()
    merged: dict[str, TensorMismatch] = {}
    for keys, mismatches, diff in gathered:
        every.update(keys)
        max_diff = max(max_diff, diff)
        for m in mismatches:
            prev = merged.get(m["key"])
            if prev is None or (m["max_abs_diff"] or 0.0) > (prev.max_abs_diff or 0.0):
                merged[m["key"]] = TensorMismatch(**m)
    for key in sorted(set(owner) - every):
        merged[key] = TensorMismatch(key, None, "missing after the load")
    checked = len(every & set(owner))
    return checked, [merged[k] for k in sorted(merged)], max_diff
