"""The bounds of every paged list (API routes, their services, the CLI's ``--limit``/``--offset``):
one definition, checked before any query, so a page beyond them is a 422 / exit 2 naming the
parameter on every database, never a 500.

``offset`` is 0 .. ``MAX_OFFSET`` = 2^31 - 1: no table holds more rows than its 32-bit ids count, so
a larger offset could only ever give an empty page. ``limit`` is 1 .. ``MAX_PAGE`` rows (a ranking
page: 1 .. ``MAX_RANKING_PAGE``; the whole ranking when left out). A store query never adds the two
(PostgreSQL's INTEGER would overflow past 2^31 - 1): a page is ``OFFSET``/``LIMIT``, or for the stored
ranking the rows ranked above ``offset`` taken ``limit`` at a time.
"""

from __future__ import annotations

from tuner import SpecError

MAX_ID = 2**31 - 1  # every stored id is a 32-bit signed INTEGER on PostgreSQL
MAX_OFFSET = MAX_ID
MAX_PAGE = 1000
MAX_RANKING_PAGE = 1_000_000


def check_page(limit: int | None, offset: int, *, max_limit: int = MAX_PAGE, optional: bool = False) -> None:
    """SpecError naming ``limit`` or ``offset`` unless both are in bounds (``optional``: a limit may be None)."""
    if not (optional and limit is None) and (
            isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= max_limit):
        raise SpecError(f"limit must be an integer between 1 and {max_limit}, got {limit!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= MAX_OFFSET:
        raise SpecError(f"offset must be an integer between 0 and {MAX_OFFSET}, got {offset!r}")
