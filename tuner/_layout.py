"""A parallel layout: the degree of every mesh axis plus the knobs that change memory and time.

Axes: tp (tensor), cp (context), ep (expert), dp (data), pp (pipeline); the world size is their
product. Expert parallelism lives inside the data-parallel dimension (DeepSpeed-MoE, Rajbhandari et
al. 2022): the batch is split over dp*ep ranks, dense weights are replicated/sharded over dp*ep,
expert weights are sharded over ep and replicated/sharded over dp.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from tuner._errors import LayoutError, require_positive_int
from tuner._partition import max_stages
from tuner._placement import AXES, _place
from tuner._specs import ClusterSpec, ModelSpec, TrainingSpec
from tuner._stack import stack_of

CHECKPOINTING = ("none", "selective", "full")
SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    mbs: int = 1
    ac: Literal["none", "selective", "full"] = "none"
    sp: bool = False
    schedule: Literal["gpipe", "1f1b", "interleaved"] = "1f1b"
    vpp: int = 1

    def __post_init__(self) -> None:
        for f in ("tp", "pp", "dp", "cp", "ep", "mbs", "vpp"):
            require_positive_int(f, getattr(self, f))
        if isinstance(self.zero, bool) or self.zero not in (0, 1, 2, 3):
            raise LayoutError(f"zero must be one of 0, 1, 2, 3, got {self.zero!r}")
        if self.ac not in CHECKPOINTING:
            raise LayoutError(f"ac must be one of {CHECKPOINTING}, got {self.ac!r}")
        if self.schedule not in SCHEDULES:
            raise LayoutError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if not isinstance(self.sp, bool):
            raise LayoutError(f"sp must be true or false, got {self.sp!r}")
        if self.sp and self.tp == 1:
            raise LayoutError("sp=true needs tp > 1 (sequence parallelism shards along the tp group)")
        if self.vpp > 1 and self.schedule != "interleaved":
            raise LayoutError(f"vpp={self.vpp} needs schedule='interleaved', got {self.schedule!r}")
        if self.schedule == "interleaved" and self.pp == 1:
            raise LayoutError("schedule='interleaved' needs pp > 1")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp * self.ep

    @property
    def data_ranks(self) -> int:
        """Ranks that see different samples of the batch (dp*ep)."""
        return self.dp * self.ep

    @property
    def stages(self) -> int:
        """Pipeline stages in total (pp ranks times virtual stages per rank)."""
        return self.pp * self.vpp

    def degrees(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in AXES}

    @property
    def key(self) -> str:
        """A stable, readable identity (used to deduplicate trials and name layouts)."""
        sched = f"{self.schedule}v{self.vpp}" if self.schedule == "interleaved" else self.schedule
        if self.pp == 1:
            sched = "nopp"
        return (
            f"tp{self.tp}-cp{self.cp}-ep{self.ep}-dp{self.dp}-pp{self.pp}-z{self.zero}-mbs{self.mbs}"
            f"-ac_{self.ac}{'-sp' if self.sp else ''}-{sched}"
        )

    @property
    def short(self) -> str:
        """The display form of ``key``: only what differs from the defaults, e.g. ``dp4 z1 mbs2``
        for ``tp1-cp1-ep1-dp4-pp1-z1-mbs2-ac_none-nopp``. Two different keys never read the same:
        every field that is not at its default is shown (dp always, so the form is never empty; the
        schedule whenever pp > 1, since it is what the pipeline runs, and never at pp = 1, where the
        key has none either). Tables and labels show this; JSON, CSV and the store keep ``key``."""
        parts = [f"{a}{getattr(self, a)}" for a in ("tp", "cp", "ep") if getattr(self, a) > 1]
        parts.append(f"dp{self.dp}")
        if self.pp > 1:
            parts.append(f"pp{self.pp}")
        if self.zero:
            parts.append(f"z{self.zero}")
        if self.mbs > 1:
            parts.append(f"mbs{self.mbs}")
        if self.ac != "none":
            parts.append(f"ac_{self.ac}")
        if self.sp:
            parts.append("sp")
        if self.pp > 1:
            parts.append(f"interleaved-v{self.vpp}" if self.schedule == "interleaved" else self.schedule)
        return " ".join(parts)

    def with_(self, **changes: object) -> Layout:
        return replace(self, **changes)  # type: ignore[arg-type]


def microbatches(layout: Layout, training: TrainingSpec) -> int:
    """Micro-batches per step and data rank: global_batch / (dp*ep*mbs); raises if it does not divide."""
    per_rank = layout.data_ranks * layout.mbs
    if training.global_batch % per_rank:
        raise LayoutError(
            f"global_batch={training.global_batch} is not divisible by dp*ep*mbs="
            f"{layout.dp}*{layout.ep}*{layout.mbs}={per_rank}"
        )
    return training.global_batch // per_rank


# --- twins: layouts that run the identical program ------------------------------------------------
# One key per distinct program: enumeration, rejection counts, the search space, rankings and the
# plan all use the canonical form, so no device time is spent twice on one program and no program is
# ranked against itself. What the workers build for each knob is in workers/parallelize.py; the
# canonical ZeRO level is the one whose textbook description (Rajbhandari et al. 2020, Sec. 5)
# matches what that program holds.


def canonical_zero(zero: int, *, data: int, microbatches: int | None) -> int:
    """The ZeRO level that names the program ``zero`` runs with ``data`` = dp*cp*ep data ranks,
    and ``microbatches`` per step (None where the batch does not divide):

    - no data axis (``data == 1``): the workers apply neither FSDP nor a gradient all-reduce, so
      ZeRO 1-3 shard nothing and run the ZeRO-0 program (``zero=0``);
    - ZeRO-1 and ZeRO-2 both keep parameters gathered from forward to backward (FSDP2
      ``reshard_after_forward=False``) and differ only in when gradients are reduce-scattered: every
      micro-batch (ZeRO-2) or once on the step's last (ZeRO-1) — with or without a pipeline, since
      the workers' pipeline stage syncs per ZeRO level too (``tuner._realise``, ``grad_sync``). With
      one micro-batch the single reduce-scatter follows the only backward and gradients are never
      held whole: the ZeRO-2 program (``zero=2``).
    """
    if data == 1:
        return 0
    if zero == 1 and microbatches == 1:
        return 2
    return zero


def canonical_layout(layout: Layout, *, training: TrainingSpec) -> Layout:
    """The one layout that names ``layout``'s program (see ``canonical_zero``); without pipelining
    the schedule is moot (``1f1b``, vpp 1, as ``Layout.key`` already writes ``nopp``)."""
    per_rank = layout.data_ranks * layout.mbs
    m = training.global_batch // per_rank if training.global_batch % per_rank == 0 else None
    zero = canonical_zero(layout.zero, data=layout.dp * layout.cp * layout.ep, microbatches=m)
    schedule = layout.schedule if layout.pp > 1 else "1f1b"
    if zero == layout.zero and schedule == layout.schedule:
        return layout
    return replace(layout, zero=zero, schedule=schedule)


def twin_note(given: Layout, canonical: Layout) -> str | None:
    """One line saying why a user's ``given`` layout is reported as ``canonical`` (None if equal)."""
    if given == canonical:
        return None
    why = []
    if given.zero != canonical.zero:
        if canonical.zero == 0:
            cause = f"no data axis: dp*cp*ep={given.dp}*{given.cp}*{given.ep}=1"
        else:
            cause = "one micro-batch: gradients are reduce-scattered after its backward"
        why.append(f"zero={given.zero} runs the zero={canonical.zero} program ({cause})")
    if given.schedule != canonical.schedule:
        why.append(f"schedule={given.schedule!r} is moot with pp=1")
    return f"{'; '.join(why)}: reported as {canonical.key}"


