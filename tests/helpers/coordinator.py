"""A coordinator (``SweepRunner.run_pending``) in a process of its own, on a given store: what the
restart tests kill with SIGKILL and start again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_CODE = """
import threading
from api.engine import SweepRunner
from api.settings import Settings
SweepRunner(Settings({settings}), stale_after_s=600, poll_s=0.2).run_pending(threading.Event())
"""


def start_coordinator(url: str, home: Path, *, settings: str = "") -> subprocess.Popen:
    """Start it on ``url`` with MESHTUNE_HOME ``home``; ``settings``: Settings keyword arguments as code."""
    env = {**os.environ, "MESHTUNE_DATABASE_URL": url, "MESHTUNE_HOME": str(home),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", _CODE.format(settings=settings)], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
