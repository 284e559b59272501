"""Text shown to people, in one place for the dashboard (its Jinja filters and view-model) and the CLI
tables, so that the two never disagree: numbers, bytes, durations, layouts, failure causes,
prediction errors, how a layout compares with the best, and device time (real apart from simulated).

Pure functions of plain values; JSON and CSV never go through here (they keep exact numbers and the
full layout key).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from tuner import BEST, NOT_COMPARABLE, SLOWER, TIED, Interval, Layout, versus_best

GiB = 2**30
DASH = "—"
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def _fixed(x: float, digits: int) -> str:
    """``x`` to ``digits`` significant digits in fixed notation with thousands separators: never the
    ``1.04e+03`` that ``format(x, '.3g')`` gives from 1,000 up."""
    if x == 0 or not math.isfinite(x):
        return "0" if x == 0 else str(x)
    magnitude = math.floor(math.log10(abs(x)))
    decimals = max(0, digits - 1 - magnitude)
    rounded = round(x, decimals)
    if rounded and math.floor(math.log10(abs(rounded))) > magnitude:  # 0.9997 -> 1.00, not 1.000
        decimals = max(0, decimals - 1)
    text = f"{x:,.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text  # 68.5, not 68.50


def num(v: float | None, *, dash: str = DASH) -> str:
    """Throughput and other plain quantities: 4 significant digits, whole numbers from 10,000 up."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return dash
    return _fixed(v, 4) if abs(v) < 9999.5 else f"{v:,.0f}"


def pct(v: float | None, *, dash: str = DASH) -> str:
    return dash if v is None else f"{100 * v:.1f}%"


def signed_pct(v: float | None, *, dash: str = DASH) -> str:
    if v is None:
        return dash
    return "0%" if round(100 * v) == 0 else f"{100 * v:+.0f}%"  # not "-0%" for -0.3%


def sci(v: float | None, *, dash: str = DASH) -> str:
    """Differences that may be tiny (max |Δ| of a reshard check, tolerances): 2 significant digits,
    exponent notation where that is what keeps them readable."""
    return dash if v is None else ("0" if v == 0 else f"{v:.2g}")


def bytes_text(n: float | None, *, dash: str = DASH) -> str:
    """Bytes in binary units, 3 significant digits: ``80 GiB``, ``1.02 TiB``, ``512 B``."""
    if n is None:
        return dash
    x = float(n)
    if abs(x) < 1024:
        return f"{int(x)} B"
    for unit in _UNITS[1:]:
        x /= 1024
        text = _fixed(x, 3).replace(",", "")
        if abs(float(text)) < 1024 or unit == _UNITS[-1]:  # 1023.7 would read 1024: the next unit
            return f"{text} {unit}"
    raise AssertionError("unreachable: the loop returns at the last unit")


def gib_text(gib: float | None, *, dash: str = DASH) -> str:
    """A size the dashboard holds in GiB (peak memory, capacity), shown as ``bytes_text`` shows it."""
    return dash if gib is None else bytes_text(gib * GiB, dash=dash)


def duration(seconds: float | None, *, dash: str = DASH) -> str:
    """``3725`` -> ``1 h 02 min``; ``42.5`` -> ``42.5 s``; ``0.25`` -> ``250 ms``."""
    if seconds is None:
        return dash
    if seconds > 0 and float(_fixed(seconds * 1000, 3).replace(",", "")) < 1000:
        return f"{_fixed(seconds * 1000, 3)} ms"
    if seconds < 59.95:
        return f"{_fixed(seconds, 3)} s"
    minutes, sec = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {sec:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours:,} h {minutes:02d} min"


def when(v: Any, *, dash: str = DASH) -> str:
    if not isinstance(v, datetime):
        return dash
    if v.tzinfo is None:  # SQLite returns naive UTC
        v = v.replace(tzinfo=timezone.utc)
    return v.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


