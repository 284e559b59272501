"""The ``meshtune`` command. Each sub-command lives in its own module with ``register(subparsers)``.

User errors (any ``MeshtuneError``/``ValueError`` from our code) print one line naming the field and
value and exit 2; no traceback reaches the user.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from tuner import MeshtuneError

# Sub-command modules, in the order ``meshtune --help`` lists them. Add a module here to add a command.
COMMANDS = (
    "api.cli.plan",
    "api.cli.run_trial",
    "api.cli.sweep",
    "api.cli.serve",
    "api.cli.schedule",
    "api.cli.reshard",
)

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except MeshtuneError as exc:
        print(f"meshtune {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"meshtune {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
