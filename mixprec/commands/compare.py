"""``mixprec compare``: the mixed precision ladder (:mod:`mixprec.ladder`) on one model, data set and seed.

fp32 | fp16 naive | + fp32 master weights | + static loss scaling | + dynamic loss scaling (O2) |
O1 cast policy | pure bf16 | + stochastic rounding | + Kahan | 16+16 split | bf16 + fp32 masters: one table
(with each rung's measured difference to the rung it builds on, and notes from measurement) and one PNG of
every rung's loss curve. Writes compare.csv, compare.json (with every per-step loss), compare.md and
compare.png under ``--out``; the full demo also runs the small-gradient experiment
(:data:`mixprec.ladder.EXPERIMENTS`, where loss scaling matters) into underflow.*. With ``--report DIR``
also one page (:mod:`mixprec.report`): report.md and a self-contained report.html with the tables, loss
curves, memory bars and gradient histograms.

The defaults are the demo: the 784-8192-10 MLP on the bundled digits resized to 28x28, plain SGD at lr
0.01, 6 epochs. Plain SGD makes the update exactly lr * gradient, so the half precision resolution effect
is not blurred by momentum or Adam's normalisation (and the table can check it against the theory).
"""

from __future__ import annotations

import argparse
import functools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mixprec.commands.console import make_console
from mixprec.commands.train import (
    DataSpec,
    UsageError,
    add_data_arguments,
    build_model,
    check_out,
    data_spec,
    fail,
)

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from mixprec.ladder import CompareSettings, Experiment, RungResult

HELP = "Train one model on the mixed precision ladder (fp32 ... fp16 naive ... O2, O1, bf16) and compare."

# Output that is not a terminal (pipes, files, CI logs) gets this width, so the table is not squeezed.
PLAIN_WIDTH = 160

# The argparse defaults are CompareSettings' defaults and these are ladder.RUNGS' and ladder.PURE_BF16's
# keys, DEMO_KEYS ladder.DEMO_RUNGS (tests check them), repeated here so that `mixprec --help` needs no torch.
RUNG_KEYS = ("fp32", "fp16-naive", "fp16-master", "fp16-static", "fp16-dynamic", "o1", "bf16")
PURE_BF16_KEYS = ("pure-bf16", "pure-bf16+stochastic", "pure-bf16+kahan", "pure-bf16+split")
DEMO_KEYS = (*RUNG_KEYS[:-1], *PURE_BF16_KEYS, "bf16")


def _rungs_arg(text: str) -> list[str]:
    typed = [k.strip() for k in text.split(",") if k.strip()]
    keys = [k.lower() for k in typed]  # O1 as o1: train spells it O1
    unknown = [t for t in typed if t.lower() not in DEMO_KEYS]  # as typed, for the message
    if not keys:
        raise argparse.ArgumentTypeError(f"{text!r} names no rung; choose from {','.join(DEMO_KEYS)}")
    if unknown:
        plural = "s" if len(unknown) > 1 else ""
        raise argparse.ArgumentTypeError(f"unknown rung{plural} {', '.join(unknown)}; "
                                         f"choose from {','.join(DEMO_KEYS)}")
    return keys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_data_arguments(parser, "mlp", "image side in pixels (default: mlp 28, vgg16 32, else the data's own)")
    parser.add_argument("--epochs", type=int, default=6, metavar="N",
                        help="epochs per rung (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=0.01, metavar="X",
                        help="SGD learning rate, constant (default: %(default)s)")
    parser.add_argument("--momentum", type=float, default=0.0,
                        help="SGD momentum (default 0: the update is lr*grad)")
    parser.add_argument("--rungs", type=_rungs_arg, default=None, metavar="KEYS",
                        help=f"comma-separated subset of {','.join(DEMO_KEYS)} (default: all)")
    parser.add_argument("--underflow", action=argparse.BooleanOptionalAction, default=None,
                        help="also run the small-gradient experiment (loss x 2^-16, lr x 2^16), where loss "
                             "scaling matters, into underflow.*, with its own rungs (--rungs does not "
                             "choose them; default: with the full demo, not with --rungs)")
    parser.add_argument("--out", type=Path, default=Path("runs/compare"), metavar="DIR",
                        help="where compare.{csv,json,md,png} go (default: runs/compare)")
    parser.add_argument("--report", type=Path, default=None, metavar="DIR",
                        help="also write one page, DIR/report.md and a self-contained DIR/report.html: the "
                             "table, loss curves, memory per precision and the gradient histogram")


