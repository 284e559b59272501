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
from tuner._specs import ClusterSpec, ModelSpec, TrainingSpec

AXES = ("tp", "cp", "ep", "dp", "pp")  # default placement order, innermost (chattiest) first
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


def check_layout(
    layout: Layout, *, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec
) -> int:
    """Raise LayoutError naming the numbers if ``layout`` cannot run; return its micro-batch count."""
    if layout.world_size != cluster.devices:
        raise LayoutError(
            f"tp*cp*ep*dp*pp={layout.tp}*{layout.cp}*{layout.ep}*{layout.dp}*{layout.pp}={layout.world_size}"
            f" does not equal the device count {cluster.devices}"
            f" ({cluster.nodes} nodes x {cluster.devices_per_node})"
        )
    if model.heads % layout.tp:
        raise LayoutError(f"tp={layout.tp} does not divide heads={model.heads}")
    if model.kv_heads % layout.tp and layout.tp % model.kv_heads:
        raise LayoutError(f"tp={layout.tp} and kv_heads={model.kv_heads}: neither divides the other")
    ffn = model.expert_ffn if model.is_moe else model.ffn
    if ffn % layout.tp:
        raise LayoutError(f"tp={layout.tp} does not divide {'expert_ffn' if model.is_moe else 'ffn'}={ffn}")
    if layout.sp and model.seq_len % (layout.tp * layout.cp):
        raise LayoutError(f"sp needs tp*cp={layout.tp * layout.cp} to divide seq_len={model.seq_len}")
    # Load-balanced causal CP splits the sequence into 2*cp chunks (Llama 3, Sec. 3.3.2).
    if layout.cp > 1 and model.seq_len % (2 * layout.cp):
        raise LayoutError(f"cp={layout.cp} needs 2*cp={2 * layout.cp} to divide seq_len={model.seq_len}")
    if layout.ep > 1:
        if not model.is_moe:
            raise LayoutError(f"ep={layout.ep} needs a MoE model (model.experts > 0)")
        if model.experts % layout.ep:
            raise LayoutError(f"ep={layout.ep} does not divide experts={model.experts}")
    if layout.stages > model.layers:
        raise LayoutError(f"pp*vpp={layout.stages} stages exceed layers={model.layers}")
    m = microbatches(layout, training)
    if layout.pp > 1 and layout.schedule != "gpipe" and m < layout.pp:
        raise LayoutError(
            f"schedule={layout.schedule!r} needs micro-batches m={m} >= pp={layout.pp}"
        )
    if layout.schedule == "interleaved" and m % layout.pp:
        raise LayoutError(f"interleaved schedule needs pp={layout.pp} to divide micro-batches m={m}")
    return m
