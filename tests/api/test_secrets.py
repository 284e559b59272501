"""No error answer and no log line carries a credential: a real ``meshtune serve`` (SQLite, no engine)
is sent a credential-bearing URL in every query parameter and every body field of every operation of
its OpenAPI document, to each branch of the webhook URL's validator and to the schedule's body-level
validator (which echoed the whole body, password and query token included), with a bearer token that
is a URL and through the dashboard's forms; then every error answer and every line the process wrote
is searched. The CLI's and the settings' error lines get the same search (webhook, database URL,
Optuna storage, a token list). Unit tests of the one masking rule (api.redact) come first."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from api import redact
from api.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "tok-secret-9d1e77c3"
PASSWORD, SECRET = "PASSW0RDX", "S3CRETQX"
CRED = f"http://user:{PASSWORD}@10.0.0.1/hook?token={SECRET}"
FORBIDDEN = (PASSWORD, SECRET, TOKEN)
# Each branch of api.schedules.schemas.check_webhook_url, and a valid URL beside a body-level error.
WEBHOOKS = [
    CRED,  # private address: refused unless MESHTUNE_WEBHOOK_ALLOW_PRIVATE
    f"http://user:{PASSWORD}@169.254.169.254/latest?token={SECRET}",  # cloud metadata
    f"http://user:{PASSWORD}@10.0.0.1:99999/hook?token={SECRET}",  # bad port
    f"ftp://user:{PASSWORD}@10.0.0.1/hook?token={SECRET}",  # not http(s)
    f"https://user:{PASSWORD}@93.184.216.34/hook?token={SECRET}" + "x" * 2000,  # too long
    f"https://user:{PASSWORD}@93.184.216.34/services/{SECRET}?token={SECRET}",  # valid (public IP literal)
]


def _clean(text: str) -> bool:
    return not any(s in text for s in FORBIDDEN)


def test_mask_rule() -> None:
    assert redact.mask_url(CRED) == "http://10.0.0.1/…"
    assert redact.mask_url("postgresql+psycopg://u:pw@db:5432/x?password=q") == "postgresql+psycopg://u:***@db:5432/x?…"
    assert redact.mask_url("sqlite:////var/lib/m.db") == "sqlite:////var/lib/m.db"
    assert redact.mask_url("hunter2") == "…"
    text = redact.redact_text(f"at {CRED}, then owner=http%3A%2F%2Fu%3A{PASSWORD}%40h%2F%3Ft%3D{SECRET}&x=1")
    assert _clean(text) and "http://10.0.0.1/…, then" in text and "&x=1" in text
    redact.add_secrets(TOKEN)
    assert redact.redact({"a": [f"Bearer {TOKEN}"], "b": 3}) == {"a": ["Bearer ***"], "b": 3}


def _body_for(document: dict, ref: str) -> dict:
    """Every top-level property of a request body schema set to the credential URL."""
    schema = document["components"]["schemas"][ref.rsplit("/", 1)[-1]]
    return {name: CRED for name in schema.get("properties", {})} or {"x": CRED}


def _requests(document: dict) -> list[tuple[str, str, dict]]:
    """(method, path, httpx kwargs) for every operation: each query parameter the credential URL, and a
    body whose every field is it; path parameters are 1."""
    out = []
    for path, ops in document["paths"].items():
        concrete = re.sub(r"\{[^}]+\}", "1", path)
        for method, op in ops.items():
            query = {p["name"]: CRED for p in op.get("parameters", []) if p["in"] == "query"}
            kwargs: dict = {"params": query} if query else {}
            content = (op.get("requestBody") or {}).get("content", {})
            if "application/json" in content:
                ref = content["application/json"]["schema"].get("$ref")
                kwargs["json"] = _body_for(document, ref) if ref else {"x": CRED}
            out.append((method.upper(), concrete, kwargs))
    return out


def test_no_error_answer_nor_log_line_carries_a_credential(tmp_path: Path) -> None:
    env = {**os.environ, "MESHTUNE_HOME": str(tmp_path), "MESHTUNE_API_TOKENS": f"ci:{TOKEN}",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for k in ("MESHTUNE_DATABASE_URL", "RAY_ADDRESS", "MESHTUNE_WEBHOOK_ALLOW_PRIVATE"):
        env.pop(k, None)
    proc = subprocess.Popen([sys.executable, "-m", "api.cli", "serve", "--port", "0", "--no-engine"], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    started = threading.Event()
    url: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", line)
            if m:
                url.append(m.group(1))
                started.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    answers: list[tuple[str, int, str]] = []
    try:
        assert started.wait(120), "".join(lines[-30:])
        auth = {"Authorization": f"Bearer {TOKEN}"}
        with httpx.Client(base_url=url[0], timeout=30) as http:
            document = http.get("/openapi.json").json()

            def send(method: str, path: str, **kwargs) -> None:
                r = http.request(method, path, **kwargs)
                answers.append((f"{method} {path}", r.status_code, r.text))

            for method, path, kwargs in _requests(document):
                send(method, path, headers=auth, **kwargs)
            for hook in WEBHOOKS:  # the schedule routes' validators, field- and body-level
                for body in ({"name": "n", "cron": "0 2 * * *", "webhook_url": hook},  # neither template nor remeasure
                             {"name": "n", "cron": "bad", "remeasure": {"sweep_id": 1}, "webhook_url": hook}):
                    send("POST", "/api/schedules", headers=auth, json=body)
                send("PATCH", "/api/schedules/1", headers=auth, json={"webhook_url": hook, "cron": "bad"})
            send("POST", "/api/sweeps", headers={"Authorization": f"Bearer {CRED}"}, json={})  # a URL as the token
            send("POST", "/api/sweeps", headers={"Authorization": f"Bearer {TOKEN}x"}, json={})  # near the token
            send("POST", "/login", data={"token": CRED})
            send("POST", "/sweeps", data={"token": TOKEN, "name": CRED, "model": CRED, "extra": f"webhook: {CRED}"})
            send("POST", "/sweeps", data={"token": TOKEN, "extra": f"name: {CRED}\nsearch: {{max_trials: {CRED}}}"})
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        reader.join(10)
    errors = [a for a in answers if a[1] >= 400]
    assert len(errors) >= 40, len(errors)  # every operation answered, most with an error
    assert any(code == 422 and "10.0.0.1/…" in text for _, code, text in errors)  # the masked form is shown
    leaked = [a for a in errors if not _clean(a[2])]
    assert not leaked, leaked[:3]
    log = "".join(lines)
    assert '"POST /api/schedules HTTP/1.1" 422' in log  # the access log is in what was searched
    assert _clean(log), [line for line in lines if not _clean(line)][:5]


def _cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, argv: list[str],
         env: dict[str, str] | None = None) -> str:
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    code = cli_main(argv)
    out = capsys.readouterr()
    for k in env or {}:
        monkeypatch.delenv(k)
    assert code == 2, (argv, out)
    lines = [line for line in out.err.strip().splitlines() if not line.startswith("store: ")]
    assert len(lines) == 1, out.err  # one line, no traceback
    return out.err


def test_no_cli_or_settings_error_line_carries_a_credential(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHTUNE_HOME", str(tmp_path))
    spec = tmp_path / "s.yaml"  # a stored sweep, for optuna-export to reach its storage
    spec.write_text("model: tiny\ncluster: cpu-local\ntraining: {global_batch: 16}\nbackend: simulate\n"
                    "search: {layouts: [{dp: 4}]}\n")
    assert cli_main(["sweep", str(spec)]) == 0
    capsys.readouterr()
    pg = f"postgresql+psycopg://user:{PASSWORD}@127.0.0.1:1/db?password={SECRET}"
    shown = []
    for hook in WEBHOOKS[:5]:
        shown.append(_cli(capsys, monkeypatch, ["schedule", "add", "--name", "n", "--cron", "0 2 * * *",
                                                "--remeasure", "1", "--webhook", hook]))
    shown.append(_cli(capsys, monkeypatch, ["schedule", "add", "--name", "n", "--cron", CRED, "--remeasure", "1"]))
    shown.append(_cli(capsys, monkeypatch, ["sweeps"], {"MESHTUNE_DATABASE_URL": pg}))
    shown.append(_cli(capsys, monkeypatch, ["sweeps"], {"MESHTUNE_DATABASE_URL": f"nosuch://u:{PASSWORD}@h/d?k={SECRET}"}))
    shown.append(_cli(capsys, monkeypatch, ["serve", "--port", "0"], {"MESHTUNE_DATABASE_URL": pg}))
    shown.append(_cli(capsys, monkeypatch, ["optuna-export", "1", "--storage", pg]))
    shown.append(_cli(capsys, monkeypatch, ["optuna-export", "1", "--storage", f"sqlite:////nonexistent/o.db?k={SECRET}"]))
    shown.append(_cli(capsys, monkeypatch, ["sweeps"], {"MESHTUNE_API_TOKENS": f"ci:{TOKEN},{TOKEN}"}))  # no name
    shown.append(_cli(capsys, monkeypatch, ["sweeps"], {"MESHTUNE_API_TOKENS": json.dumps({"ci": TOKEN})[:-1]}))
    shown.append(_cli(capsys, monkeypatch, ["sweeps"], {"MESHTUNE_TRUSTED_PROXIES": CRED}))
    shown.append(_cli(capsys, monkeypatch, ["plan", "--cluster", CRED]))
    leaked = [line for line in shown if not _clean(line)]
    assert not leaked, leaked
    assert "postgresql+psycopg://user:***@127.0.0.1:1/db?…" in "".join(shown)  # the rest of the URL is shown
