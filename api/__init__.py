"""The coordinator: FastAPI routes, services, SQL store, sweep engine, scheduler, dashboard, CLI."""
