"""Launch scripts of an export (tuner/_export.py): bash that runs the layout's world size with
``torchrun`` (one node per ``NODE_RANK``), Megatron-LM's ``pretrain_gpt.py`` with the exported
arguments, or torchtitan's trainer with the exported job config (and flavour module) written beside
the script. Settings a run needs beyond the layout (data, tokenizer, iterations) are environment
variables with smoke-run defaults, and extra arguments are appended.
"""

from __future__ import annotations

import shlex

from tuner._export_job import ExportJob

_EOF = "MESHTUNE_EOF"


def _header(notes: tuple[str, ...], usage: list[str]) -> str:
    lines = ["#!/usr/bin/env bash", *(f"# {n}" for n in notes), "#", *(f"# {u}" for u in usage),
             "set -euo pipefail"]
    return "\n".join(lines) + "\n"


def _torchrun(job: ExportJob) -> str:
    c = job.cluster
    return (f"DISTRIBUTED_ARGS=(--nnodes {c.nodes} --nproc-per-node {c.devices_per_node} "
            '--node-rank "${NODE_RANK:-0}" --master-addr "${MASTER_ADDR:-localhost}" '
            '--master-port "${MASTER_PORT:-29500}")\n')


def _run_on(job: ExportJob) -> str:
    c = job.cluster
    if c.nodes == 1:
        return f"Runs the layout's {job.layout.world_size} ranks on this node."
    return (f"Run it on each of the {c.nodes} nodes ({c.devices_per_node} devices each, world "
            f"{job.layout.world_size}): NODE_RANK=<0..{c.nodes - 1}> MASTER_ADDR=<node 0's address> bash <this file>.")


def megatron_launch(job: ExportJob, *, argv: list[str], notes: tuple[str, ...], env: dict[str, str]) -> str:
    """A bash script running ``pretrain_gpt.py`` of ``$MEGATRON_LM`` with ``argv`` in ``env``."""
    vocab = job.model.vocab
    exports = "".join(f"export {k}=${{{k}:-{v}}}\n" for k, v in env.items())
    usage = [_run_on(job),
             "MEGATRON_LM: the Megatron-LM checkout (default: the current directory).",
             "DATA_ARGS: data and tokenizer (default: mock data and a null tokenizer, a smoke run);",
             "TRAIN_ARGS: iterations and learning rate; arguments given to this script are appended."]
    layout_args = "".join(f"    {' '.join(shlex.quote(w) for w in line)}\n" for line in _pairs(argv))
    return (_header(notes, usage)
            + 'MEGATRON_LM=${MEGATRON_LM:-.}\n' + exports + _torchrun(job)
            + f"LAYOUT_ARGS=(\n{layout_args})\n"
            + f'read -r -a DATA <<< "${{DATA_ARGS:---mock-data --tokenizer-type NullTokenizer --vocab-size {vocab - 1}}}"\n'
            + f'read -r -a TRAIN <<< "${{TRAIN_ARGS:---train-iters 100 --lr {job.training.lr:g}}}"\n'
            + 'exec torchrun "${DISTRIBUTED_ARGS[@]}" "$MEGATRON_LM/pretrain_gpt.py" "${LAYOUT_ARGS[@]}" '
              '"${TRAIN[@]}" "${DATA[@]}" "$@"\n')


def _pairs(argv: list[str]) -> list[list[str]]:
    """``argv`` split into one flag and its value (if any) each."""
    out, i = [], 0
    while i < len(argv):
        take = 2 if i + 1 < len(argv) and not argv[i + 1].startswith("--") else 1
        out.append(argv[i:i + take])
        i += take
    return out


def titan_launch(job: ExportJob, *, toml: str, toml_name: str, files: dict[str, str], notes: tuple[str, ...]) -> str:
    """A bash script writing the job config (and flavour module) into ``$CONFIG_DIR`` and running
    ``torchtitan.train`` on it."""
    usage = [_run_on(job),
             "CONFIG_DIR: where the job config" + (" and the flavour module are" if files else " is")
             + " written (default: beside this script); arguments given to this script are appended."]
    writes = ""
    for name, text in {toml_name: toml, **files}.items():
        assert _EOF not in text
        writes += f'cat > "$CONFIG_DIR/{name}" <<\'{_EOF}\'\n{text}{_EOF}\n'
    path = 'export PYTHONPATH="$CONFIG_DIR${PYTHONPATH:+:$PYTHONPATH}"\n' if files else ""
    return (_header(notes, usage)
            + 'CONFIG_DIR=${CONFIG_DIR:-$(cd "$(dirname "$0")" && pwd)}\n' + writes + _torchrun(job)
            + f'{path}exec torchrun "${{DISTRIBUTED_ARGS[@]}}" -m torchtitan.train '
              f'--job.config_file "$CONFIG_DIR/{toml_name}" "$@"\n')


def shell_lines(argv: list[str]) -> str:
    """``argv`` as shell words, one flag (and its value) a line, no continuations: pasted into a bash
    array (Megatron-LM's own launch scripts list their arguments so) or read by ``eval "A=($(...))"``,
    the words are ``argv`` again."""
    return "".join(" ".join(shlex.quote(w) for w in pair) + "\n" for pair in _pairs(argv))
