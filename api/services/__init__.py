"""Services: keyword-only functions the routes, dashboard and CLI call (routes never build queries)."""
