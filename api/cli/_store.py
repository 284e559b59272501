"""What the commands that read or run sweeps share: the store they open, and a foreground run's
Ctrl-C (the first one starts no new trial and leaves the sweep resumable; a second one leaves at once).
"""

from __future__ import annotations

import signal
import threading
from typing import Any


def open_sessions() -> Any:
    """(settings, sessionmaker) of the store the settings name (created with its schema when new)."""
    from api import store
    from api.settings import Settings

    settings = Settings()
    _, sessions = store.open_store(settings.resolved_database_url)
    return settings, sessions


def resume_hint(sweep_id: int) -> str:
    return (f"sweep {sweep_id} is unfinished; resume it with `meshtune sweep --resume {sweep_id}` "
            "(a coordinator, `meshtune serve`, on the same database resumes it too)")


def stop_on_ctrl_c(stop: threading.Event, console: Any) -> Any:
    """First Ctrl-C: start no new trial, record the ones in flight, then return (resumable).
    Second Ctrl-C: KeyboardInterrupt at once (trials in flight are re-run on resume).
    Returns the previous SIGINT handler, or None off the main thread (no handler installed)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum: int, frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        console.print("[yellow]stopping: no new trials; waiting for the trials in flight to be recorded "
                      "(Ctrl-C again to leave them now)[/yellow]")

    return signal.signal(signal.SIGINT, handler)

