"""``mixprec info``: what this machine offers for half precision, and what mixprec will do with it.

Prints the hardware line (CPU model, the flags that decide half-precision speed, threads, torch), then one
row per half dtype: the arithmetic :mod:`mixprec.hardware` chose for its GEMMs and convolutions, what made
the choice (an override, a query of torch, a timed probe), why, and what autocast, O2 models and the
Learner compute as a result. ``--measure`` adds the GEMM rates of this machine, timed now.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from mixprec.commands.console import make_console

if TYPE_CHECKING:
    import torch
    from rich.table import Table

    from mixprec.commands.train import UsageError
    from mixprec.hardware import HalfArithmetic

HELP = "Show the detected half-precision hardware and the arithmetic mixprec will use (native or emulated)."

# What the GEMMs/convs of a region (autocast, an O2/to_fp16 model) compute under each arithmetic.
_WHAT_MIXPREC_DOES: dict[str, str] = {
    "native": "torch's {name} kernels",
    "emulated": "{name}-rounded inputs, exact fp32 upcast, fp32 accumulation, one rounding to {name}",
}

# GEMM size of --measure: large enough for a blocked kernel's steady rate, small enough that the slowest
# half rate seen (0.5 GFLOP/s) answers in about a second.
MEASURE_SIZE = 512


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="device type to describe (default: cpu)")
    parser.add_argument("--arithmetic", choices=("native", "emulated"), default=None,
                        help="show the effect of forcing one arithmetic (what MIXPREC_HALF_ARITHMETIC does)")
    parser.add_argument("--measure", action="store_true",
                        help=f"also time {MEASURE_SIZE}^3 GEMMs in fp32, fp16 and bf16 (seconds on a CPU "
                        "without half units)")


def _missing_device(device_type: str) -> UsageError | None:
    """Why ``device_type`` cannot be described on this machine, with the fix; None when it can."""
    import torch

    from mixprec.commands.train import UsageError

    if device_type == "cuda" and not torch.cuda.is_available():
        # Nothing runs there, so there is nothing to decide: "native" would describe a device that is absent.
        build = f"torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None else (
            f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU")
        return UsageError(f"--device cuda: this machine has no CUDA device ({build}).",
                          "run on a machine with an NVIDIA GPU and a CUDA build of torch, or describe this "
                          "one with --device cpu.")
    return None


def run(args: argparse.Namespace) -> int:
    from mixprec import hardware
    from mixprec.commands.train import fail

    missing = _missing_device(args.device)
    if missing is not None:
        return fail(missing)
    console = make_console()
    console.print(f"[bold]hardware[/bold]  {hardware.hardware_line()}")
    decisions = [hardware.half_arithmetic(args.device, d, args.arithmetic) for d in hardware.HALF_DTYPES]
    rates = _rates(args.device) if args.measure else {}
    console.print(_table(decisions, rates))
    if args.device == "cpu":
        console.print(_native_lines())
    console.print(
        f"Override: {hardware.ENV_VAR}=native|emulated (both dtypes) or per dtype, each part optionally "
        f"for one device type, e.g. {hardware.ENV_VAR}=fp16=emulated,bf16=native or cpu:fp16=emulated; or "
        "mixprec.hardware.half_arithmetic(device, dtype, override=...)."
    )
    return 0


def _native_lines() -> str:
    from mixprec.split_adam import library_error, library_threads

    error = library_error()  # builds the loop once on this machine (about a second), then reads the cache
    what = f"native one-pass loop (mixprec/split_adam.c, {library_threads()})" if error is None else (
        f"generic step ({error})")
    check = "native, mixprec/non_finite.c" if error is None else "torch's check-and-unscale"
    unscale = ("native, in the copy (mixprec/unscale_copy.c)" if error is None
               else "a copy, then torch's check-and-unscale")
    return (f"[bold]split masters[/bold]  Adam/AdamW step of LowPrecisionOptimizer(mode='split'): {what}\n"
            f"[bold]inf/NaN check[/bold]  of fp16/bf16/fp32 gradients at a loss scale of 1 on the CPU: "
            f"{check}\n"
            f"[bold]O2 unscale[/bold]  of fp16/bf16 gradients into fp32 master gradients on the CPU: "
            f"{unscale}")


def _rates(device_type: str) -> dict[torch.dtype, float]:
    import torch

    from mixprec import hardware

    dtypes = (torch.float32, *hardware.HALF_DTYPES)
    return {d: hardware.gemm_gflops(device_type, d, MEASURE_SIZE) for d in dtypes}


def _table(decisions: list[HalfArithmetic], rates: dict[torch.dtype, float]) -> Table:
    import torch
    from rich import box
    from rich.table import Table

    from mixprec.formats import dtype_label

    table = Table(title="Half-precision GEMMs and convolutions", box=box.SIMPLE_HEAD)
    for header in ("dtype", "arithmetic", "decided by", "why", "mixprec computes"):
        table.add_column(header)
    if rates:
        # torch's own kernel for the dtype: what mixprec runs where "native", and avoids where "emulated"
        table.add_column(f"torch's {MEASURE_SIZE}^3 GEMM\nGFLOP/s (fp32's)", justify="right")
    for d in decisions:
        name = dtype_label(d.dtype)
        style = "yellow" if d.emulated else "green"
        row = [name, f"[{style}]{d.arithmetic.value}[/{style}]", d.decided_by.value, d.reason,
               _WHAT_MIXPREC_DOES[d.arithmetic.value].format(name=name)]
        if rates:
            row.append(f"{rates[d.dtype]:.1f} ({rates[torch.float32]:.1f})")
        table.add_row(*row)
    return table
