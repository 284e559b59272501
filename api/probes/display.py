"""A probe's figures as text, one row each: datasheet, probed, ratio, which one the models use
(``meshtune probe --show``, ``meshtune plan`` and the dashboard's panel read the same rows)."""

from __future__ import annotations

from typing import Any

from api import format as fmt
from tuner import FigureRow, figure_rows


def value(v: float | None, unit: str, *, dash: str = fmt.DASH) -> str:
    """A figure in its unit: FLOP/s and B/s in SI multiples, seconds as durations (µs too), bytes in
    binary units, shares as percentages."""
    if v is None:
        return dash
    if unit == "s":
        return f"{fmt._fixed(v * 1e6, 3)} µs" if 0 < v < 1e-3 else fmt.duration(v)
    if unit == "B":
        return fmt.bytes_text(v)
    if unit in ("FLOP/s", "B/s"):
        for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
            if abs(v) >= scale:
                return f"{fmt._fixed(v / scale, 3)} {prefix}{unit}"
        return f"{fmt._fixed(v, 3)} {unit}"
    if unit == "x":
        return f"{fmt._fixed(v, 3)}x"
    return fmt.pct(v)


def ratio(row: FigureRow) -> str:
    r = row.ratio
    return fmt.DASH if r is None else f"{fmt._fixed(r, 3)}x"


def rows(cluster: Any, figures: Any) -> list[dict[str, str]]:
    """Each figure as display cells."""
    return [{"name": r.name, "datasheet": value(r.datasheet, r.unit), "probed": value(r.probed, r.unit),
             "ratio": ratio(r), "used": r.source, "note": r.note} for r in figure_rows(cluster, figures)]