# Short stable reasons for rejected layouts (enumeration counts them; plan adds its own two).
R_WORLD = "world size mismatch"
R_HEADS = "tp does not divide heads"
R_KV_HEADS = "tp and kv_heads do not divide"
R_FFN = "tp does not divide ffn"
R_CP_SEQ = "2*cp does not divide seq_len"
R_EP_DENSE = "ep needs a MoE model"
R_EP_EXPERTS = "ep does not divide experts"
R_SP_SEQ = "sp: tp*cp does not divide seq_len"
R_STAGES = "stages exceed layers"
R_BATCH = "batch not divisible by dp*ep*mbs"
R_FEW_MICROBATCHES = "micro-batches fewer than pp"
R_INTERLEAVED = "interleaved: pp does not divide micro-batches"
R_TP_NODES = "tp crosses nodes"


def degree_violation(
    tp: int, cp: int, ep: int, dp: int, pp: int, *, model: ModelSpec, cluster: ClusterSpec
) -> tuple[str, str] | None:
    """(reason, message) for mesh degrees that cannot work whatever the other knobs, else None."""
    world = tp * cp * ep * dp * pp
    if world != cluster.devices:
        return R_WORLD, (
            f"tp*cp*ep*dp*pp={tp}*{cp}*{ep}*{dp}*{pp}={world}"
            f" does not equal the device count {cluster.devices}"
            f" ({cluster.nodes} nodes x {cluster.devices_per_node})"
        )
    if model.heads % tp:
        return R_HEADS, f"tp={tp} does not divide heads={model.heads}"
    if model.kv_heads % tp and tp % model.kv_heads:
        return R_KV_HEADS, f"tp={tp} and kv_heads={model.kv_heads}: neither divides the other"
    ffn = model.expert_ffn if model.is_moe else model.ffn
    if ffn % tp:
        return R_FFN, f"tp={tp} does not divide {'expert_ffn' if model.is_moe else 'ffn'}={ffn}"
    # Load-balanced causal CP splits the sequence into 2*cp chunks (Llama 3, Sec. 3.3.2).
    if cp > 1 and model.seq_len % (2 * cp):
        return R_CP_SEQ, f"cp={cp} needs 2*cp={2 * cp} to divide seq_len={model.seq_len}"
    if ep > 1:
        if not model.is_moe:
            return R_EP_DENSE, f"ep={ep} needs a MoE model (model.experts > 0)"
        if model.experts % ep:
            return R_EP_EXPERTS, f"ep={ep} does not divide experts={model.experts}"
    return None


