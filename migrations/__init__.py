"""Alembic migrations of meshtune's store (run through ``meshtune db upgrade`` or ``api.store.upgrade``)."""
