"""Confirm runs of a sweep's leading layouts: the request, the report, their routes (api/confirm/routes.py)."""
