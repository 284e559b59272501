"""The ``meshtune`` command. Each sub-command lives in its own module with ``register(subparsers)``.

User errors (any ``MeshtuneError``/``ValueError`` from our code, and argparse's own: a bad option
value is one line, not the usage block) print one line naming the field and value and exit 2; no
traceback reaches the user, and no secret (the line is masked by api.redact). Output cut short by its
reader (``meshtune plan --json | head``) ends quietly with status 1, as rich's tables do. A command that creates a store says where, in one
line on stderr ("store: sqlite:///... (created)"), and a not-found error names the store it looked in
(api/cli/_console.py); a database URL that cannot work is such a one-line error too (api/settings.py).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from api.cli._console import quiet_ray_token_auth, store_lines
from tuner import MeshtuneError, NotFoundError

# Sub-command modules, in the order ``meshtune --help`` lists them. Add a module here to add a command.
COMMANDS = (
    "api.cli.plan",
    "api.cli.run_trial",
    "api.cli.probe",
    "api.cli.sweep",
    "api.cli.confirm",
    "api.cli.export",
    "api.cli.serve",
    "api.cli.schedule",
    "api.cli.reshard",
    "api.cli.optuna_export",
)

EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 1  # rich's (Console.on_broken_pipe) and the Python docs' recipe's


class Parser(argparse.ArgumentParser):
    """argparse with an error of one line: ``meshtune plan: error: argument --nodes: ...`` (the
    usage block is for ``--help``); sub-commands' parsers are of this class too."""

    def error(self, message: str) -> None:  # type: ignore[override]
        from api.redact import redact_text

        self.exit(EXIT_USAGE, f"{self.prog}: error: {redact_text(message)}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="meshtune", description="Empirical autotuning sweeps for parallelism layouts."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # command not built yet
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from api.redact import redact_text

    parser = build_parser()
    args = parser.parse_args(argv)
    quiet_ray_token_auth()
    with store_lines() as store:
        try:
            return int(args.func(args) or 0)
        except MeshtuneError as exc:
            where = f" (store: {store.opened})" if isinstance(exc, NotFoundError) and store.opened else ""
            print(redact_text(f"meshtune {args.command}: error: {exc}{where}"), file=sys.stderr)
            return EXIT_USAGE
        except KeyboardInterrupt:
            print(f"meshtune {args.command}: interrupted", file=sys.stderr)
            return 130
        except BrokenPipeError:
            # The reader left (`| head`): what is still buffered for it goes nowhere (the Python docs'
            # recipe, "Note on SIGPIPE" in the signal module), so the interpreter's own flush at exit
            # raises nothing either.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_BROKEN_PIPE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
