"""Ranking: a sweep's measured layouts ranked by a metric (median, 95% interval, tie groups), each
with its prediction and its time and cost to train. One feature folder: ``routes`` (thin HTTP),
``schemas`` (response bodies), ``service`` (what the routes, dashboard, CLI, exports and schedules
call), ``budget`` (time and cost to train a token budget), ``transfer`` (re-ranked for another
training stack), ``accuracy`` (how well the model predicted the ranked layouts). Its tables and
queries (the stored ranking, kept up to date as results land) are api/store/_ranking.py."""
