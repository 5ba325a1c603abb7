"""``mixprec compare``: the mixed precision ladder (:mod:`mixprec.ladder`) on one model, data set and seed.

fp32 | fp16 naive | + fp32 master weights | + static loss scaling | + dynamic loss scaling (O2) |
O1 cast policy | bf16: one table and one PNG of every rung's loss curve. Writes compare.csv, compare.json
(with every per-step loss), compare.md and compare.png under ``--out``; with ``--report DIR`` also one page
(:mod:`mixprec.report`): report.md and a self-contained report.html with the table, loss curves, memory
bars and gradient histogram.

The defaults are the demo: the 784-8192-10 MLP on the bundled digits resized to 28x28, plain SGD at lr
0.01, 6 epochs (about a minute for the seven rungs on 2 CPU cores). Plain SGD makes the update exactly
lr * gradient, so the fp16 resolution effect is not blurred by momentum or Adam's normalisation.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING

from mixprec.commands.console import make_console
from mixprec.commands.train import DataSpec, UsageError, add_data_arguments, build_model, data_spec, fail

if TYPE_CHECKING:
    from rich.table import Table

    from mixprec.ladder import CompareSettings, RungResult

HELP = "Train one model on the mixed precision ladder (fp32 ... fp16 naive ... O2, O1, bf16) and compare."

# Output that is not a terminal (pipes, files, CI logs) gets this width, so the table is not squeezed.
PLAIN_WIDTH = 160

# The argparse defaults are CompareSettings' defaults and these are ladder.RUNGS' keys (tests check both),
# repeated here so that `mixprec --help` needs no torch.
RUNG_KEYS = ("fp32", "fp16-naive", "fp16-master", "fp16-static", "fp16-dynamic", "o1", "bf16")


def _rungs_arg(text: str) -> list[str]:
    keys = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in keys if k not in RUNG_KEYS]
    if unknown or not keys:
        raise argparse.ArgumentTypeError(f"unknown rung(s) {unknown}; choose from {','.join(RUNG_KEYS)}")
    return keys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_data_arguments(parser, "mlp", "image side in pixels (default: mlp 28, vgg16 32, else the data's own)")
    parser.add_argument("--epochs", type=int, default=6, metavar="N")
    parser.add_argument("--lr", type=float, default=0.01, metavar="X", help="SGD learning rate (constant)")
    parser.add_argument("--momentum", type=float, default=0.0,
                        help="SGD momentum (default 0: the update is lr*grad)")
    parser.add_argument("--rungs", type=_rungs_arg, default=list(RUNG_KEYS), metavar="KEYS",
                        help=f"comma-separated subset of {','.join(RUNG_KEYS)} (default: all)")
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

    console = make_console()
    if not console.is_terminal:
        console.width = PLAIN_WIDTH
    start = time.perf_counter()
    try:
        spec = data_spec(args)
        settings = settings_from(args, spec)
        model = build_model(args.model, spec.load(), args.seed)
    except (UsageError, MixprecError, FileNotFoundError, ValueError) as err:
        return fail(err)
    console.print(
        f"[bold]{args.model}[/] on [bold]{spec.name}[/]: {len(args.rungs)} rungs x {args.epochs} epochs, "
        f"SGD lr {args.lr:g} momentum {args.momentum:g}, batch {args.batch_size}, seed {args.seed}"
    )

    def progress(result: RungResult) -> None:
        done = f"{result.seconds:.1f}s" if result.seconds is not None else result.status
        console.print(f"  {result.label:<30} {done}")

    rungs = [ladder.RUNGS[k] for k in args.rungs]
    results = ladder.run_ladder(rungs, spec.load, model, settings, on_result=progress)
    notes = [*ladder.NOTES, *_platform_notes()]
    paths = ladder.write_outputs(results, settings, args.out, notes)
    if args.report is not None:
        from mixprec.report import write_report

        # The same initial model run_ladder copied, and the first batch of a fresh copy of the same data.
        report = write_report(results, settings, model, spec.load().one_batch(), args.report, notes)
        paths |= {f"report {k}": report.paths[k] for k in ("md", "html")}
    console.print(_table(results, settings))
    for note in notes:
        console.print(f"[dim]- {note}[/]")
    wrote = ", ".join(map(str, paths.values()))
    console.print(f"wall time {time.perf_counter() - start:.1f}s; wrote {wrote}")
    return 0


def _platform_notes() -> list[str]:
    """What the numbers mean on this machine (CPU: emulated fp16 GEMMs)."""
    import torch

    if torch.cuda.is_available():
        return []
    return [
        "CPU: fp16 GEMMs run emulated (fp32 on exact upcasts, rounded to fp16, as a tensor core computes), "
        "so fp16 rungs are not faster than fp32 here and autograd keeps the fp32 upcasts (saved MiB); "
        "bf16 GEMMs are native.",
    ]


def _table(results: list[RungResult], settings: CompareSettings) -> Table:
    from rich.table import Table

    from mixprec.ladder import COLUMNS, results_table

    table = Table(title=f"mixed precision ladder: {settings.model} on {settings.data_name}")
    for i, name in enumerate(COLUMNS):
        table.add_column(name, justify="left" if i == 0 else "right")
    for row in results_table(results):
        table.add_row(*row.values())
    return table

