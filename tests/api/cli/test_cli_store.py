"""Where the CLI's store is and what happens when it cannot be used:
one per-user default location whatever the current directory, a line saying where a store was
created, one clear line (exit 2) for a database URL that cannot work, and no Ray token warning."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from api import store
from api.cli import main
from api.settings import Settings

ROOT = Path(__file__).resolve().parents[3]
SPEC = {"name": "where", "model": "tiny", "cluster": "cpu-local", "training": {"global_batch": 16},
        "search": {"max_trials": 2, "remeasure_top_k": 0}, "backend": "simulate"}


@pytest.fixture
def no_home(tmp_path, monkeypatch):
    """No MESHTUNE_HOME nor MESHTUNE_DATABASE_URL; the per-user data dir is under tmp_path."""
    monkeypatch.delenv("MESHTUNE_HOME", raising=False)
    monkeypatch.delenv("MESHTUNE_DATABASE_URL", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    return tmp_path


def test_default_home_is_the_per_user_data_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("MESHTUNE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert Settings().home == tmp_path / "xdg" / "meshtune"
    # Unset, empty or relative XDG_DATA_HOME: ~/.local/share (the XDG Base Directory spec).
    for value in (None, "", "relative/share"):
        if value is None:
            monkeypatch.delenv("XDG_DATA_HOME")
        else:
            monkeypatch.setenv("XDG_DATA_HOME", value)
        assert Settings().home == tmp_path / "user" / ".local" / "share" / "meshtune", value
    monkeypatch.setenv("MESHTUNE_HOME", str(tmp_path / "mine"))
    assert Settings().home == tmp_path / "mine"


def test_an_empty_variable_means_unset(tmp_path, monkeypatch, capsys):
    """MESHTUNE_HOME="" is the default home, not the current directory (the XDG rule: an empty
    variable is unset), and so for every path-like setting: the database URL, RAY_ADDRESS, and the
    Hugging Face cache's XDG_CACHE_HOME."""
    from tuner._hf import hub_cache_dir

    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    for name in ("MESHTUNE_HOME", "MESHTUNE_DATABASE_URL", "RAY_ADDRESS", "XDG_CACHE_HOME", "HF_HOME", "HF_HUB_CACHE"):
        monkeypatch.setenv(name, "")
    monkeypatch.chdir(tmp_path)
    default = tmp_path / "user" / ".local" / "share" / "meshtune"
    settings = Settings()
    assert settings.home == default and settings.ray_address is None
    assert settings.resolved_database_url == f"sqlite:///{default / 'meshtune.db'}"
    assert hub_cache_dir() == tmp_path / "user" / ".cache" / "huggingface" / "hub"
    assert main(["sweeps"]) == 0
    assert f"store: sqlite:///{default / 'meshtune.db'} (created)" in capsys.readouterr().err.splitlines()
    assert not (tmp_path / "meshtune.db").exists()


def test_the_suite_never_uses_the_real_user_data_directory():
    """tests/conftest.py points MESHTUNE_HOME at a temporary directory for the whole run (subprocesses
    inherit it) and drops a configured MESHTUNE_DATABASE_URL."""
    import tempfile

    from api.settings import default_home

    home = Settings().home
    assert home != default_home() and home.is_relative_to(tempfile.gettempdir())
    assert "MESHTUNE_DATABASE_URL" not in os.environ


def test_a_sweep_is_found_from_any_directory_and_its_store_is_named_once(no_home, monkeypatch, capsys):
    spec = no_home / "s.yaml"
    spec.write_text(yaml.safe_dump(SPEC))
    db = no_home / "xdg" / "meshtune" / "meshtune.db"
    (no_home / "a").mkdir()
    (no_home / "b").mkdir()
    monkeypatch.chdir(no_home / "a")
    assert main(["sweep", str(spec)]) == 0
    err = capsys.readouterr().err
    assert f"store: sqlite:///{db} (created)" in err.splitlines()
    monkeypatch.chdir(no_home / "b")
    assert main(["show", "1"]) == 0
    out, err = capsys.readouterr()
    assert "where" in out and "store:" not in err  # the store existed: nothing to announce
    assert main(["show", "2"]) == 2  # not there: the message says where it looked
    assert capsys.readouterr().err.strip() == f"meshtune show: error: sweep 2 does not exist (store: sqlite:///{db})"
    assert not (no_home / "a" / ".meshtune").exists() and not (no_home / "b" / ".meshtune").exists()