def settings_from(args: argparse.Namespace, spec: DataSpec) -> CompareSettings:
    from mixprec.ladder import CompareSettings

    return CompareSettings(
        model=args.model, data=args.data, size=spec.size, epochs=args.epochs, lr=args.lr,
        momentum=args.momentum, batch_size=spec.batch_size, seed=spec.seed,
    )


def run(args: argparse.Namespace) -> int:

    from mixprec import ladder
    from mixprec.errors import MixprecError
    from mixprec.ladder_output import notes_for, write_outputs

    console = make_console()
    if not console.is_terminal:
        console.width = PLAIN_WIDTH
    start = time.perf_counter()
    try:
        spec = data_spec(args)
        settings = settings_from(args, spec)
        # Checked before the ladder trains: a folder that cannot be written lost the whole run.
        check_out(args.out, "--out", example="runs/compare")
        if args.report is not None:
            check_out(args.report, "--report", example="runs/report")
        model = build_model(args.model, spec.load(), args.seed)
    except (UsageError, MixprecError, FileNotFoundError, ValueError) as err:
        return fail(err)
    keys = args.rungs or list(DEMO_KEYS)
    runs = [_Run(ladder.EXPERIMENTS["compare"], settings, keys, model)]
    if args.underflow or (args.underflow is None and args.rungs is None):
        experiment = ladder.EXPERIMENTS["underflow"]
        derived = experiment.derive(settings)
        runs.append(_Run(experiment, derived, list(experiment.rungs), derived.build_model(spec.load())))
    paths: dict[str, Path] = {}
    for r in runs:
        console.print(f"[bold]{r.experiment.name}[/]: {r.settings.title} ({len(r.keys)} rungs)")
        r.results = ladder.run_ladder([ladder.ALL_RUNGS[k] for k in r.keys], spec.load, r.model, r.settings,
                                      on_result=functools.partial(_progress, console))
        r.notes = notes_for(r.results)
        paths |= {f"{r.experiment.name} {k}": p for k, p in write_outputs(
            r.results, r.settings, args.out, r.notes, stem=r.experiment.name).items()}
    if args.report is not None:
        paths |= _write_report(runs, spec.load().one_batch(), args.report)
    for r in runs:
        console.print(_table(r.results, r.settings))
        console.print("[bold]what each rung changed (measured)[/]")
        for line in _changes(r.results):
            console.print(f"  {line}")
        for note in r.notes:
            console.print(f"[dim]- {note}[/]")
    wrote = ", ".join(map(str, paths.values()))
    console.print(f"wall time {time.perf_counter() - start:.1f}s; wrote {wrote}")
    return 0


@dataclass
class _Run:
    """One experiment of this command: what it trains, and what came out."""

    experiment: Experiment
    settings: CompareSettings
    keys: list[str]
    model: Any
    results: list[RungResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _progress(console: Console, result: RungResult) -> None:
    done = f"{result.seconds:.1f}s" if result.seconds is not None else result.status
    console.print(f"  {result.label:<30} {done}")


def _write_report(runs: list[_Run], batch: Any, out: Path) -> dict[str, Path]:
    from mixprec.report import Section, write_report

    # The same initial models run_ladder copied, and the first batch of a fresh copy of the same data.
    main, *more = runs
    sections = [Section(r.experiment.name, r.experiment.why, r.settings, r.results, r.model, batch)
                for r in more]
    report = write_report(main.results, main.settings, main.model, batch, out, main.notes, sections)
    return {f"report {k}": report.paths[k] for k in ("md", "html")}


def _table(results: list[RungResult], settings: CompareSettings) -> Table:
    from rich import box
    from rich.table import Table

    from mixprec.ladder_output import COLUMNS, results_table

    # no vertical rules: 14 columns fit the console's 160 with every name whole
    table = Table(title=f"mixed precision ladder: {settings.title}", box=box.SIMPLE_HEAD)
    rows = [list(row.values()) for row in results_table(results)]
    for i, name in enumerate(COLUMNS):
        # the name columns at least as wide as their longest word: squeezed into 160 columns, rich cut
        # them ("O1 (autocas…", "arithmet…"); the numeric columns wrap their headers at spaces instead
        words = [w for text in (name, *(str(row[i]) for row in rows)) for w in text.split()]
        widest = max(map(len, words), default=0) if i in (0, 1) else None
        table.add_column(name, justify="left" if i in (0, 1) else "right", min_width=widest)
    for row in rows:
        table.add_row(*row)
    return table


def _changes(results: list[RungResult]) -> list[str]:
    """Each rung's measured difference to the rung it builds on (the CHANGE column of the files), as lines
    under the table: a terminal has no room for it as a column."""
    from mixprec.ladder_output import explain

    return [f"{r.label}: {explain(r, results)}" for r in results]