# --- layouts ---------------------------------------------------------------------------------------

def layout_text(layout: Layout | Mapping[str, Any] | None, *, dash: str = DASH) -> str:
    """A layout's display form (``Layout.short``: ``dp4 z1 mbs2``); the full key stays in JSON/CSV."""
    if layout is None:
        return dash
    if not isinstance(layout, Layout):
        try:
            layout = Layout(**layout)
        except (TypeError, ValueError):  # a row stored by an older version: show what it holds
            return " ".join(f"{k}={v}" for k, v in layout.items())
    return layout.short


_KEY = re.compile(
    r"tp(?P<tp>\d+)-cp(?P<cp>\d+)-ep(?P<ep>\d+)-dp(?P<dp>\d+)-pp(?P<pp>\d+)-z(?P<zero>\d)-mbs(?P<mbs>\d+)"
    r"-ac_(?P<ac>\w+?)(?P<sp>-sp)?-(?P<sched>.+)$"
)


def layout_from_key(key: str | None) -> dict[str, Any] | None:
    """Invert ``Layout.key`` (None for anything else), for pages that hold only a key."""
    m = _KEY.match(key or "")
    if not m:
        return None
    d: dict[str, Any] = {k: int(m[k]) for k in ("tp", "cp", "ep", "dp", "pp", "zero", "mbs")}
    d.update(ac=m["ac"], sp=bool(m["sp"]), schedule="1f1b", vpp=1)
    sched = m["sched"]
    if sched.startswith("interleavedv"):
        d.update(schedule="interleaved", vpp=int(sched.removeprefix("interleavedv")))
    elif sched != "nopp":
        d["schedule"] = sched
    return d


def key_text(key: str | None, *, dash: str = DASH) -> str:
    """A layout key's display form (``tp1-cp1-ep1-dp4-pp1-z1-mbs2-ac_none-nopp`` -> ``dp4 z1 mbs2``);
    a string that is not a layout key is shown as it is."""
    if not key:
        return dash
    layout = layout_from_key(key)
    return key if layout is None else layout_text(layout)


def layout_fields(layout: Mapping[str, Any]) -> list[tuple[str, str]]:
    """A layout's fields for a detail list: booleans as yes/no, and no schedule where there is no
    pipeline (pp = 1 runs none) nor vpp outside the interleaved schedule."""
    out = []
    for name, value in layout.items():
        if name == "schedule" and layout.get("pp", 1) == 1:
            continue
        if name == "vpp" and layout.get("schedule") != "interleaved":
            continue
        out.append((name, ("yes" if value else "no") if isinstance(value, bool) else str(value)))
    return out


def value_text(value: Any, *, dash: str = DASH) -> str:
    """A stored value (environment entries, error fields) for a detail list: never a Python repr —
    lists joined by commas, mappings as ``key=value``, booleans yes/no, None as a dash."""
    if value is None:
        return dash
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple, set)):
        return ", ".join(value_text(v, dash=dash) for v in value) or dash
    if isinstance(value, Mapping):
        return ", ".join(f"{k}={value_text(v, dash=dash)}" for k, v in value.items()) or dash
    return str(value)


def cluster_label(cluster: Any) -> str:
    """``h100-sxm (8×8 cuda)`` from a ClusterSpec."""
    return f"{cluster.name} ({cluster.nodes}×{cluster.devices_per_node} {cluster.device_kind})"


# Causes are stored as the engine and the workers wrote them, exact numbers included (they are read
# by programs too); shown, a byte count is put in binary units.
_BYTES = re.compile(r"\b(\d{4,}) bytes\b")
_BYTES_FIELD = re.compile(r"\b(\w*(?:memory|bytes)\w*)=(\d{4,})\b")


