"""The trial page's memory card: each rank's memory over the trial's last measured step, its phases
and where its peak falls, beside the memory model's parts for its pipeline rank (api.memory.service
reads them; templates/_trial_memory.html and static/memory.js draw them)."""

from __future__ import annotations

from typing import Any

from api.memory import service

MiB = 2**20
PART_LABELS = {  # tuner/_memory_parts.py PARTS, in stacking order, as the chart names them
    "params": "parameters", "grads": "gradients", "optimizer": "optimizer state", "buffers": "gathered buffers",
    "activations": "activations (per micro-batch x in flight)", "working": "recompute working set",
    "logits": "logits", "constants": "RoPE tables / masks", "overhead": "framework overhead",
}


def phase_text(phase: str | None, stage: int | None, micro_batch: int | None) -> str:
    """A phase of the step in words: ``stage 1 · micro-batch 3 · backward``."""
    words = [f"stage {stage}"] if stage is not None else []
    if micro_batch is not None:
        words.append(f"micro-batch {micro_batch}")
    named = {"pipeline send/recv": "between chunks (send/recv, waiting)", "start": "before the first forward"}
    words.append(named.get(phase or "", phase or "?"))
    return " · ".join(words)


def step_text(rank: dict[str, Any]) -> str:
    """Where a rank's resident peak within its recorded step falls, in words."""
    peak = rank.get("peak") or {}
    if peak.get("held_from_start"):
        return "held from the step's start: nothing in the step went above it"
    return phase_text(peak.get("phase"), peak.get("stage"), peak.get("micro_batch"))


def peak_text(rank: dict[str, Any]) -> str:
    """Where a rank's peak falls: in its recorded step (and where there), or before or after it."""
    where = (rank.get("peak") or {}).get("where")
    if where == "before":
        return f"before this step (the build, the warm-up or an earlier step); in the step: {step_text(rank)}"
    if where == "after":
        return f"after this step (the loss all-reduce that ends the trial); in the step: {step_text(rank)}"
    return step_text(rank)


def view(session: Any, *, sweep_id: int, trial_id: int) -> dict[str, Any]:
    """The card's context: summary rows per rank and the chart's data (MiB, milliseconds)."""
    memory = service.trial_memory(session, sweep_id=sweep_id, trial_id=trial_id)
    predicted = {p["stage"]: p for p in memory["predicted"]}
    includes_overhead = (memory["memory_measure"] or "").startswith("cpu.")  # VmHWM: the whole process
    rows, chart = [], []
    for r in memory["ranks"]:
        stage = r.get("pp_stage") or 0
        pred = predicted.get(stage)
        text = peak_text(r)
        live = r.get("live_peak")
        live_text = phase_text(live["phase"], live["stage"], live["micro_batch"]) if live else None
        rows.append({"rank": r.get("rank"), "stage": stage, "peak": r["peak_bytes"], "where": text,
                     "live_peak": live["bytes"] if live else None, "live_where": live_text,
                     "before": r["before_bytes"], "step": r["step_peak_bytes"], "after": r["after_bytes"],
                     "predicted": pred["total"] if pred else None,
                     "error": (pred["total"] - r["peak_bytes"]) / r["peak_bytes"] if pred and r["peak_bytes"] else None})
        chart.append({
            "rank": r.get("rank"), "stage": stage, "t_ms": r["t_ms"], "mib": [b / MiB for b in r["bytes"]],
            "phases": r.get("phases") or [], "peak": r.get("peak") or {}, "peak_mib": r["peak_bytes"] / MiB,
            "step_peak_mib": r["step_peak_bytes"] / MiB, "before_mib": r["before_bytes"] / MiB,
            "after_mib": r["after_bytes"] / MiB, "where": text, "step_where": step_text(r), "series": r.get("series"),
            "live_mib": [None if v is None else v / MiB for v in r.get("live") or []],
            "live_peak": None if live is None else {"t_ms": live["t_ms"], "mib": live["bytes"] / MiB, "where": live_text},
            "predicted": None if pred is None else {k: pred[k] / MiB for k in PART_LABELS if k != "overhead"},
            # The parts are drawn without the framework overhead (the interpreter and torch on CPU, the
            # CUDA context and NCCL on GPU: hundreds of MiB that would hide them); the measured peak is
            # drawn on the same footing: VmHWM counts the whole process (less the predicted overhead),
            # torch's allocator counts tensors only.
            "overhead_mib": pred["overhead"] / MiB if pred else None,
            "comparable_peak_mib": (r["peak_bytes"] - (pred["overhead"] if pred and includes_overhead else 0)) / MiB,
        })
    labels = {k: v for k, v in PART_LABELS.items() if k != "overhead"}
    return {**memory, "rows": rows, "chart": {"ranks": chart, "labels": labels, "measure": memory["memory_measure"],
                                              "peak_less_overhead": includes_overhead}}