def test_an_empty_database_given_by_url_is_named_when_created(no_home, monkeypatch, capsys):
    url = f"sqlite:///{no_home / 'given.db'}"
    monkeypatch.setenv("MESHTUNE_DATABASE_URL", url)
    assert main(["schedule", "list"]) == 0
    assert f"store: {url} (created)" in capsys.readouterr().err.splitlines()
    assert main(["db", "current"]) == 0
    assert "store:" not in capsys.readouterr().err


# Every command that opens the store, and every way a URL cannot work. The value shown is the URL as
# given, password masked; nothing is created on the way.
COMMANDS = [["sweeps"], ["show", "1"], ["sweep", "--resume", "1"], ["db", "current"], ["db", "upgrade"],
            ["db", "downgrade"], ["schedule", "list"], ["serve", "--migrate-only"],
            ["reshard-check", "--sweep", "1", "--from", "dp=4", "--to", "dp=4"], ["export", "1", "--format", "nemo"]]
URLS = {
    "driver": ("mysql://bob:hunter2@127.0.0.1/x", "mysql://bob:***@127.0.0.1/x", "driver"),
    "kind": ("nosuchdb://bob:hunter2@127.0.0.1/x", "nosuchdb://bob:***@127.0.0.1/x", "nosuchdb"),
    "garbage": ("not a url", "not a url", "not a database URL"),
    "dir": ("sqlite:///{tmp}/missing/x.db", "sqlite:///{tmp}/missing/x.db", "{tmp}/missing does not exist"),
}


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:2]))
@pytest.mark.parametrize("case", sorted(URLS))
def test_a_database_url_that_cannot_work_is_one_line_exit_2(no_home, monkeypatch, capsys, command, case):
    url, shown, reason = (s.format(tmp=no_home) for s in URLS[case])
    monkeypatch.setenv("MESHTUNE_DATABASE_URL", url)
    assert main(command) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"meshtune {command[0]}: error: MESHTUNE_DATABASE_URL={shown!r}: ") and reason in err, err
    assert "hunter2" not in err
    assert not (no_home / "missing").exists() and not (no_home / "xdg").exists()


def test_a_missing_driver_is_one_line_from_the_installed_command(tmp_path):
    env = {**os.environ, "MESHTUNE_DATABASE_URL": "mysql://x"}
    proc = subprocess.run([sys.executable, "-m", "api.cli", "sweeps"], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "meshtune sweeps: error: MESHTUNE_DATABASE_URL='mysql://x': the database driver for 'mysql' is not installed "
        "(No module named 'MySQLdb'); meshtune supports sqlite:///PATH and postgresql+psycopg://USER@HOST/DB"]


def test_the_store_itself_refuses_what_cannot_work(tmp_path):
    """Library callers and the Alembic environment (migrations/env.py) go through store.create_engine."""
    for url in ("mysql://bob:hunter2@127.0.0.1/x", f"sqlite:///{tmp_path}/missing/x.db"):
        with pytest.raises(store.StoreUnavailableError) as exc:
            store.upgrade(url)
        assert "hunter2" not in str(exc.value) and "\n" not in str(exc.value)
    assert not (tmp_path / "missing").exists()
    store.upgrade(f"sqlite:///{tmp_path}/here.db")  # an existing directory is fine
    assert store.current_revision(f"sqlite:///{tmp_path}/here.db")


# Ray 2.60's ray.init() enables token authentication for a new local cluster when RAY_AUTH_MODE is
# unset and logs a WARNING saying so, on every command that starts Ray (run-trial, sweep, serve, ...).
PROBE = """
from workers.ray_backend import RayBackend
from tuner import BackendError

class StartsRay:
    def run(self, request):
        backend = RayBackend(num_cpus=1)
        cpus = backend.capacity()  # starts a local Ray the way every trial does
        raise BackendError(f"probe: a local Ray with {cpus} CPU started")

    def close(self):
        import ray
        ray.shutdown()
"""


@pytest.mark.slow
def test_starting_a_local_ray_prints_no_token_auth_warning(tmp_path):
    (tmp_path / "ray_probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]), HOME=str(tmp_path))  # token under tmp
    proc = subprocess.run([sys.executable, "-m", "api.cli", "run-trial", "--layout", "dp=4", "--backend",
                           "ray_probe:StartsRay"], capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    assert "probe: a local Ray with" in proc.stderr, proc.stderr  # Ray did start
    assert "Token authentication" not in proc.stderr, proc.stderr
    assert (tmp_path / ".ray" / "auth_token").exists()  # token auth stays on, as Ray's default has it