def cause_text(cause: str | None, *, dash: str = "") -> str:
    """A failure or prune cause with its byte counts readable:
    ``predicted 92341000000 bytes per device exceeds device_memory=85899345920`` ->
    ``predicted 86.0 GiB per device exceeds device_memory=80.0 GiB``."""
    if not cause:
        return dash
    text = _BYTES.sub(lambda m: bytes_text(int(m[1])), cause)
    return _BYTES_FIELD.sub(lambda m: f"{m[1]}={bytes_text(int(m[2]))}", text)


# --- prediction errors -----------------------------------------------------------------------------

# (predicted - measured) / measured is judged by its size, whatever its sign: -97% is as wrong as
# +97%. Within 15% the model ranks layouts usefully; past 50% it is off by more than the whole
# spread between layouts of one model (1.5-2x, tuner/_stats.py), i.e. no guide at all.
ERROR_BANDS = ((0.15, "good"), (0.5, "fair"), (math.inf, "poor"))
BAND_STYLES = {"good": "green", "fair": "yellow", "poor": "red"}  # rich styles, for the CLI


def error_band(error: float | None) -> str | None:
    """"good", "fair" or "poor" by |error| (None when there is no prediction to judge)."""
    if error is None or not math.isfinite(error):
        return None
    return next(band for limit, band in ERROR_BANDS if abs(error) <= limit)


def error_class(error: float | None) -> str:
    """The dashboard's CSS class for a prediction error (dashboard.css: err-good/-fair/-poor)."""
    band = error_band(error)
    return f"err-{band}" if band else ""


def error_markup(error: float | None, *, dash: str = "-") -> str:
    """A signed percentage coloured by its band, as rich markup for the CLI tables."""
    band = error_band(error)
    return dash if band is None else f"[{BAND_STYLES[band]}]{signed_pct(error)}[/]"


# --- comparison with the best (tuner._stats.versus_best) ----------------------------------------

VERSUS_TEXT = {
    BEST: "best",
    TIED: "tied with best",
    SLOWER: "slower than best",
    NOT_COMPARABLE: "measured once — not comparable",
}
VERSUS_LEGEND = (
    "tied with best: its 95% interval overlaps the best one's, so measurement cannot separate them; "
    "slower than best: the two intervals are apart; measured once — not comparable: a single run has no "
    "interval, so it is neither tied with the best nor shown to be slower (re-measure it to compare)"
)


def versus_rows(rows: Sequence[Any]) -> list[str]:
    """``tuner._stats.versus_best`` of every ranking row (objects with n, median, low, high; the
    ranking's order, best first): one rule for the dashboard's and the CLI's "vs best" column."""
    if not rows:
        return []
    best = _interval(rows[0])
    return [versus_best(_interval(r), best, is_best=i == 0) for i, r in enumerate(rows)]


def tied_rows(rows: Sequence[Any], row: Any) -> list[Any]:
    """The other ranking rows whose 95% interval overlaps ``row``'s: measurement cannot separate them
    from it (none when ``row`` was measured once: it has no interval to compare)."""
    mine = _interval(row)
    return [r for r in rows if r is not row and mine.known and _interval(r).known and _interval(r).overlaps(mine)]


def interval_known(row: Any) -> bool:
    return row.low is not None and row.high is not None


def _interval(row: Any) -> Interval:
    return Interval(row.n, row.median, row.low, row.high)


def versus_text(verdict: str, *, row_known: bool = False, best_known: bool = True) -> str:
    """The words for ``tuner._stats.versus_best``'s verdict. Not comparable because the row has no
    interval: "measured once"; because only the best has none: said so."""
    if verdict == NOT_COMPARABLE and row_known and not best_known:
        return "not comparable — the best was measured once"
    return VERSUS_TEXT[verdict]


def tied_sentence(n_tied: int, *, best_known: bool = True) -> str:
    """How many layouts, the best itself not counted, are tied with the best."""
    if not best_known:
        return "The best layout was measured once: no other layout can be compared with it yet."
    if n_tied == 0:
        return "No other layout is tied with the best."
    return f"{n_tied} other layout{'' if n_tied == 1 else 's'} {'is' if n_tied == 1 else 'are'} tied with the best."


