"""The export service: pick a ranked layout of a stored sweep (by rank, or by layout key) and write
it in a framework's configuration (``tuner.export_layout``). Keyword-only; reads only (the ranking
comes from ``api.ranking.service``, which queries the store). Errors: an unknown format, a bad rank
or both selectors SpecError (422 / exit 2), an unknown sweep, rank or layout NotFoundError (404), a
sweep with no completed trial ConflictError (409): one line naming the field and the value."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from api.format import interval_known, layout_text, tied_rows
from api.ranking import service as rankings
from api.ranking.service import RankingRow
from api.ranking.transfer import target_lines
from api.spec import SweepSpec, layout_from_mapping
from api.sweeps import service as sweeps_service
from tuner import ConflictError, Export, NotFoundError, SpecError, check_format, export_layout

CHARSET = "; charset=utf-8"


@dataclass(frozen=True)
class SweepExport:
    sweep_id: int
    rank: int
    layout_key: str
    export: Export

    @property
    def media_type(self) -> str:
        return self.export.media_type + ("" if self.export.media_type.endswith("json") else CHARSET)

    @property
    def filename(self) -> str:
        return f"sweep-{self.sweep_id}-rank-{self.rank}-{self.export.filename}"


def export_sweep(session: Session, *, sweep_id: int, format: str, rank: int | None = None,
                 layout: str | None = None) -> SweepExport:
    """The sweep's layout at ``rank`` (1 = best, the default) or with key ``layout``, in ``format``."""
    check_format(format)
    if rank is not None and layout is not None:
        raise SpecError(f"rank={rank} and layout={layout!r}: give one of them, not both")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        raise SpecError(f"rank must be a positive integer, got {rank!r}")
    sweep = sweeps_service.get_sweep(session, sweep_id=sweep_id)
    rows = rankings.ranking(session, sweep_id=sweep_id).rows
    if not rows:
        raise ConflictError(f"sweep {sweep_id} has no completed trial to export (status {sweep.status})")
    if layout is not None:
        wanted = " ".join(layout.split())  # the short form as `meshtune show` prints it, or a key
        row = next((r for r in rows if wanted in (r.layout_key, layout_text(r.layout, dash=r.layout_key))), None)
        if row is None:
            raise NotFoundError(f"layout={layout!r} is not a measured layout of sweep {sweep_id} "
                                f"(meshtune show {sweep_id} lists the {len(rows)} ranked layouts, by key with --json)")
    else:
        want = rank or 1
        if want > len(rows):
            raise NotFoundError(f"rank={want} is not in sweep {sweep_id}'s ranking (ranks 1..{len(rows)})")
        row = rows[want - 1]
    problem = SweepSpec.model_validate(sweep.spec).to_problem()
    model, cluster, training = problem.model, problem.cluster, problem.training
    measured = (f"rank {row.rank} of {len(rows)}: {row.tokens_per_s_per_device:.6g} tokens/s per device, "
                f"median of {row.n} run(s)" + (" (simulated, not measured)" if row.simulated else ""))
    header = [f"sweep {sweep_id} ({sweep.name}), {measured}", *how_sure(row, rows, sweep_id=sweep_id),
              *target_lines(sweep, row, format=format)]
    if getattr(sweep, "diagnostic", False):
        header.append("diagnostic sweep: trial options injected failures or sleeps")
    out = export_layout(layout_from_mapping(dict(row.layout)), model=model, cluster=cluster, training=training,
                        format=format, header=tuple(header))
    return SweepExport(sweep_id, row.rank, row.layout_key, out)


def how_sure(row: RankingRow, rows: list[RankingRow], *, sweep_id: int) -> list[str]:
    """The header lines that say how far the ranking separates ``row`` from the others: the layouts
    its 95% interval overlaps (tied: measurement cannot order them), or that it was measured once."""
    out = []
    if row.n == 1:
        out.append("measured once: this rank rests on a single run" + (
            "" if interval_known(row) else " and has no interval to compare it by") +
            " (re-measure it, e.g. a sweep with trial.repeats >= 2, before trusting the order)")
    tied = tied_rows(rows, row)
    if tied:
        names = ", ".join(f"#{r.rank} {layout_text(r.layout, dash=r.layout_key)}" for r in tied)
        out.append(f"tied with {len(tied)} other layout{'s' if len(tied) > 1 else ''} (95% intervals overlap, "
                   f"so measurement cannot order them): {names}")
    out.append(f"another ranked layout: meshtune export {sweep_id} --rank N, or --layout KEY|SHORT "
               f"(meshtune show {sweep_id} lists them)")
    return out
