"""Test helper: run a function on N CPU ranks (torch.multiprocessing spawn + gloo), collect results.

    results = run_ranks(4, fn, arg1, arg2, timeout_s=120)

``fn(rank, world_size, *args)`` must be a module-level (picklable) function; it runs after
``dist.init_process_group("gloo", timeout=60 s)`` and its return value (picklable) is returned per
rank, in rank order. If any rank raises, ``RankFailed`` is raised with every failing rank's
exception type, message and traceback; if the ranks do not finish within ``timeout_s`` they are
killed (only the processes this helper started) and ``TimeoutError`` is raised.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

INIT_TIMEOUT_S = 60


class RankFailed(RuntimeError):
    def __init__(self, failures: dict[int, tuple[str, str, str]]) -> None:
        self.failures = failures  # rank -> (exception type, message, traceback)
        lines = [f"rank {r}: {t}: {msg}\n{tb}" for r, (t, msg, tb) in sorted(failures.items())]
        super().__init__("ranks failed:\n" + "\n".join(lines))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, results) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # N ranks share a couple of cores: oversubscription only adds noise
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=INIT_TIMEOUT_S))
        out = fn(rank, world, *args)
        results.put((rank, True, out))
    except BaseException as exc:  # report everything, including the exception's own type
        results.put((rank, False, (type(exc).__name__, str(exc), traceback.format_exc()[-4000:])))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; results in rank order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(got))} did not finish "
                                   f"within {timeout_s} s")
            try:
                rank, ok, out = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode not in (None, 0)]
                if dead:  # died without reporting (segfault, os._exit): no point waiting for peers
                    raise RankFailed(
                        {r: ("ProcessDied", f"exit code {procs[r].exitcode}", "") for r in dead}
                    ) from None
                continue
            got[rank] = (ok, out)
            if not ok:  # one failure: give the peers a moment to report theirs, then stop
                stop = time.monotonic() + 5.0
                while len(got) < world_size and time.monotonic() < stop:
                    try:
                        r, k, o = results.get(timeout=0.5)
                        got[r] = (k, o)
                    except queue.Empty:
                        pass
                break
    finally:
        for p in procs:
            p.join(timeout=2.0)
            if p.is_alive():
                p.kill()
                p.join()
    failures = {r: out for r, (ok, out) in got.items() if not ok}
    if failures:
        raise RankFailed(failures)
    return [got[r][1] for r in range(world_size)]
