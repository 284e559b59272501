"""Per-owner access: every write route of the app x every role (admin, member owning the
thing, member not owning it, read-only). The write routes are enumerated from the app's own route
table, so a new mutating route without an entry here (i.e. without a decided role check) fails
``test_every_write_route_is_covered``. No Ray: the one route that would run real work (reshard-check)
is called with an invalid body, which is 422 only once the role check has let the caller through."""

from __future__ import annotations

import html
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api import store
from api.auth import Principal, authenticate
from api.main import create_app
from api.settings import Settings

TOKENS = {"root": "tok-root-91c2", "alice": "tok-alice-4d1e", "bob": "tok-bob-77a0", "viewer": "tok-view-3b5f"}
ROLES = {"root": "admin", "viewer": "read-only"}  # alice and bob are not named: members by default
SPEC = {"model": "tiny", "cluster": "cpu-local", "training": {"global_batch": 16}, "backend": "simulate",
        "search": {"max_trials": 2}}
# Who tries each action on a thing alice owns: the role check's four cases.
CALLERS = ("root", "alice", "bob", "viewer")
EXEMPT = {  # mutating methods that write nothing (each still checked below)
    ("POST", "/login"): "signs in: sets the token cookie, stores nothing",
    ("POST", "/api/plan"): "a read by POST (a body a query string cannot carry): plans, stores nothing",
    ("POST", "/api/plan/devices"): "a read by POST (per-type prices a query string cannot carry): plans, stores nothing",
}


def _auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[name]}"}


@pytest.fixture(scope="module")
def roles_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    db = tmp_path_factory.mktemp("roles") / "roles.db"
    url = f"sqlite:///{db}"
    store.upgrade(url)
    settings = Settings(home=Path(db).parent, database_url=url, api_tokens=TOKENS, api_roles=ROLES, ray_address=None)
    with TestClient(create_app(settings, run_engine=False), raise_server_exceptions=False) as c:
        yield c


def _sweep(roles_client: TestClient) -> int:
    r = roles_client.post("/api/sweeps", json=SPEC, headers=_auth("alice"))
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _schedule(roles_client: TestClient) -> int:
    r = roles_client.post("/api/schedules", json={"name": "nightly", "cron": "0 2 * * *", "template": SPEC},
                    headers=_auth("alice"))
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _write_routes(app) -> set[tuple[str, str]]:  # noqa: ANN001
    def walk(routes):  # noqa: ANN001, ANN202 - FastAPI nests included routers
        for r in routes:
            if hasattr(r, "original_router"):
                yield from walk(r.original_router.routes)
            else:
                yield r
    return {(m, r.path) for r in walk(app.routes) for m in (getattr(r, "methods", None) or ()) if m not in ("GET", "HEAD")}


# Each write route: (make the request for ``caller`` on a fresh thing alice owns) -> response, and
# which callers are allowed. Allowed callers get the route's success code (or 422 for reshard-check,
# see the module docstring); the others get 403 with one line and change nothing.
def _submit(c, who):  # noqa: ANN001, ANN202
    return c.post("/api/sweeps", json=SPEC, headers=_auth(who)), None


def _cancel(c, who):  # noqa: ANN001, ANN202
    sid = _sweep(c)
    return c.post(f"/api/sweeps/{sid}/cancel", headers=_auth(who)), (lambda: c.get(f"/api/sweeps/{sid}").json()["status"], "queued")


def _reshard(c, who):  # noqa: ANN001, ANN202
    sid = _sweep(c)
    return c.post(f"/api/sweeps/{sid}/reshard-check", json={"from_layout": {"tp": 2}, "to_layout": {"dp": 2},
                                                             "steps_before": 0}, headers=_auth(who)), None


def _create_schedule(c, who):  # noqa: ANN001, ANN202
    return c.post("/api/schedules", json={"name": "n", "cron": "0 3 * * *", "template": SPEC}, headers=_auth(who)), None


def _patch_schedule(c, who):  # noqa: ANN001, ANN202
    sid = _schedule(c)
    return (c.patch(f"/api/schedules/{sid}", json={"enabled": False}, headers=_auth(who)),
            (lambda: c.get(f"/api/schedules/{sid}").json()["enabled"], True))


def _delete_schedule(c, who):  # noqa: ANN001, ANN202
    sid = _schedule(c)
    return c.delete(f"/api/schedules/{sid}", headers=_auth(who)), (lambda: c.get(f"/api/schedules/{sid}").status_code, 200)


def _run_now(c, who):  # noqa: ANN001, ANN202
    sid = _schedule(c)
    return (c.post(f"/api/schedules/{sid}/run-now", headers=_auth(who)),
            (lambda: c.get(f"/api/schedules/{sid}/fires").json()["total"], 0))


def _completed(c) -> int:  # noqa: ANN001 - a completed sweep alice owns, with ranked layouts
    from tests.helpers.dashboard_seed import seed_sweep

    return seed_sweep(c.app.state.sessions, n_trials=8, name="done", owner="alice")


def _confirm(c, who):  # noqa: ANN001, ANN202
    sid = _completed(c)
    return (c.post(f"/api/sweeps/{sid}/confirm", json={"top_k": 1, "steps": 2}, headers=_auth(who)),
            (lambda: c.get(f"/api/sweeps/{sid}").json()["status"], "completed"))


def _dashboard_confirm(c, who):  # noqa: ANN001, ANN202
    sid = _completed(c)
    return (c.post(f"/sweeps/{sid}/confirm", data={"top_k": "1", "steps": "2", "token": TOKENS[who]},
                   follow_redirects=False),
            (lambda: c.get(f"/api/sweeps/{sid}").json()["status"], "completed"))