# --- device time -----------------------------------------------------------------------------------

def device_time(real_s: float, simulated_s: float) -> dict[str, str]:
    """Device time with simulated seconds never passed off as real: the simulate backend reports the
    device time its modelled run *would* take, which no device spent. ``value``/``label`` are the
    headline (real time if any was spent), ``simulated`` the simulated part ("" when none)."""
    simulated = f"{duration(simulated_s)} simulated" if simulated_s else ""
    if real_s or not simulated_s:
        return {"value": duration(real_s), "label": "device time", "simulated": simulated}
    return {"value": duration(simulated_s), "label": "simulated device time (no real device used)", "simulated": ""}


# --- budget: time and cost of training, and of the search ---------------------------------------

def money(v: float | None, *, dash: str = DASH) -> str:
    """An amount in the price's own currency (meshtune never assumes one): ``12.34``, ``1,234,567``;
    below one cent, 3 significant digits (``0.00123``)."""
    if v is None or not math.isfinite(v):
        return dash
    if v and abs(v) < 0.01:
        return _fixed(v, 3)
    return f"{v:,.2f}" if abs(v) < 1000 else f"{v:,.0f}"


def train_time(seconds: float | None, *, dash: str = DASH) -> str:
    """Time to train: ``duration`` up to two days, then days (``41.3 days``), then years."""
    if seconds is None or not math.isfinite(seconds):
        return dash
    days = seconds / 86400
    if days < 2:
        return duration(seconds)
    return f"{_fixed(days, 3)} days" if days < 730 else f"{_fixed(days / 365.25, 3)} years"


def tokens_text(n: float | None, *, dash: str = DASH) -> str:
    """A token count: ``15T``, ``2.1B``, ``4.19M``."""
    if n is None:
        return dash
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{_fixed(n / size, 3)}{unit}"
    return f"{n:,.0f}"


def budget_cells(budget: Mapping[str, Any] | Any | None, *, simulated: bool = False,
                 dash: str = DASH) -> dict[str, str]:
    """A layout's time and cost to train the token budget (``tuner.TrainingBudget`` or its dict)
    as table cells; from simulated throughput they say so."""
    if budget is None:
        return {"time": dash, "cost": dash, "per_mtok": dash}
    b = budget if isinstance(budget, Mapping) else budget.to_dict()
    tag = " (simulated)" if simulated else ""
    cpt = b.get("cost_per_token")
    cells = {"time": train_time(b.get("time_to_train_s"), dash=dash), "cost": money(b.get("cost"), dash=dash),
             "per_mtok": money(None if cpt is None else cpt * 1e6, dash=dash)}
    return {k: v + tag if v != dash else v for k, v in cells.items()}


def search_spent(device_seconds: float, *, price_per_device_hour: float | None, simulated: bool) -> str:
    """What a sweep's search spent, in device-hours and (priced) money; simulate-backend seconds are
    time the modelled runs would take, which no device spent, and are said to be."""
    hours = device_seconds / 3600
    cost = "" if price_per_device_hour is None else f", cost {money(hours * price_per_device_hour)}"
    text = f"{_fixed(hours, 3) if hours else '0'} device-hours{cost}"
    return f"simulated {text} (no real device time)" if simulated else text


def jinja_filters() -> dict[str, Any]:
    """The dashboard templates' filters (api/dashboard/router.py registers them)."""
    return {
        "num": num, "pct": pct, "signed_pct": signed_pct, "sci": sci, "gib": gib_text, "bytes": bytes_text,
        "seconds": duration, "duration": duration, "when": when, "errclass": error_class,
        "layout_label": layout_text, "key_label": key_text, "cause": cause_text, "layout_fields": layout_fields,
        "value": value_text, "money": money, "train_time": train_time, "tokens": tokens_text,
    }
