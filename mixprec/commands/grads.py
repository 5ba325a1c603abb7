"""``mixprec grads``: where a model's gradients lie on the exponent axis, and what fp16 does to them.

Computes the gradients of one batch (optionally after a few plain fp32 SGD steps), prints per parameter
the fractions that would underflow to zero, land in fp16's subnormal range or overflow, unscaled and at
``--loss-scale``, plus a suggested loss scale, and writes the exponent histogram as a PNG.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mixprec.commands.console import make_console
from mixprec.commands.train import (
    MODELS,
    UsageError,
    add_data_arguments,
    build_model,
    check_out_file,
    data_spec,
    fail,
)
from mixprec.commands.user_model import is_spec, load

HELP = "Gradient exponents vs the fp16/bf16 ranges: underflow/overflow with and without a loss scale."

def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_data_arguments(parser, "mlp", "image side in pixels (default: mlp 28, vgg16 32, else the data's own)",
                       user_models=True)
    parser.add_argument("--loss-scale", type=float, action="append", default=None, metavar="S",
                        help="loss scale to evaluate besides 1 and the suggestion (repeatable)")
    parser.add_argument("--margin", type=float, default=8.0,
                        help="headroom of the suggested scale: max|g| x S x margin <= 65504 (default: 8)")
    parser.add_argument("--train-steps", type=int, default=0,
                        help="fp32 SGD steps (lr 0.1) before measuring, to look past initialisation "
                        "(default: 0)")
    parser.add_argument("--png", default="mixprec-grads.png", metavar="PATH",
                        help="histogram to write (default: mixprec-grads.png)")
    parser.add_argument("--no-png", action="store_true", help="do not write the histogram")


def _train(model: Any, bunch: Any, steps: int) -> None:
    import torch
    import torch.nn.functional as F

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    done = 0
    while done < steps:
        for x, y in bunch.train:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            done += 1
            if done == steps:
                return


def _check(args: argparse.Namespace) -> str | None:
    if not is_spec(args.model) and args.model not in MODELS:
        return (f"--model {args.model!r} is neither a reference model ({', '.join(MODELS)}) nor "
                "module:function: e.g. --model cnn, or --model my_models.py:make_model.")
    if is_spec(args.model) and args.train_steps:
        return ("--train-steps trains a reference model on --data; your own model is measured as your "
                "function returns it: train it first in Python, or call "
                "mixprec.diagnostics.grad_exponent_histogram(model, batch) at any point of your run.")
    if args.train_steps < 0:
        return f"--train-steps must be >= 0, got {args.train_steps}."
    if any(not (s > 0) for s in args.loss_scale or ()):
        return "--loss-scale must be positive, e.g. --loss-scale 1024."
    if not args.margin > 0:
        return f"--margin must be positive, got {args.margin}."
    return None


def _users_model(args: argparse.Namespace) -> tuple[Any, Any, Any, str]:
    """(model, batch, loss_fn or None, what the batch is) from the user's function, measured as returned."""
    user = load(args.model)
    if user.batch is None:
        raise UsageError(f"--model {args.model} returned no example batch.",
                         "return (model, batch) from the function: x, or (x, y) with the targets your "
                         "loss takes.")  # fmt: skip
    return user.model, user.batch, user.loss_fn, "your batch"


def _reference_model(args: argparse.Namespace) -> tuple[Any, Any, Any, str]:
    """A reference model trained ``--train-steps`` on ``--data``, and that data's first batch."""
    bunch = data_spec(args).load()
    model = build_model(args.model, bunch, args.seed)
    if args.train_steps:
        _train(model, bunch, args.train_steps)
    return model, bunch.one_batch(), None, bunch.name


def run(args: argparse.Namespace) -> int:
    from mixprec.diagnostics.gradients import grad_exponent_histogram
    from mixprec.diagnostics.memory import first_batched_input

    console = make_console()
    problem, made = _check(args), None
    if problem is None:
        try:
            if not args.no_png:
                check_out_file(Path(args.png), "--png")
            made = None if is_spec(args.model) else _reference_model(args)
        except ValueError as err:  # a UsageError (e.g. unknown --data), or a model the data cannot feed
            problem = str(err)
    if problem is not None:  # as cli.main prints every user error: on stderr, exit status 2
        return fail(ValueError(problem))
    if made is None:
        try:
            made = _users_model(args)
        except UsageError as err:  # only these: the user's own errors keep their traceback, as in memory
            return fail(err)
    model, batch, loss_fn, data_name = made
    scales = tuple(args.loss_scale or ())
    report = grad_exponent_histogram(model, batch, loss_fn=loss_fn, loss_scale=scales, margin=args.margin)
    shown = scales[0] if scales else None
    console.print(report.table(shown))
    console.print(report.summary(shown))
    if not args.no_png:
        n_params = sum(p.numel() for p in model.parameters())
        steps = f", after {args.train_steps} SGD steps" if args.train_steps else ", at initialisation"
        title = (f"Gradient magnitudes of {args.model} ({n_params:,} parameters) on {data_name}, "
                 f"batch {getattr(first_batched_input(batch), 'shape', (1,))[0]}{steps}")
        path = report.plot(args.png, shown, title=title)
        console.print(f"histogram written to {path}")
    return 0
