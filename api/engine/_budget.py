"""When a sweep's search stops and what it re-measures (``SearchBudget``, one of the loop's collaborators).

Budgets: ``max_trials`` counts search trial numbers (pruned ones included); ``max_device_seconds``
stops new trials once the recorded trials have held devices that long; ``patience`` stops after k
trials that ran (not pruned) in number order without beating the best measured tokens/s per device.
Then re-measurement tops contenders up adaptively (``remeasure_plan``). Why the search stopped is
one line (``search_stop``), stored as the sweep's ``stop_reason`` when it ends; a proposer with
nothing more to propose while unseen layouts remain is never a silent end (``exhausted_reason``).
"""

from __future__ import annotations

from api import store
from api.engine._context import LoopContext
from tuner import Layout, rank


class SearchBudget:
    """Reads the context's rows, spent device-seconds, seen layouts, spec and model; the loop tells it
    when the proposer has nothing more (``note_exhausted``)."""

    def __init__(self, ctx: LoopContext) -> None:
        self.ctx = ctx
        self.exhausted = False  # the proposer had nothing more to propose

    def note_exhausted(self) -> None:
        self.exhausted = True

    def _search_rows(self) -> list[store.Trial]:
        # A trial lost with its node does not count (its layout is re-queued: api/engine/_lost.py).
        return [t for t in self.ctx.trials() if t.phase == "search" and (t.error or {}).get("infra") != "node_lost"]

    def over_device_budget(self) -> bool:
        limit = self.ctx.search.max_device_seconds
        return limit is not None and self.ctx.spent >= limit

    def search_done(self) -> bool:
        return self.search_stop(explain=False) is not None

    def search_stop(self, *, explain: bool = True) -> str | None:
        """Why the search stops now (one line, the sweep's ``stop_reason``); None while it goes on.
        ``explain=False``: a proposer with nothing more is not explained yet (its reason is read once
        the trials in flight are recorded: ``exhausted_reason``)."""
        search, problem = self.ctx.search, self.ctx.problem
        rows = self._search_rows()
        if self.over_device_budget():
            what = "simulated device-seconds" if self.ctx.spec.backend == "simulate" else "device-seconds"
            return (f"device budget spent: {self.ctx.spent:,.0f} of max_device_seconds="
                    f"{search.max_device_seconds:g} {what}")
        if problem.listed:  # every listed layout once, whatever max_trials and patience say
            if len(rows) >= len(problem.space):
                return f"every listed layout was tried ({len(problem.space):,} in search.layouts)"
            return self._why_exhausted(explain)
        if len(rows) >= search.max_trials:
            return f"reached max_trials={search.max_trials}"
        if search.patience is not None:
            ran = sorted((t for t in rows if t.status not in ("pruned", "running")), key=lambda t: t.number)
            best, since = None, 0
            for t in ran:
                v = t.tokens_per_s_per_device if t.status == "completed" else None
                if v is not None and (best is None or v > best):
                    best, since = v, 0
                else:
                    since += 1
            if since >= search.patience:
                k = search.patience
                return f"patience={k}: {k} trials without beating the best" + (
                    f" ({best:,.0f} tokens/s per device)" if best is not None else " (none measured)")
        return self._why_exhausted(explain)

    def _why_exhausted(self, explain: bool) -> str | None:
        if not self.exhausted:
            return None
        return self.exhausted_reason() if explain else "exhausted"

    def exhausted_reason(self) -> str:
        """The proposer returned nothing: every layout was proposed, or say what keeps the unseen ones
        out (the memory model predicting that none of them fits, or the sampler itself)."""
        problem = self.ctx.problem
        space = problem.space
        unseen = [lay for lay in space.layouts if lay.key not in self.ctx.seen]
        rows = self._search_rows()
        if not unseen:
            pruned = sum(t.status == "pruned" for t in rows)
            what = "listed layout (search.layouts)" if problem.listed else "layout of the space"
            return (f"every {what} was tried ({len(space):,}: {len(space) - pruned:,} ran, {pruned:,} pruned by "
                    "the memory model)")
        fits = sum(bool(problem.predict(lay).fits) for lay in unseen)
        if not fits:
            ooms = sum(t.status == "oom" for t in rows)
            peaks = sum(t.status == "completed" and bool(t.peak_memory_bytes) for t in rows)
            learned = getattr(problem, "learned_from", None)
            inherited = (f", inherited from sweep{'s' if len(learned) > 1 else ''} "
                         + ", ".join(f"#{i}" for i in learned)) if learned else ""
            return (f"the memory model predicts none of the {len(unseen):,} unseen layouts fits (learned from "
                    f"{peaks} measured peaks and {ooms} OOMs{inherited})")
        return (f"the {self.ctx.search.sampler} sampler proposed nothing more while {len(unseen):,} unseen layouts "
                f"remain ({fits:,} of them predicted to fit)")

    def remeasure_plan(self) -> list[tuple[Layout, int]]:
        """The next round of re-measurements, adaptive: rank every completed measurement (search and
        re-measurement, the host's noise pooled over all repeats: tuner._stats.rank); stop once the
        best is separated from the runner-up (intervals apart, and the best measured at least twice),
        else measure once more the best and every contender among the top ``remeasure_top_k`` whose
        interval overlaps the best's and that has fewer than ``repeats`` measurements. The budget:
        ``repeats`` per layout, ``remeasure_top_k x (repeats - 1)`` re-measurements in all (what the
        sweep announces), ``max_device_seconds``. A deterministic function of the recorded
        measurements, so a resume continues the same plan; repeat numbers count earlier re-measurement
        attempts, so none is repeated. ``search.layouts``: every listed layout to ``repeats``."""
        problem = self.ctx.problem
        k, repeats = self.ctx.search.remeasure_top_k, self.ctx.search.repeats
        rows = [t for t in self.ctx.trials() if t.phase != "confirm"]  # longer runs: not short-run repeats
        if problem.listed:
            k = len(problem.space)
        if k <= 0 or repeats <= 1:
            return []
        measured: dict[str, list[float]] = {}
        done: dict[str, set[int]] = {}
        for t in rows:
            if t.status == "completed" and t.tokens_per_s_per_device is not None:
                measured.setdefault(t.layout_key, []).append(t.tokens_per_s_per_device)
            if t.phase == "remeasure":
                done.setdefault(t.layout_key, set()).add(t.repeat)
        searched = {t.layout_key for t in rows if t.phase == "search" and t.status == "completed"}
        ranked = rank({key: v for key, v in measured.items() if key in searched})
        if not ranked:
            return []
        if problem.listed:
            contenders = ranked[:k]
        else:
            best = ranked[0]  # separated from the runner-up of the whole ranking, not only of the top k
            if best.interval.n >= 2 and (len(ranked) < 2 or (best.interval.known
                                                             and not best.interval.overlaps(ranked[1].interval))):
                return []
            contenders = [r for r in ranked[:k] if r.rank == 1 or r.interval.overlaps(best.interval)]
        plan = []
        for r in contenders:
            free = [rep for rep in range(1, repeats) if rep not in done.get(r.key, set())]
            if free:
                layout = problem.space.layouts[problem.space.index[r.key]]
                plan += [(layout, rep) for rep in (free if problem.listed else free[:1])]
        # No more than the sweep announced (k x (repeats - 1): "N searched + M re-measurements of the
        # top k"): a layout that becomes a contender once those are spent stays measured as it is.
        spent = sum(len(reps) for reps in done.values())
        return plan[:max(0, k * (repeats - 1) - spent)]
