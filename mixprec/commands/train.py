"""``mixprec train``: train a reference model with the Learner in fp32, fp16 or bf16, or at an apex opt level.

Shows fastai's progress bar and results table, then writes under ``--out``: ``metrics.json`` (settings,
per-epoch results, per-step loss, learning rate, loss scale and skipped flag), ``metrics.csv`` (one row
per epoch) and ``losses.png`` (the loss curve, and the loss scale when there is one). At every epoch end
it saves ``checkpoint.pt`` there; ``--resume`` continues from it with the same
arguments, to the same bits as an uninterrupted run.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mixprec.commands.console import make_console
from mixprec.errors import MixprecError
from mixprec.scale_state import DEFAULT_SCALE_FLOOR

if TYPE_CHECKING:
    import torch

    from mixprec.data import DataBunch
    from mixprec.learner import Learner
    from mixprec.scaler import GradScaler

CHECKPOINT_NAME = "checkpoint.pt"  # under --out, rewritten atomically at every epoch end

HELP = "Train a reference model (mlp, cnn, vgg16, transformer) in fp32, fp16 or bf16 and save its metrics."

MODELS = ("mlp", "cnn", "vgg16", "transformer")
PRECISIONS = ("fp32", "fp16", "bf16")
OPT_LEVELS = ("O0", "O1", "O2", "O3")
DATA_HELP = "digits (bundled, no download), mnist:PATH (a folder with the four IDX files) or synthetic"

# Image side per model (None: the data set's own). The MLP is the fp16-from-scratch write-up's 784-8192-10,
# so it sees 28x28; VGG16 halves the image five times and needs at least 32x32 (224 as in the paper is
# 50x the work, too slow on a CPU); the CNN and the transformer take digits' own 8x8.
DEFAULT_SIZE: dict[str, int | None] = {"mlp": 28, "cnn": None, "vgg16": 32, "transformer": None}


class UsageError(MixprecError, ValueError):
    """A command-line argument that cannot work; the message says what to pass instead. ``mixprec.cli.main``
    prints it as ``mixprec: error: ...`` with exit status 2."""


# ---------------------------------------------------------------------------------------------------
# Arguments shared with `mixprec compare`


def add_data_arguments(parser: argparse.ArgumentParser, model_default: str, size_help: str,
                       user_models: bool = False) -> None:  # fmt: skip
    if user_models:  # checked by the command: a reference model's name, or module:function
        parser.add_argument("--model", default=model_default, metavar="NAME|MODULE:FUNCTION",
                            help=f"reference model ({', '.join(MODELS)}; default: %(default)s) or your own: "
                            "module:function or file.py:function returning (model, batch) or (model, batch, "
                            "loss_fn); --data, --size, --batch-size and --seed then do not apply")
    else:
        parser.add_argument("--model", choices=MODELS, default=model_default,
                            help="reference model (default: %(default)s)")
    parser.add_argument("--data", default="digits", metavar="SOURCE", help=DATA_HELP)
    parser.add_argument("--size", type=int, default=None, help=size_help)
    parser.add_argument("--batch-size", type=int, default=64, metavar="B", help="(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, metavar="S",
                        help="data split/order and model init (default: %(default)s)")


@dataclass(frozen=True)
class DataSpec:
    """What --data, --size, --batch-size and --seed ask for; ``load()`` builds it (cheap: call it again for
    a fresh copy with the same batch order)."""

    source: str  # digits | mnist | synthetic
    path: str | None
    size: int | None
    batch_size: int
    seed: int

    def load(self) -> DataBunch:
        return _LOADERS[self.source](self)

    @property
    def name(self) -> str:
        side = f"@{self.size}x{self.size}" if self.size is not None else ""
        return f"{self.source}{side}"


def _digits(spec: DataSpec) -> DataBunch:
    from mixprec.data import digits

    return digits(batch_size=spec.batch_size, size=spec.size, seed=spec.seed)


def _mnist(spec: DataSpec) -> DataBunch:
    from mixprec.data import mnist

    return mnist(spec.path or ".", batch_size=spec.batch_size, size=spec.size, seed=spec.seed)


def _synthetic(spec: DataSpec) -> DataBunch:
    from mixprec.data import synthetic

    side = spec.size or 8  # images, so that every model (CNNs included) can take them
    return synthetic(input_shape=(1, side, side), batch_size=spec.batch_size, seed=spec.seed)


_LOADERS = {"digits": _digits, "mnist": _mnist, "synthetic": _synthetic}


def data_spec(args: argparse.Namespace) -> DataSpec:
    source, _, path = args.data.partition(":")
    if source not in _LOADERS:
        raise UsageError(f"unknown --data {args.data!r}: use {DATA_HELP}.")
    if (source == "mnist") != bool(path):
        raise UsageError(
            "mnist needs a folder, and only mnist takes one: --data mnist:PATH (e.g. mnist:~/data/mnist)."
        )
    if path and Path(path).expanduser().is_file():  # else mnist() lists all four files as missing
        folder = Path(path).expanduser().parent
        raise UsageError(f"--data {args.data}: {path} is a file; mnist needs the folder that holds its four "
                         "IDX files.", f"pass the folder: --data mnist:{folder.resolve()}")
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}.")
    if args.size is not None and args.size < 1:  # None (the model's default) cannot be typed: leave it out
        raise UsageError(f"--size must be a positive number of pixels, got {args.size}.",
                         "e.g. --size 28, or leave --size out for the default (mlp 28, vgg16 32, else the "
                         "data's own size).")
    size = args.size if args.size is not None else DEFAULT_SIZE[args.model]
    return DataSpec(source, str(Path(path).expanduser()) if path else None, size, args.batch_size, args.seed)


def build_model(name: str, data: DataBunch, seed: int) -> torch.nn.Module:
    import torch

    from mixprec.models import build

    torch.manual_seed(seed)
    return build(name, data)


def fail(err: Exception) -> int:
    """Print a user error (what was wrong, and the fix) and return the exit status 2."""
    print(f"mixprec: error: {err}", file=sys.stderr)
    return 2


# ---------------------------------------------------------------------------------------------------
# mixprec train


def _loss_scale_arg(text: str) -> float | str:
    if text == "dynamic":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'dynamic' or a number like 512, got {text!r}") from None
    if not (math.isfinite(value) and value >= DEFAULT_SCALE_FLOOR):
        # the scaler's own check would name its Python arguments (init_scale, min_scale) instead
        raise argparse.ArgumentTypeError(
            f"a loss scale must be a finite number >= {DEFAULT_SCALE_FLOOR:g} (the scaler's floor: a smaller "
            f"one only shrinks gradients), got {text!r}; e.g. --loss-scale 512, or --loss-scale dynamic")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_data_arguments(parser, "mlp", "image side in pixels (default: mlp 28, vgg16 32, else the data's own)")
    # default None, read as fp32: so that --opt-level can tell an explicit --precision from the default.
    parser.add_argument("--precision", choices=PRECISIONS, default=None,
                        help="fp32 (the default); fp16: fp32 masters + loss scaling (Learner.to_fp16); "
                        "bf16: fp32 masters, no scaling")
    parser.add_argument("--opt-level", type=str.upper, choices=OPT_LEVELS, default=None,  # o2 as O2
                        help="an apex opt level's recipe (O0-O3, apex's properties), run by the Learner's "
                        "mixed-precision callback; instead of --precision")
    parser.add_argument("--loss-scale", type=_loss_scale_arg, default=None, metavar="dynamic|NUMBER",
                        help="fp16 only: 'dynamic' (start at 512, back off on overflow; the default) or a "
                        "fixed scale such as 512")
    parser.add_argument("--flat-master", action="store_true", help="one flat fp32 master buffer (fp16/bf16)")
    parser.add_argument("--epochs", type=int, default=3, metavar="N", help="(default: %(default)s)")
    parser.add_argument("--lr", type=float, default=3e-3, metavar="X",
                        help="peak learning rate (default: %(default)s)")
    parser.add_argument("--opt", choices=("adamw", "sgd"), default="adamw",
                        help="AdamW(betas 0.9/0.99, wd 0.01) as fastai, or SGD with momentum 0.9")
    parser.add_argument("--schedule", choices=("one-cycle", "constant"), default="one-cycle")
    parser.add_argument("--out", type=Path, default=Path("runs/train"), metavar="DIR",
                        help="where metrics.json, metrics.csv, losses.png and checkpoint.pt go "
                        "(default: runs/train)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from DIR/checkpoint.pt of an interrupted run with the same arguments "
                        "(--epochs may grow under --schedule constant: one-cycle's schedule spans the "
                        "epochs); with no checkpoint there yet, start afresh")
    parser.add_argument("--overwrite", action="store_true",
                        help="start afresh where DIR holds a run already (its checkpoint.pt is replaced)")


def _check(args: argparse.Namespace) -> None:
    """Refuse arguments that cannot work, before any data is loaded; fill in --precision's default."""
    if args.epochs < 1:
        raise UsageError(f"--epochs must be >= 1, got {args.epochs}.")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise UsageError(f"--lr must be a positive number, got {args.lr:g}.",
                         "pass the peak learning rate, e.g. --lr 3e-3 (the default).")
    if args.opt_level is not None and (args.precision is not None or args.loss_scale is not None):
        pairs = (("--precision", args.precision), ("--loss-scale", args.loss_scale))
        given = " ".join(f"{flag} {value}" for flag, value in pairs if value is not None)
        raise UsageError(
            f"--opt-level {args.opt_level} chooses the precision and loss scaling itself, and {given} "
            "would be ignored: drop --precision/--loss-scale, or drop --opt-level."
        )
    if args.opt_level is None and args.precision is None:
        args.precision = "fp32"
    if args.loss_scale is not None and args.precision != "fp16":
        raise UsageError(
            f"--loss-scale applies to fp16 only; {args.precision} needs no scaling ("
            + ("bf16 has fp32's exponent range" if args.precision == "bf16" else "its gradients are fp32")
            + "). Drop --loss-scale, or use --precision fp16."
        )
    if args.flat_master and args.precision == "fp32" and args.opt_level is None:
        raise UsageError("--flat-master lays out the fp32 master weights of a half model, and fp32 training "
                         "keeps none: add --precision fp16 or bf16, or drop --flat-master.")
    if args.flat_master and args.opt_level in ("O0", "O1", "O3"):
        raise UsageError(f"--flat-master needs fp32 master weights, which {args.opt_level} does not keep: "
                         "use --opt-level O2, or drop --flat-master.")
    check_out(args.out)
    kept = args.out / "checkpoint.pt"
    if kept.exists() and not (args.resume or args.overwrite):  # a finished run's, or an interrupted one's
        raise UsageError(f"--out {args.out} holds a run already ({kept}): training afresh would replace it.",
                         "pass --resume to continue it, --overwrite to replace it, or another --out.")


