"""``meshtune export SWEEP [--rank N | --layout KEY] --format F [--out FILE]``: a ranked layout of a
stored sweep in torchtitan, Megatron-LM, DeepSpeed or Megatron-Bridge (NeMo) configuration, printed
to stdout or written to FILE (api.export.service; bad input is one line, exit 2)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tuner import EXPORT_FORMATS, SpecError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export", help="export a ranked layout to torchtitan, Megatron-LM, DeepSpeed or NeMo",
        description="Write one ranked layout of a stored sweep (default: the best) in a training "
        "framework's configuration, with the mapping's caveats as comments: torchtitan (TOML job "
        "config), megatron (Megatron-LM arguments), deepspeed (JSON config), nemo (Megatron-Bridge "
        "recipe overrides).")
    p.add_argument("sweep", type=int, help="sweep id")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, help="rank in the sweep's ranking (default 1, the best)")
    which.add_argument("--layout", help="layout key instead of a rank (as meshtune show --json lists it)")
    # Checked by the service, not argparse's choices, so the line is the API's one.
    p.add_argument("--format", required=True, help=f"one of {', '.join(EXPORT_FORMATS)}")
    p.add_argument("--out", help="write to this file instead of stdout")
    p.set_defaults(func=export_cmd)


def export_cmd(args: argparse.Namespace) -> int:
    from api.cli.sweep import _sessions
    from api.deps import MAX_ID
    from api.export import service

    if not 1 <= args.sweep <= MAX_ID:
        raise SpecError(f"sweep must be an id in 1..{MAX_ID}, got {args.sweep}")
    if args.rank is not None and args.rank < 1:
        raise SpecError(f"rank must be a positive integer, got {args.rank}")
    _, sessions = _sessions()
    with sessions() as s:
        out = service.export_sweep(s, sweep_id=args.sweep, format=args.format, rank=args.rank, layout=args.layout)
    if args.out:
        try:
            Path(args.out).write_text(out.export.text)
        except OSError as exc:
            raise SpecError(f"out={args.out!r}: {exc.strerror or exc}") from None
        print(f"wrote {args.out} ({out.export.format}, rank {out.rank}: {out.layout_key})", file=sys.stderr)
    else:
        sys.stdout.write(out.export.text)
    return 0
