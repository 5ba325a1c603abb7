"""The ``mixprec`` command.

Each subcommand lives in its own module under ``mixprec/commands/`` and exposes three names:
``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``, and may define
``unrecognized_hint(extras, own_args) -> str | None`` to explain arguments its parser did not take
(``own_args``: what followed the command's name), and ``INTERMIXED = True`` to take its positionals on
both sides of its options. This file is the
table that maps a subcommand name to its module, so adding a command never touches another one, and the
guard that prints a user's mistake as ``mixprec: error: ...`` (exit status 2, argparse's convention)
instead of a traceback. A real bug -- any other exception -- still shows its traceback.
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
        cmd.set_defaults(_run=module.run, _parser=cmd)
    return parser


USAGE_ERROR = 2  # argparse's exit status for a bad command line; ours for any mistake the user can fix
INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """parse_args, with the command's own hint when arguments are left over (e.g. a negative VALUE).

    A command whose module sets ``INTERMIXED = True`` takes its positionals on either side of its options
    (``mixprec formats 1 -d fp16 2``): argparse reads a ``nargs="*"`` positional once, and left the
    second run over. Its parser reads them again intermixed (not the top parser: argparse cannot intermix
    with subcommands), only then, since intermixing drops what follows a leading ``--``."""
    args, extras = parser.parse_known_args(argv)
    module = importlib.import_module(COMMANDS[args.command])
    given = list(sys.argv[1:] if argv is None else argv)
    own = given[given.index(args.command) + 1:]  # the command's own arguments
    if extras and getattr(module, "INTERMIXED", False):
        command = args.command
        args, extras = args._parser.parse_known_intermixed_args(own)
        args.command = command
    if extras:
        hint_of = getattr(module, "unrecognized_hint", None)
        hint = hint_of(extras, own) if hint_of is not None else None
        parser.error(f"unrecognized arguments: {' '.join(extras)}" + (f"\n  - fix: {hint}" if hint else ""))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    from mixprec.errors import MixprecError

    args = _parse(build_parser(), argv)
    try:
        return int(args._run(args) or 0)
    except MixprecError as err:  # raised on purpose for a user's mistake: its message says what to do
        print(f"mixprec: error: {err}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        print("mixprec: interrupted", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
