"""A sweep run in the foreground of ``meshtune sweep`` and ``meshtune confirm``: its progress bar,
one line per finished trial, and Ctrl-C as ``api.cli._store.stop_on_ctrl_c`` handles it."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

from api import format as fmt
from api.cli import show
from api.cli._store import resume_hint, stop_on_ctrl_c


def run_in_foreground(runner: Any, sweep_id: int, console: Any, *, description: str, total: int, completed: int = 0,
                      counts: Callable[[dict[str, Any]], bool]) -> Any | None:
    """Run the sweep here under a progress bar advanced by each event ``counts`` accepts; the final sweep,
    or None when a second Ctrl-C left at once (the hint to resume is printed)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

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
