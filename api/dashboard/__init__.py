"""The coordinator's dashboard: server-rendered pages of sweep results (``router``), charts drawn by
plotly.js served from the installed plotly package."""

from api.dashboard.router import router

__all__ = ["router"]
