"""Plan: the analytical answer (valid layouts that fit, fastest predicted first; the best layout per
cluster size and per device type), no device time. One feature folder: ``routes`` (GET/POST
/api/plan, /api/plan/sizes, /api/plan/devices). The dashboard's /plan page is
``api.dashboard.plan_page`` (the dashboard is on top: no feature imports it)."""
