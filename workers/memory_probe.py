"""What one rank of a layout really holds, part by part, measured from its tensors (for the memory
model's harness, tests/workers/test_memory_harness.py; run on every rank of a process group).

Parts: params, grads and optimizer state (unique storages of this rank's tensors), activations
per layer (what autograd saves while one micro-batch runs forward, by the running block; storages
saved by several blocks reported apart as ``shared``), and the step's peak resident memory with the
process's baseline. ``probe_many`` measures several layouts in one process group. How each part is
counted: docs/workers.md, "Memory probe".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor

from workers import measure
from workers.parallelize import coordinate
from workers.rank_model import build_rank_model, rank_batch, train_step


def _local(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, DTensor):
        t = t.to_local()
    # A functional collective's result (DTensor's redistribute under TP/SP) is a wrapper whose storage
    # is its ``elem``'s; asking the wrapper raises.
    return t.elem if isinstance(t, AsyncCollectiveTensor) else t


def _storage_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        t = _local(t)
        st = t.untyped_storage()
        seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
    return sum(seen.values())


def _params(rm) -> list[torch.nn.Parameter]:
    out, ids = [], set()
    for _, chunk in rm.par.chunks:
        for p in chunk.parameters():
            if id(p) not in ids:
                ids.add(id(p))
                out.append(p)
    return out


def saved_activations_per_layer(rm, tokens, positions) -> tuple[dict[int, int], int]:
    """(bytes autograd saves per block during one micro-batch's forward, by layer index; bytes of the
    storages saved by more than one block) for pp = 1."""
    assert rm.schedule is None, "saved activations are probed without a pipeline schedule (pp = 1)"
    at_rest = {_local(p).untyped_storage().data_ptr() for p in _params(rm)}
    live: set[int] = set(at_rest)  # parameter storages now: at rest, plus the running block's unsharded ones
    current: list[int | None] = [None]
    per_layer: dict[int, dict[int, int]] = {}
    hooks = []
    (_, model), = rm.par.chunks

    def enter(i: int) -> None:
        live.clear()
        live.update(at_rest)
        current[0] = i

    def unsharded(module: torch.nn.Module) -> None:
        # FSDP (a block's unit, or a MoE's own unit inside it) has unsharded these weights by now (its
        # pre-forward hook was registered first, so it runs first): gather buffers, not activations.
        # Re-collected per block, since a freed buffer's address may come back as an activation's.
        live.update(_local(p).untyped_storage().data_ptr() for p in module.parameters(recurse=False))

    for key, block in model.layers.items():
        idx = int(key)
        hooks.append(block.register_forward_pre_hook(lambda _m, _a, i=idx: enter(i)))
        for mod in block.modules():
            hooks.append(mod.register_forward_pre_hook(lambda m, _a: unsharded(m)))
        hooks.append(block.register_forward_hook(lambda _m, _a, _o: current.__setitem__(0, None)))

    def pack(t: torch.Tensor) -> torch.Tensor:
        if current[0] is not None:
            try:
                st = _local(t).untyped_storage()
                ptr, nbytes = st.data_ptr(), st.nbytes()
            except RuntimeError:  # a tensor without real storage (an empty placeholder): holds nothing
                return t
            if ptr not in live:
                d = per_layer.setdefault(current[0], {})
                d[ptr] = max(d.get(ptr, 0), nbytes)
        return t

    mbs = rm.request.layout.mbs
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast(rm.device.type, dtype=rm.dtype, enabled=rm.autocast):
            out = model(tokens[:mbs], positions)
    finally:
        for h in hooks:
            h.remove()
    del out
    owners: dict[int, int] = {}
    for d in per_layer.values():
        for ptr in d:
            owners[ptr] = owners.get(ptr, 0) + 1
    shared = {ptr: n for d in per_layer.values() for ptr, n in d.items() if owners[ptr] > 1}
    per = {i: sum(n for ptr, n in d.items() if owners[ptr] == 1) for i, d in sorted(per_layer.items())}
    return per, sum(shared.values())


def _rss_bytes() -> int | None:
    """The process's resident set now (CPU), the base the layout's own peak grows from."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def probe(rm_request, device: torch.device) -> dict[str, Any]:
    """Measure one rank of ``rm_request`` (a TrialRequest); returns bytes per part."""
    measure.reset_peak_memory(device)
    rss_start = _rss_bytes()
    rm = build_rank_model(rm_request, device)
    tokens, targets, positions = rank_batch(rm, 0)
    params = _storage_bytes(_params(rm))
    acts, shared = saved_activations_per_layer(rm, tokens, positions) if rm.schedule is None else ({}, 0)
    # The gradients as the step's backwards leave them: capture them before the optimizer frees them.
    grads: dict[str, int] = {}
    opt = rm.optimizer
    hook = opt.register_step_pre_hook(lambda *_: grads.__setitem__("g", _storage_bytes(p.grad for p in _params(rm))))
    train_step(rm, tokens, targets, positions)
    hook.remove()
    state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    optimizer = _storage_bytes(state)
    del state
    measure.reset_peak_memory(device)
    train_step(rm, *rank_batch(rm, 1))
    peak, _, how = measure.peak_memory(device)
    return {"params": params, "grads": grads.get("g", 0), "optimizer": optimizer, "activations": acts,
            "shared_activations": shared, "peak": peak, "peak_measure": how, "rss_start": rss_start,
            "pp_rank": coordinate(rm.mesh, "pp")}


def probe_many(requests, device: torch.device) -> list[dict[str, Any]]:
    """``probe`` each request in turn on this rank (the same process group; world sizes equal), each
    layout's tensors released before the next one's peak window opens."""
    out = []
    for request in requests:
        out.append(probe(request, device))
        measure.release_memory(device)
    return out