def _dashboard_submit(c, who):  # noqa: ANN001, ANN202
    form = {"name": "d", "model": "tiny", "cluster": "cpu-local", "global_batch": "16", "precision": "fp32",
            "sampler": "random", "max_trials": "2", "backend": "simulate", "token": TOKENS[who]}
    return c.post("/sweeps", data=form, follow_redirects=False), None


ANY_WRITER = {"root", "alice", "bob"}
OWNER_OR_ADMIN = {"root", "alice"}
WRITES = {
    ("POST", "/api/sweeps"): (_submit, ANY_WRITER, 201),
    ("POST", "/api/sweeps/{sweep_id}/cancel"): (_cancel, OWNER_OR_ADMIN, 200),
    ("POST", "/api/sweeps/{sweep_id}/reshard-check"): (_reshard, ANY_WRITER, 422),
    ("POST", "/api/sweeps/{sweep_id}/confirm"): (_confirm, OWNER_OR_ADMIN, 202),
    ("POST", "/sweeps/{sweep_id}/confirm"): (_dashboard_confirm, OWNER_OR_ADMIN, 303),
    ("POST", "/api/schedules"): (_create_schedule, ANY_WRITER, 201),
    ("PATCH", "/api/schedules/{schedule_id}"): (_patch_schedule, OWNER_OR_ADMIN, 200),
    ("DELETE", "/api/schedules/{schedule_id}"): (_delete_schedule, OWNER_OR_ADMIN, 204),
    ("POST", "/api/schedules/{schedule_id}/run-now"): (_run_now, OWNER_OR_ADMIN, 201),
    ("POST", "/sweeps"): (_dashboard_submit, ANY_WRITER, 303),
}


def test_every_write_route_is_covered(roles_client: TestClient) -> None:
    found = _write_routes(roles_client.app)
    assert found, "no write route found: the route walk is broken"
    missing = found - set(WRITES) - set(EXEMPT)
    assert not missing, f"write routes without a role test (add them to WRITES): {sorted(missing)}"
    assert not set(WRITES) - found, f"stale entries: {sorted(set(WRITES) - found)}"


@pytest.mark.parametrize("route", sorted(WRITES), ids=lambda r: f"{r[0]} {r[1]}")
@pytest.mark.parametrize("who", CALLERS)
def test_write_route_by_role(roles_client: TestClient, route: tuple[str, str], who: str) -> None:
    call, allowed, ok = WRITES[route]
    response, unchanged = call(roles_client, who)
    if who in allowed:
        assert response.status_code == ok, (who, response.text)
        return
    assert response.status_code == 403, (who, response.status_code, response.text)
    if not route[1].startswith("/api/"):  # the dashboard's pages, with the error shown
        text = html.unescape(response.text)
    else:
        text = response.json()["detail"]
        assert "\n" not in text
    if who == "viewer":
        assert f"'{who}' is read-only" in text
    else:
        assert "belongs to 'alice'" in text and "'bob'" in text
    if unchanged is not None:  # nothing stored changed
        read, value = unchanged
        assert read() == value


def test_reads_stay_open_to_every_role(roles_client: TestClient) -> None:
    sid = _sweep(roles_client)
    for who in CALLERS:
        assert roles_client.get(f"/api/sweeps/{sid}", headers=_auth(who)).status_code == 200
    assert roles_client.get(f"/api/sweeps/{sid}").status_code == 200  # reads do not require auth here
    for who in CALLERS:  # the exempt POST read is open to read-only tokens too
        r = roles_client.post("/api/plan", json={"model": "tiny", "cluster": "cpu-local", "training": {"global_batch": 16},
                                           "top": 1}, headers=_auth(who))
        assert r.status_code == 200, (who, r.text)
        r = roles_client.post("/api/plan/devices", json={"model": "tiny", "cluster": {"preset": ["cpu-local"]},
                                                   "training": {"global_batch": 16}}, headers=_auth(who))
        assert r.status_code == 200, (who, r.text)


def test_roles_from_settings_and_defaults() -> None:
    # A token list from before roles: every token is a member; auth off: the one user is an admin.
    old = Settings(api_tokens={"ci": "tok-ci"}, database_url="sqlite://")
    who = authenticate("Bearer", "tok-ci", tokens=old.api_tokens, required=True, roles=old.api_roles)
    assert who == Principal("ci", authenticated=True, role="member")
    assert authenticate(None, None, tokens={}, required=True).role == "admin"
    assert authenticate(None, None, tokens=old.api_tokens, required=False).role == "read-only"
    s = Settings(api_roles="root:admin, dash:read-only", database_url="sqlite://")
    assert s.api_roles == {"root": "admin", "dash": "read-only"} and s.role_of("other") == "member"
    with pytest.raises(ValueError, match="^MESHTUNE_API_ROLES='x:boss': role 'boss' of 'x' is not one of admin, member, "
                                         "read-only$"):
        Settings(api_roles="x:boss", database_url="sqlite://")
    with pytest.raises(ValueError, match="^MESHTUNE_API_ROLES='abc': entry 'abc' is not name:value$"):
        Settings(api_roles="abc", database_url="sqlite://")


def test_dashboard_hides_actions_from_a_read_only_token(roles_client: TestClient) -> None:
    _sweep(roles_client)
    roles_client.cookies.set("meshtune_token", TOKENS["viewer"])
    try:
        page = roles_client.get("/").text
        assert 'id="submit"' not in page and 'id="read-only"' in page
        roles_client.cookies.set("meshtune_token", TOKENS["alice"])
        assert 'id="submit"' in roles_client.get("/").text
    finally:
        roles_client.cookies.clear()
