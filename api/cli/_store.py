"""What the commands that read or run sweeps share: the store they open, and a foreground run with
its progress bar and Ctrl-C (the first one starts no new trial and leaves the sweep resumable; a second
one leaves at once).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
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


def run_in_foreground(runner: Any, sweep_id: int, console: Any, *, description: str, total: int, completed: int = 0,
                      counts: Callable[[dict[str, Any]], bool]) -> Any | None:
    """Run the sweep here under a progress bar advanced by each event ``counts`` accepts; the final sweep,
    or None when a second Ctrl-C left at once (the hint to resume is printed)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from api import format as fmt
    from api.cli import show

    stop = threading.Event()
    previous = stop_on_ctrl_c(stop, console)
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      TextColumn("{task.fields[last]}"), console=console, transient=False) as progress:
            task = progress.add_task(description, total=max(total, completed), completed=completed, last="")

            def on_progress(event: dict[str, Any]) -> None:
                row = event.get("trial")
                if row is None or not counts(event):
                    return
                what = (f"{show.num_cell(row.tokens_per_s_per_device)} tok/s/dev" if row.status == "completed"
                        else show.trial_status_text(row))
                # a node-lost trial runs once more (api/engine/_lost.py): its re-run advances the bar
                progress.update(task, advance=0 if show.node_lost(row) else 1,
                                last=f"#{row.number} {fmt.layout_text(row.layout)}: {what}")

            final = runner.run_sweep(sweep_id, stop_event=stop, on_progress=on_progress)
            progress.update(task, total=progress.tasks[0].completed)
    except KeyboardInterrupt:
        console.print(f"[yellow]interrupted: {resume_hint(sweep_id)}[/yellow]")
        return None
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    return final