def _folder_problem(folder: Path) -> str | None:
    """Why this process cannot create and write into ``folder``; None when it can (it is created now)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return f"cannot create this folder ({err.strerror})"
    return None if os.access(folder, os.W_OK | os.X_OK) else "this folder is not writable"


def check_out(out: Path, flag: str = "--out", example: str = "runs/train") -> None:
    """``flag``'s folder must be one this process can create and write into (checked now, not after the
    work it would hold is done)."""
    problem = _folder_problem(out)
    if problem is not None:
        raise UsageError(f"{flag} {out}: {problem}.",
                         f"pass a folder you can write to, e.g. {flag} {example}.")


def check_out_file(path: Path, flag: str) -> None:
    """``flag`` names a file to write: not an existing folder, and in a folder this process can write to."""
    if path.is_dir():
        raise UsageError(f"{flag} {path}: this is a folder; a file name is expected.",
                         f"pass a file name, e.g. {flag} {path / 'chart.png'}.")
    problem = _folder_problem(path.parent)
    if problem is not None:
        raise UsageError(f"{flag} {path}: {path.parent}: {problem}.",
                         f"pass a file in a folder you can write to, e.g. {flag} {path.name}.")


def _opt_func(name: str) -> Any:
    import functools

    import torch

    from mixprec.learner import default_opt_func

    # SGD's momentum 0.9: the classic value; the one-cycle schedule moves it between 0.95 and 0.85.
    return {"adamw": default_opt_func, "sgd": functools.partial(torch.optim.SGD, momentum=0.9)}[name]


def _set_precision(learn: Learner, args: argparse.Namespace) -> None:
    if args.opt_level is not None:
        from mixprec import amp
        from mixprec.callbacks import mixprec_callback_for

        cb = mixprec_callback_for(amp.OPT_LEVELS[args.opt_level], flat_master=args.flat_master)
        if cb is not None:
            learn.add_cb(cb)
    elif args.precision == "fp16":
        scale = args.loss_scale
        dynamic = scale is None or scale == "dynamic"
        learn.to_fp16(loss_scale=512.0 if dynamic else float(scale), dynamic=dynamic,
                      flat_master=args.flat_master)
    elif args.precision == "bf16":
        learn.to_bf16(flat_master=args.flat_master)


def run(args: argparse.Namespace) -> int:
    from mixprec.commands import train_resume
    from mixprec.learner import Learner, accuracy

    console = make_console()
    try:
        _check(args)
        spec = data_spec(args)
        plan = train_resume.plan(args, args.out / CHECKPOINT_NAME)
        if plan.note is not None:
            console.print(plan.note)
        if plan.finished:
            return 0
        data = spec.load()
        model = build_model(args.model, data, args.seed)
        learn = Learner(data, model, opt_func=_opt_func(args.opt), metrics=[accuracy], console=console)
        _set_precision(learn, args)
    except (UsageError, MixprecError, FileNotFoundError, ValueError) as err:
        return fail(err)
    if plan.keep_settings:
        learn.add_cb(train_resume.TrainSettings(train_resume.settings_of(args)))
    precision = args.opt_level or args.precision
    if args.opt_level == "O3" and args.opt == "adamw":
        # Measured: torch's AdamW on fp16 weights turns them inf/NaN in its first step (eps=1e-8 and the
        # second-moment terms underflow in fp16); O3 keeps no fp32 masters to do that arithmetic in.
        console.print("[yellow]warning:[/] O3 updates fp16 weights directly; AdamW's arithmetic underflows "
                      "in fp16 and produces NaN. Use --opt sgd, or O2 (fp32 masters).")
    console.print(f"[bold]{args.model}[/] on [bold]{spec.name}[/], {precision}, {args.opt} lr {args.lr:g}, "
                  f"{args.schedule}, batch {args.batch_size}, seed {args.seed}")
    ckpt = _checkpoint_args(args, resume=not plan.start_fresh)
    try:
        if args.schedule == "one-cycle":
            learn.fit_one_cycle(args.epochs, args.lr, **ckpt)
        else:
            learn.fit(args.epochs, args.lr, **ckpt)
    except MixprecError as err:  # a checkpoint of another model, precision or epoch count
        return fail(err)
    paths = write_metrics(learn, args, spec, precision)
    scaler = learn.scaler
    if scaler is not None and scaler.is_enabled():
        skipped = learn.recorder.skipped_steps
        console.print(f"skipped steps {skipped}, final loss scale {scaler.get_scale():g}")
    problem = run_problem(learn.recorder.losses, learn.recorder.skipped, scaler)
    if problem is not None:
        console.print(f"[yellow]warning:[/] {problem}")
    checkpoint = ckpt["checkpoint"]  # the last epoch's, what --resume continues from
    paths += [checkpoint] if checkpoint.exists() else []
    console.print("wrote " + ", ".join(str(p) for p in paths))
    return 0


# A run that skipped at least this share of its steps is reported as one that barely trained.
MOSTLY_SKIPPED = 0.5


def run_problem(losses: list[float], skipped: list[bool], scaler: GradScaler | None) -> str | None:
    """What went wrong in a finished run, in words with the fix, or None: the loss went inf/NaN, or most
    steps were skipped for inf/NaN gradients (a user trial: both ended with exit 0 and no word)."""
    bad = next((i for i, loss in enumerate(losses) if not math.isfinite(loss)), None)
    if bad is not None:
        return (f"the training loss became {losses[bad]} at step {bad + 1} of {len(losses)}: the run "
                "diverged or the data holds NaN. Try a lower --lr; mixprec.diagnostics.trace_nonfinite "
                "names the first layer with a non-finite output.")
    n = sum(skipped)
    if skipped and n >= MOSTLY_SKIPPED * len(skipped):
        static = scaler is not None and not scaler.is_dynamic
        fix = ("a lower --loss-scale, or --loss-scale dynamic" if static else "a lower --lr, or look for a "
               "forward overflow with mixprec.diagnostics.trace_nonfinite")
        return (f"{n} of {len(skipped)} steps were skipped for inf/NaN gradients: the run barely trained. "
                f"Try {fix}.")
    return None


def _checkpoint_args(args: argparse.Namespace, resume: bool) -> dict[str, Path]:
    path = args.out / CHECKPOINT_NAME
    return {"checkpoint": path, "resume": path} if resume else {"checkpoint": path}


def write_metrics(learn: Learner, args: argparse.Namespace, spec: DataSpec, precision: str) -> list[Path]:
    import csv
    import json

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    rec = learn.recorder
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k[0] != "_"}
    epochs = [
        {"epoch": r.epoch, "train_loss": r.train_loss, "valid_loss": r.valid_loss, **dict(r.metrics),
         "seconds": r.seconds}
        for r in rec.epochs
    ]
    steps = {"loss": rec.losses, "lr": rec.lrs, "loss_scale": rec.loss_scales, "skipped": rec.skipped}
    payload = {"settings": settings | {"data_name": spec.name, "precision_run": precision},
               "epochs": epochs, "skipped_steps": rec.skipped_steps, "steps": steps}
    json_path, csv_path, png_path = out / "metrics.json", out / "metrics.csv", out / "losses.png"
    json_path.write_text(json.dumps(payload, indent=1) + "\n")
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(epochs[0]))
        writer.writeheader()
        writer.writerows(epochs)
    rec.plot_losses(png_path, title=f"{args.model} on {spec.name}, {precision}")
    return [json_path, csv_path, png_path]
