"""``meshtune export SWEEP [--rank N | --layout KEY|SHORT] --format F [--out FILE] [--caveats FILE]``:
a ranked layout of a stored sweep in torchtitan, Megatron-LM, DeepSpeed or Megatron-Bridge (NeMo)
configuration, or a launch script (api.export.service; bad input is one line, exit 2).

stdout (or ``--out``) gets only what the framework reads, so that it pastes as it is: argument
lists are only the arguments. The header (which layout, how sure the ranking is of it) and the
caveats go to stderr, or to ``--caveats FILE``; the TOML, JSON and scripts carry them too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tuner import EXPORT_FORMATS, SpecError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export", help="export a ranked layout to torchtitan, Megatron-LM, DeepSpeed or NeMo",
        description="Write one ranked layout of a stored sweep (default: the best) in a training "
        "framework's configuration: torchtitan (TOML job config), torchtitan-launch (a torchrun "
        "script), megatron (Megatron-LM pretrain_gpt.py arguments), megatron-launch (a torchrun "
        "script), deepspeed (JSON config with the Hugging Face model config), nemo (Megatron-Bridge "
        "run_recipe.py recipe and overrides). The header and caveats go to stderr (or --caveats FILE).")
    p.add_argument("sweep", type=int, help="sweep id")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, help="rank in the sweep's ranking, as meshtune show numbers it "
                       "(default 1, the best); the header names the layouts tied with it")
    which.add_argument("--layout", metavar="KEY|SHORT", help="a ranked layout by key "
                       "(tp1-cp2-ep1-dp4-pp2-z1-mbs1-ac_none-1f1b) or by the short form meshtune show prints "
                       "(\"cp2 dp4 pp2 z1 1f1b\", quoted)")
    # Checked by the service, not argparse's choices, so the line is the API's one.
    p.add_argument("--format", required=True, help=f"one of {', '.join(EXPORT_FORMATS)}")
    p.add_argument("--out", help="write to this file instead of stdout (a torchtitan flavour module beside it)")
    p.add_argument("--caveats", metavar="FILE", help="write the header and caveats to FILE instead of stderr")
    p.set_defaults(func=export_cmd)


def _write(path: Path, text: str, *, field: str, executable: bool = False) -> None:
    try:
        path.write_text(text)
        if executable:
            path.chmod(path.stat().st_mode | 0o111)
    except OSError as exc:
        raise SpecError(f"{field}={str(path)!r}: {exc.strerror or exc}") from None


def export_cmd(args: argparse.Namespace) -> int:
    from api.cli._store import open_sessions
    from api.deps import MAX_ID
    from api.export import service

    if not 1 <= args.sweep <= MAX_ID:
        raise SpecError(f"sweep must be an id in 1..{MAX_ID}, got {args.sweep}")
    if args.rank is not None and args.rank < 1:
        raise SpecError(f"rank must be a positive integer, got {args.rank}")
    _, sessions = open_sessions()
    with sessions() as s:
        out = service.export_sweep(s, sweep_id=args.sweep, format=args.format, rank=args.rank, layout=args.layout)
    export = out.export
    notes = "".join(f"{line}\n" for line in export.notes)
    if args.caveats:
        _write(Path(args.caveats), notes, field="caveats")
    else:
        sys.stderr.write(notes)
    if args.out:
        target = Path(args.out)
        _write(target, export.text, field="out", executable=export.format.endswith("-launch"))
        for name, text in export.files.items():
            _write(target.parent / name, text, field="out")
        beside = "".join(f" and {target.parent / name}" for name in export.files)
        print(f"wrote {args.out}{beside} ({export.format}, rank {out.rank}: {out.layout_key})", file=sys.stderr)
    else:
        sys.stdout.write(export.text)
        for name in export.files:
            print(f"{args.format} needs {name} beside the job config (its [experimental] custom_import): "
                  f"write both with --out FILE, or use --format torchtitan-launch", file=sys.stderr)
    sys.stdout.flush()
    return 0
