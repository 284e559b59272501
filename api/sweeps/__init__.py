"""Sweeps: submit, follow and cancel layout sweeps, their trials and Pareto front. One feature folder:
``routes`` (thin HTTP), ``schemas`` (response bodies; the request body is ``api.spec.SweepSpec``),
``service`` (what the routes, dashboard, CLI and schedules call). The ranking of a sweep's measured
layouts is its own feature, ``api.ranking``. Its tables and queries are in ``api.store``, the
database layer every feature shares."""
