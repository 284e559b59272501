"""The failure taxonomy: a rank's exception -> ``TrialError`` (oom, nan, crash); timeouts come from
the launcher's watchdog (``timeout_error``). Classification looks at exception *types* and their
structured fields, never at logs: ``oom`` is ``torch.OutOfMemoryError`` (bytes from
``bytes_requested``, the CUDA allocator's out-of-memory observer, or the message), the CPU
allocator's fixed c10 message, or a ``MemoryError``; ``nan`` is ``workers.train.NonFiniteLoss``;
anything else is a ``crash`` with rank, exception type and the traceback's last lines. Where each
figure comes from: docs/workers.md, "Failures".
"""

from __future__ import annotations

import re
import sys
import traceback
from collections.abc import Iterable

from workers._contract import TrialError

TRACEBACK_TAIL_LINES = 25
CPU_OOM = re.compile(r"DefaultCPUAllocator: can't allocate memory: you tried to allocate (\d+) bytes")
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "PiB": 2**50}
CUDA_OOM = re.compile(r"Tried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB|PiB)")

# Set by the CUDA allocator's OOM observer in this process: the size of the request that failed.
_last_cuda_oom_bytes: int | None = None
_observer_installed = False


def install_oom_observer() -> bool:
    """Record the exact byte count of every CUDA allocation failure in this process (idempotent:
    the allocator keeps every observer attached, and a reused rank process calls this per trial)."""
    global _observer_installed
    import torch

    if _observer_installed:
        return True
    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is None or not torch.cuda.is_available():
        return False

    def observer(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
        global _last_cuda_oom_bytes
        _last_cuda_oom_bytes = int(alloc)

    attach(observer)
    _observer_installed = True
    return True


def reset_oom_record() -> None:
    global _last_cuda_oom_bytes
    _last_cuda_oom_bytes = None


def traceback_tail(exc: BaseException, lines: int = TRACEBACK_TAIL_LINES) -> str:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _is_torch_oom(exc: BaseException) -> bool:
    torch = sys.modules.get("torch")  # a rank that never imported torch cannot raise its OOM
    oom_type = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    return oom_type is not None and isinstance(exc, oom_type)


def _is_non_finite_loss(exc: BaseException) -> bool:
    train = sys.modules.get("workers.train")  # only the rank program (which imports torch) raises it
    return train is not None and isinstance(exc, train.NonFiniteLoss)


def oom_bytes(exc: BaseException) -> int | None:
    """The bytes the failed allocation asked for, from the most exact source available."""
    attr = getattr(exc, "bytes_requested", None)
    if isinstance(attr, int) and not isinstance(attr, bool):
        return attr
    if _is_torch_oom(exc):
        if _last_cuda_oom_bytes is not None:
            return _last_cuda_oom_bytes
        m = CUDA_OOM.search(str(exc))
        return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else None
    m = CPU_OOM.search(str(exc))
    if m is None and exc.__cause__ is not None:
        return oom_bytes(exc.__cause__)
    return int(m.group(1)) if m else None


def classify(exc: BaseException, *, rank: int | None) -> TrialError:
    """The ``TrialError`` for an exception raised on ``rank``."""
    kind = "crash"
    nbytes = None
    if _is_non_finite_loss(exc):
        kind = "nan"
    elif _is_torch_oom(exc) or isinstance(exc, MemoryError) or bool(CPU_OOM.search(str(exc))):
        kind = "oom"
        nbytes = oom_bytes(exc)
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return TrialError(
        kind=kind,  # type: ignore[arg-type]
        message=message[:500],
        rank=rank,
        exception_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
        traceback_tail=traceback_tail(exc),
        bytes_requested=nbytes,
    )


def timeout_error(
    *,
    rank: int | None = None,
    ranks: Iterable[int] | None = None,
    world_size: int | None = None,
    seconds: float,
    what: str,
    steps_done: int | None = None,
) -> TrialError:
    """The watchdog's verdict: ``rank`` (or each of ``ranks``, of a trial of ``world_size`` ranks)
    made no progress for ``seconds`` while doing ``what``. ``TrialError.rank`` is set only when one
    rank is to blame; the message names the ranks either way ("all 4 ranks" when every rank hung)."""
    names = sorted(set(ranks if ranks is not None else ([] if rank is None else [rank])))
    if len(names) == 1:
        rank, who = names[0], f"rank {names[0]}"
    elif names and world_size is not None and names == list(range(world_size)):
        rank, who = None, f"all {world_size} ranks"
    elif names:
        rank, who = None, "ranks " + ", ".join(str(r) for r in names)
    else:
        rank, who = None, "the trial"
    done = "" if steps_done is None else f" after {steps_done} optimizer steps"
    return TrialError(
        kind="timeout",
        message=f"{who} made no progress for {seconds:.1f} s ({what}){done}; trial killed",
        rank=rank,
    )


def died_error(*, rank: int | None, exc: BaseException) -> TrialError:
    """A rank whose process died (segfault, os._exit, killed by the OS) — a crash without a Python
    exception of its own; Ray's ``ActorDiedError`` carries the cause."""
    return TrialError(
        kind="crash",
        message=f"rank {rank} process died: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:500],
        rank=rank,
        exception_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
        traceback_tail="\n".join(str(exc).strip().splitlines()[-TRACEBACK_TAIL_LINES:]),
    )
