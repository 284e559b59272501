"""The environment fingerprint stored with every measurement: what ran it, on what.

torch, CUDA, NCCL, driver, device name, host name, python, meshtune. Each rank takes its own; the
aggregate keeps rank 0's and the sorted set of host names of all ranks. Fields that do not apply
(CUDA on a CPU rank) are ``None``, never guessed.
"""

from __future__ import annotations

import platform
import socket
from functools import lru_cache
from importlib import metadata
from typing import Any


def _meshtune_version() -> str | None:
    try:
        return metadata.version("meshtune")
    except metadata.PackageNotFoundError:  # running from a source tree that was never installed
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _nvidia_driver() -> str | None:
    """The kernel driver version, from NVML when pynvml is installed, else /proc (Linux)."""
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
            return version.decode() if isinstance(version, bytes) else str(version)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - NVML missing or failing: fall back to /proc
        pass
    try:
        with open("/proc/driver/nvidia/version") as f:
            first = f.readline()
    except OSError:
        return None
    for token in first.split():
        if token.count(".") >= 1 and token.replace(".", "").isdigit():
            return token
    return None


@lru_cache(maxsize=4)
def fingerprint(device_kind: str = "cpu") -> dict[str, Any]:
    """This process's fingerprint for ranks on ``device_kind`` ("cpu" or "cuda")."""
    import torch

    env: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "meshtune": _meshtune_version(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "device_kind": device_kind,
        "cuda": torch.version.cuda,
        "nccl": None,
        "driver": None,
        "device_name": None,
    }
    if device_kind == "cuda" and torch.cuda.is_available():
        nccl = torch.cuda.nccl.version()
        env["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        env["driver"] = _nvidia_driver()
        env["device_name"] = torch.cuda.get_device_name(torch.cuda.current_device())
        env["device_count_visible"] = torch.cuda.device_count()
    else:
        env["device_name"] = _cpu_name()
        env["cpu_threads"] = torch.get_num_threads()
    return env
