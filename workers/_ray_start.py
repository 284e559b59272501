"""Starting or joining Ray for the Ray backend, robust to a slow start and to a cluster that is away.

On a loaded machine a local Ray can miss its own start-up deadline: Ray 2.x waits a fixed 30 s for
the raylet to register with the GCS, then raises a bare ``Exception("The current node timed out
during startup...")`` (ray/_private/node.py, ``Node.__init__``, ``raylet_start_wait_time_s``); a
cluster can be briefly unreachable. ``start_ray`` retries both with back-off and then raises
``BackendUnavailable`` with one line saying what and why. Bad arguments (``ValueError`` /
``TypeError``) are a ``BackendError`` at once. What a failed attempt started is stopped before the
next one (``clean_failed_start``), so retries do not pile raylets onto an already loaded machine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time

import psutil
import ray

from tuner import BackendError
from workers._contract import BackendUnavailable

log = logging.getLogger("meshtune.workers")
# One lock for the process: Ray is one per process, and two backends starting it at once would
# race into "ray.init called twice".
_RAY_INIT_LOCK = threading.Lock()


def start_ray(address: str | None, *, num_cpus: int, retry_delays_s: tuple[float, ...]) -> bool:
    """Join Ray at ``address`` or start a local one with ``num_cpus`` logical CPUs, unless this
    process is connected already; one attempt plus one per back-off delay. True when this call
    started a local Ray (its caller then owns its shutdown)."""
    where = f"join Ray at RAY_ADDRESS={address!r}" if address else "start a local Ray"
    with _RAY_INIT_LOCK:
        delays = list(retry_delays_s)
        for attempt in range(1, len(delays) + 2):
            if ray.is_initialized():
                return False
            before = child_pids()
            try:
                if address:
                    ray.init(address=address, log_to_driver=False)
                    return False
                # address="local": always a new local Ray. A bare ray.init() joins the latest Ray found on
                # the machine (/tmp/ray/ray_current_cluster), which then refuses num_cpus, or worse,
                # runs meshtune's trials on someone else's cluster.
                ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
                return True
            except (ValueError, TypeError) as exc:
                raise BackendError(f"cannot {where}: {exc}") from exc
            except Exception as exc:  # noqa: BLE001 - Ray's start-up failures include bare Exceptions
                clean_failed_start(before)
                if attempt > len(delays):
                    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                    raise BackendUnavailable(
                        f"cannot {where} after {attempt} attempts: {type(exc).__name__}: {first}"
                    ) from exc
                log.warning("cannot %s (attempt %d: %s: %s); retrying in %.0f s",
                            where, attempt, type(exc).__name__, exc, delays[attempt - 1])
                time.sleep(delays[attempt - 1])
    raise AssertionError("unreachable")  # pragma: no cover - the last attempt returns or raises


def check_reachable(address: str, timeout_s: float = 3.0) -> None:
    """Raise BackendError unless something listens at ``address`` (host:port, optional ray://)."""
    if address in ("auto", "local"):
        return
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise BackendError(f"RAY_ADDRESS={address!r} is not host:port")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise BackendUnavailable(f"Ray is not reachable at RAY_ADDRESS={address!r}: {exc}") from None


def child_pids() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _is_ray(proc: psutil.Process) -> bool:
    """A process of Ray's own: its binaries and scripts live in the ray package, its workers are
    titled "ray::..." (nothing else this process may have spawned meanwhile is touched)."""
    try:
        command = " ".join(proc.cmdline()) or proc.name()
    except psutil.Error:
        return False
    return f"{os.sep}ray{os.sep}" in command or command.startswith("ray::")


def clean_failed_start(before: set[int]) -> None:
    """Undo what a failed ``ray.init`` left running: the driver's half-made connection, and the Ray
    processes (GCS, raylet, their workers) it spawned before giving up. Ray forgets them when its
    ``Node`` fails to construct, so ``ray.shutdown`` cannot stop them; they are this process's
    children that did not exist before the attempt."""
    if ray.is_initialized():
        with contextlib.suppress(Exception):
            ray.shutdown()
    new = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and _is_ray(p)]
    for proc in new:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(new, timeout=10)
