"""One AdamW step on bf16 parameters without fp32 masters (LowPrecisionOptimizer, each mode) vs fp32
masters (MasterWeights) vs torch's AdamW on fp32 parameters, timed side by side in one run, with the bytes
per parameter each holds (counted from the live tensors by mixprec.low_precision.footprint).

Every row uses torch's fused AdamW kernel. The low-precision step rebuilds fp32 weights and grads per chunk
(a few passes), runs the kernel on them, and stores the result (one or two passes; stochastic rounding also
draws 16 random bits per element, and bf16 state doubles the conversions). It trades time for memory.

    .venv/bin/python benchmarks/low_precision_step.py [--params 9e6] [--repeats 7]
"""

from __future__ import annotations

import argparse

import torch
from master_step import _params, _round_robin, _shapes  # master_step.py's parameter mix and timing
from rich.console import Console
from rich.table import Table

from mixprec.hardware import hardware_line, load_line
from mixprec.low_precision import LowPrecisionOptimizer, UpdateMode, footprint
from mixprec.master import MasterWeights


def _setups() -> list[tuple[str, torch.dtype, object]]:
    """(label, parameter dtype, wrap) for each row."""
    rows: list[tuple[str, torch.dtype, object]] = [
        ("torch AdamW on fp32 params", torch.float32, lambda o: o),
        ("MasterWeights(AdamW) on bf16 params", torch.bfloat16, MasterWeights),
    ]
    for mode in UpdateMode:
        for state_dtype in (None, torch.bfloat16):
            label = f"LowPrecisionOptimizer({mode.value}{', bf16 state' if state_dtype else ''})"
            rows.append((label, torch.bfloat16,
                         lambda o, m=mode, s=state_dtype: LowPrecisionOptimizer(o, m, state_dtype=s)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--params", type=float, default=9e6, help="number of parameters")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    shapes = _shapes(args.params)
    n = sum(torch.Size(s).numel() for s in shapes)
    table = Table(title=f"One AdamW step over {n / 1e6:.1f}M parameters (median of {args.repeats}, "
                  "round-robin)")
    for column in ("step", "ms", "vs fp32", "B/param"):
        table.add_column(column, justify="left" if column == "step" else "right")
    # torch's fused AdamW kernel for every row (MasterWeights would pick it anyway): one pass over memory.
    # The gradients stay attached: each call is one full step.
    opts = {
        label: wrap(torch.optim.AdamW(_params(shapes, dtype, "cpu"), lr=1e-3, fused=True))  # type: ignore[operator]
        for label, dtype, wrap in _setups()
    }
    ms = _round_robin({label: opt.step for label, opt in opts.items()}, args.repeats, "cpu")
    base = next(iter(ms.values()))
    for label, opt in opts.items():
        per_param = footprint(opt).per_param
        table.add_row(label, f"{ms[label]:.1f}", f"{ms[label] / base:.2f}x", f"{per_param:.1f}")
    console = Console()
    console.print(hardware_line())
    console.print(load_line())
    console.print(table)

if __name__ == "__main__":
    main()
