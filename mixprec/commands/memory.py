"""``mixprec memory``: the memory of one training step, component by component, for each precision.

By default nothing is computed: the model is built on the meta device and one forward pass runs on fake
tensors (shapes and dtypes only), so ``mixprec memory --model vgg16 --batch-size 64 --input 3x224x224
--precision fp32,fp16,O2`` answers in seconds. ``--measure`` runs the same step on real tensors instead.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from mixprec.commands.console import make_console
from mixprec.commands.train import UsageError
from mixprec.commands.user_model import FORMS, is_spec

HELP = "Memory of one training step (params, grads, masters, optimizer state, activations) per precision."

# The input each model is usually trained on here: the 784-8192-10 MLP and the small models on 28x28 digits
# (MNIST's size), VGG16 on 3x224x224 (ImageNet's, as in the VGG16-on-MNIST experiment).
DEFAULT_INPUT: dict[str, tuple[int, ...]] = {
    "mlp": (1, 28, 28),
    "cnn": (1, 28, 28),
    "vgg16": (3, 224, 224),
    "transformer": (1, 28, 28),
}

# Default precisions: fp32 as the baseline; pure bf16 and what each way of keeping its updates costs; fastai's
# fp16 (fp16 model, fp32 masters, dynamic scaling) and apex O1. Names are mixprec.recipe.RECIPES' (the
# vocabulary of every command), RECIPE+MODE adding a LowPrecisionOptimizer mode.
DEFAULT_PRECISIONS = "fp32,pure-bf16,pure-bf16+kahan,pure-bf16+split,bf16,fp16,O1"


# vgg16 defaults to torchvision's 1000 classes (138,357,544 parameters); the others to digits' 10.
DEFAULT_CLASSES: dict[str, int] = {"vgg16": 1000}
MODEL_NAMES = ("cnn", "mlp", "transformer", "vgg16")


def _optimizers() -> dict[str, Any]:
    import torch

    # lr values are irrelevant here: only the state an optimizer keeps matters.
    return {
        "adam": lambda ps: torch.optim.Adam(ps),  # exp_avg + exp_avg_sq: twice the stepped parameters
        "adamw": lambda ps: torch.optim.AdamW(ps),
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),  # no state
        "momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),  # one buffer per parameter
        "none": None,
    }


OPTIMIZER_NAMES = ("adam", "adamw", "sgd", "momentum", "none")


def parse_shape(text: str) -> tuple[int, ...]:
    """``"3x224x224"`` -> ``(3, 224, 224)``; also accepts commas."""
    parts = re.split(r"\s*[x,X*]\s*", text.strip())  # an empty part ("3x") is a typo, not a 1-d shape
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(
            f"cannot read input shape {text!r}: write it as CxHxW, e.g. 3x224x224"
        )
    return tuple(int(p) for p in parts)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="mlp", metavar="NAME|MODULE:FUNCTION",
                        help=f"reference model from mixprec.models ({', '.join(MODEL_NAMES)}; default: mlp, "
                        "784-8192-10), or your own: module:function or file.py:function, the function "
                        f"returning {FORMS}")
    parser.add_argument("--batch-size", type=int, default=64, help="batch size (default: 64)")
    parser.add_argument("--input", type=parse_shape, default=None, metavar="CxHxW",
                        help="shape of one sample: CxHxW (the mlp flattens any shape; default: 1x28x28, "
                        "vgg16: 3x224x224)")
    parser.add_argument("--classes", type=int, default=None,
                        help="number of classes (default: 10; vgg16: 1000 as in torchvision)")
    parser.add_argument("--precision", default=DEFAULT_PRECISIONS, metavar="NAMES",
                        help="comma-separated recipe names: fp32, pure-fp16, pure-bf16, fp16-master, "
                        "fp16-static, fp16-dynamic, fp16 (fastai to_fp16: fp16 model + fp32 masters + "
                        "dynamic scaling), bf16, O0-O3; a pure recipe may add a low-precision update mode: "
                        f"pure-bf16+stochastic|kahan|split (default: {DEFAULT_PRECISIONS})")
    parser.add_argument("--optimizer", choices=OPTIMIZER_NAMES, default="adam",
                        help="optimizer whose state is counted (default: adam)")
    parser.add_argument("--measure", action="store_true",
                        help="run the step on real tensors instead of the no-compute estimate "
                        "(slow for vgg16)")
    parser.add_argument("--autocast", choices=("torch", "mixprec"), default="mixprec",
                        help="autocast used for O1 (default: mixprec.autocast, what initialize's O1 runs)")
    parser.add_argument("--png", default="mixprec-memory.png", metavar="PATH",
                        help="stacked-bar chart to write (default: mixprec-memory.png)")
    parser.add_argument("--no-png", action="store_true", help="do not write the chart")


def _build(args: argparse.Namespace, shape: tuple[int, ...] | None) -> tuple[Any, Any, Any]:
    """The model (a reference one on the meta device unless --measure), an example batch (x, y) and the
    loss function (None: memory_breakdown's default)."""
    import torch

    from mixprec.commands.user_model import load
    from mixprec.models import build

    if is_spec(args.model):  # the user's function builds it as their code does, on real tensors
        user = load(args.model)
        if user.batch is not None:
            return user.model, user.batch, user.loss_fn
        if shape is None:
            raise UsageError(f"--model {args.model} returned no example batch, and no --input was given.",
                             "pass --input with one sample's shape (e.g. --input 3x32x32), or return "
                             "(model, batch) from the function.")
        model, loss_fn, device = user.model, user.loss_fn, torch.device("cpu")
    else:
        device = torch.device("cpu" if args.measure else "meta")
        try:
            with device:
                model = build(args.model, input_shape=shape, n_classes=args.classes or
                              DEFAULT_CLASSES.get(args.model, 10))
        except ValueError as err:  # a reference model that cannot take this --input
            raise UsageError(str(err), "pass an --input this model takes (mixprec memory --help).") from err
        loss_fn = None
    x = torch.randn(args.batch_size, *shape, device=device)
    y = torch.zeros(args.batch_size, dtype=torch.int64, device=device)
    return model, (x, y), loss_fn


def _shape(args: argparse.Namespace) -> tuple[int, ...] | None:
    return args.input or DEFAULT_INPUT.get(args.model)


def _check(args: argparse.Namespace, shape: tuple[int, ...] | None) -> str | None:
    if args.batch_size < 1:
        return f"--batch-size must be >= 1, got {args.batch_size}."
    if args.classes is not None and args.classes < 2:  # as DataBunch: one class leaves nothing to learn
        return f"--classes must be >= 2, got {args.classes}: e.g. --classes 10."
    if is_spec(args.model):
        return None
    if args.model not in MODEL_NAMES:
        return (f"--model {args.model!r} is neither a reference model ({', '.join(MODEL_NAMES)}) nor "
                "module:function: e.g. --model cnn, or --model my_models.py:make_model.")
    assert shape is not None  # every reference model has a default input
    if args.model != "mlp" and len(shape) != 3:  # the MLP flattens any sample; the others convolve images
        example = "x".join(map(str, DEFAULT_INPUT[args.model]))
        return (f"--model {args.model} takes image samples, CxHxW; --input {'x'.join(map(str, shape))} has "
                f"{len(shape)} dimension(s): e.g. --input {example}.")
    return None


def _precisions(text: str) -> list[tuple[Any, Any]]:
    """(recipe, update mode) per name; a wrong name, or none at all, raises ConfigError that lists the valid
    names in the command line's words."""
    from mixprec.diagnostics.memory import parse_precision
    from mixprec.errors import ConfigError
    from mixprec.recipe import RECIPES

    fix = (f"use comma-separated names from: {', '.join(RECIPES)}; a pure recipe may add +stochastic, "
           "+kahan or +split (e.g. --precision fp32,fp16,pure-bf16+kahan).")
    names = [p for p in text.split(",") if p.strip()]
    if not names:
        raise ConfigError(f"--precision {text!r} names no recipe.", fix)
    try:
        return [parse_precision(name) for name in names]
    except ConfigError as err:
        raise ConfigError(f"--precision {text!r}: {err.problem}", fix) from None


def run(args: argparse.Namespace) -> int:
    import time

    from mixprec.commands.train import check_out_file, fail
    from mixprec.diagnostics.memory import first_batched_input, memory_breakdown, memory_table
    from mixprec.errors import ConfigError

    console = make_console()
    shape = _shape(args)
    problem = _check(args, shape)
    try:
        if problem is not None:
            raise UsageError(problem)
        precisions = _precisions(args.precision)
        if not args.no_png:
            check_out_file(Path(args.png), "--png")
        start = time.perf_counter()
        model, batch, loss_fn = _build(args, shape)
    except (UsageError, ConfigError) as err:  # a user's model's own errors keep their traceback
        return fail(err)
    breakdowns = [memory_breakdown(model, _optimizers()[args.optimizer], batch, recipe, update=update,
                                   loss_fn=loss_fn, estimate=not args.measure, autocast=args.autocast)
                  for recipe, update in precisions]
    seconds = time.perf_counter() - start
    n_params = breakdowns[0].n_params
    x = first_batched_input(batch)
    sample = "x".join(map(str, getattr(x, "shape", ())[1:])) or "?"
    rows = getattr(x, "shape", (args.batch_size,))[0]
    what = f"{args.model} ({n_params:,} parameters), batch {rows} x {sample}, {args.optimizer}"
    console.print(memory_table(breakdowns, title=f"Memory of one training step: {what}"))
    for note in dict.fromkeys(n for b in breakdowns for n in b.notes):  # each once, in order
        console.print(f"[yellow]note:[/] {note}.")
    how = "measured on real tensors" if args.measure else "estimated with FakeTensorMode (nothing computed)"
    console.print(f"{how} in {seconds:.1f} s. Total = sum of components, an upper bound on one step's "
                  "live tensors: activations are freed as backward runs.")
    if not args.no_png:
        from mixprec.diagnostics.plots import plot_memory

        path = plot_memory(breakdowns, args.png, title=f"Training memory by precision\n{what}")
        console.print(f"chart written to {path}")
    return 0
