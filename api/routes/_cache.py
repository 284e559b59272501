"""What the sweep read routes' cached answers (ranking pages, Pareto; kept in api/_lru.py) key on, and ETags.

The ranking is stored and kept in order as results land (api/store/_ranking.py), with a results
version per sweep: an answer (a page, or the whole 2.6 MB ranking of a 10,000-trial sweep) is a pure
function of that version and the sweep's calibration (``api.ranking.service.ranking_tag``), so its
serialised bytes are kept and served while the version is unchanged, and the same version is the
answer's ETag (``If-None-Match`` gets 304). The Pareto answer keys on the sweep row's counters
(``sweep_version``), which each recorded result refreshes in the same transaction (api.engine).
"""

from __future__ import annotations

from typing import Any


def sweep_version(sweep: Any) -> tuple:
    """What changes whenever a trial of the sweep is recorded or its calibration is refitted."""
    calibration = sweep.calibration
    return (
        sweep.created_at, sweep.status, sweep.n_trials, sweep.n_completed, sweep.n_pruned, sweep.n_failed, sweep.device_seconds,
        sweep.best_tokens_per_s_per_device, repr(sorted(calibration.items())) if calibration else None,
    )


def etag_matches(if_none_match: str | None, etag: str) -> bool:
    """RFC 9110 section 13.1.2: ``If-None-Match`` matches when it is ``*`` or lists the entity tag
    (weak comparison: a ``W/`` prefix is ignored)."""
    if not if_none_match:
        return False
    if if_none_match.strip() == "*":
        return True
    return any(tag.strip().removeprefix("W/") == etag for tag in if_none_match.split(","))