def layout_violation(
    layout: Layout, *, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
    allow_tp_across_nodes: bool = False,
) -> tuple[str, str] | None:
    """(reason, message) of the first rule ``layout`` breaks, else None. The order of the checks is
    the order enumeration counts rejections in: mesh degrees, TP inside a node, sp, stages, batch,
    schedule. The workers build their mesh with the default placement and refuse TP groups that
    leave a node (``tuner.place``), so that is a rule here too unless ``allow_tp_across_nodes``
    (a what-if of ``meshtune plan``)."""
    bad = degree_violation(
        layout.tp, layout.cp, layout.ep, layout.dp, layout.pp, model=model, cluster=cluster
    )
    if bad:
        return bad
    if layout.tp > 1 and not allow_tp_across_nodes and not _place(
        (layout.tp, layout.cp, layout.ep, layout.dp, layout.pp), AXES, cluster.devices_per_node,
        cluster.domain_devices,
    ).axes["tp"].in_domain:
        return R_TP_NODES, (f"tp={layout.tp} groups would cross nodes (devices_per_node="
                            f"{cluster.devices_per_node}) in the workers' placement")
    if layout.sp and model.seq_len % (layout.tp * layout.cp):
        return R_SP_SEQ, f"sp needs tp*cp={layout.tp * layout.cp} to divide seq_len={model.seq_len}"
    end_stages = stack_of(training).end_stages
    if layout.stages > max_stages(model, end_stages=end_stages):
        ends = (f" + 2 (the embedding and the loss as stages of their own, stack {training.stack})"
                if end_stages else "")
        return R_STAGES, f"pp*vpp={layout.stages} stages exceed layers={model.layers}{ends}"
    per_rank = layout.data_ranks * layout.mbs
    if training.global_batch % per_rank:
        return R_BATCH, (
            f"global_batch={training.global_batch} is not divisible by dp*ep*mbs="
            f"{layout.dp}*{layout.ep}*{layout.mbs}={per_rank}"
        )
    m = training.global_batch // per_rank
    if layout.pp > 1 and layout.schedule != "gpipe" and m < layout.pp:
        return R_FEW_MICROBATCHES, f"schedule={layout.schedule!r} needs micro-batches m={m} >= pp={layout.pp}"
    if layout.schedule == "interleaved" and m % layout.pp:
        return R_INTERLEAVED, f"interleaved schedule needs pp={layout.pp} to divide micro-batches m={m}"
    return None


def check_layout(
    layout: Layout, *, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
    allow_tp_across_nodes: bool = False,
) -> int:
    """Raise LayoutError naming the numbers if ``layout`` cannot run; return its micro-batch count."""
    bad = layout_violation(layout, model=model, cluster=cluster, training=training,
                           allow_tp_across_nodes=allow_tp_across_nodes)
    if bad:
        raise LayoutError(bad[1])
    return microbatches(layout, training)
