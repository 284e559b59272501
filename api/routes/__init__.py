"""HTTP routes: thin wrappers over the services (no query is built here)."""
