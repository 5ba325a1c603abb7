"""The ``mixprec`` command.

Each subcommand lives in its own module under ``mixprec/commands/`` and exposes three names:
``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``. This file is only the table
that maps a subcommand name to its module, so adding a command never touches another one.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand name -> module implementing it (imported when the parser is built; modules keep their
# heavy imports inside run() so `mixprec --help` stays fast).
COMMANDS: dict[str, str] = {
    "compare": "mixprec.commands.compare",
    "train": "mixprec.commands.train",
    "formats": "mixprec.commands.formats",
    "memory": "mixprec.commands.memory",
    "grads": "mixprec.commands.grads",
    "info": "mixprec.commands.info",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mixprec",
        description="Mixed precision training on PyTorch, and tools that show what happens.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        cmd = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(cmd)
        cmd.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
