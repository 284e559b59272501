"""Sweeps: submit, follow, rank and cancel layout sweeps. One feature folder: ``routes`` (thin HTTP),
``schemas`` (response bodies; the request body is ``api.spec.SweepSpec``), ``service`` (what the
routes, dashboard, CLI and schedules call), ``ranking`` (the ranked layouts ``service`` re-exports),
``budget`` (time and cost to train a token budget).
Its tables and queries are in ``api.store``, the database layer every feature shares."""
