"""How much of a bf16 training step on the CPU is lost to the weight-gradient GEMM's memory layout, and what
laying a weight out column-major would win back. Answers a question, ships nothing: mixprec's linear layers
use autograd's own backward.

A linear layer's weight gradient is dW = g^T x, summed over the tokens. The tokens are the rows of both g
and x, so one GEMM operand is always read transposed; autograd passes the transposed view (``g.t() @ x``).
oneDNN's bf16 GEMM on the CPU runs that layout at about half the rate of two row-major operands. Saving x
transposed in the forward (``x.t().contiguous()``, the same bytes as x) lets the backward compute
dW^T = x^T g from two row-major operands; dW^T is then the weight's own layout if the weight is stored
column-major (``W.t()`` contiguous), and needs a transposing copy otherwise.

Part one times the GEMMs alone (the layouts autograd uses against the contiguous x^T, copy included); part
two times a compiled bf16 forward + backward (no optimizer step) of the issue's MLP and GPT with autograd's
linear against the column-major variant, round-robin in one process, medians.

    python benchmarks/weight_grad_layout.py [--repeats 9] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from mixprec.hardware import hardware_line, load_line
from mixprec.host_memory import keep_freed_memory

BF16 = torch.bfloat16
# (in, out) of the issue's models' linear layers: the GPT's qkv, attention output, MLP up and down, and the
# MLP's first layer (the GPT's lm_head shares the embedding's row-major weight)
SHAPES = ((512, 1536), (512, 512), (512, 2048), (2048, 512), (784, 8192))


class TransposedInputLinear(torch.autograd.Function):
    """``F.linear`` whose backward computes the weight gradient as ``x^T @ g`` from an x^T saved contiguous
    in the forward. The gradient comes out as ``W.t()``'s layout: free for a column-major W, a transposing
    copy for a row-major one."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:  # type: ignore[override]
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2.t().contiguous(), w)  # the same bytes autograd would save for x
        ctx.x_shape, ctx.has_bias = x.shape, b is not None
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        xt, w = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        dx = (g2 @ w).reshape(ctx.x_shape) if ctx.needs_input_grad[0] else None
        dwt = xt @ g2  # (in, out): both operands row-major
        dw = dwt.t() if w.stride(0) == 1 else dwt.t().contiguous()
        return dx, dw, g2.sum(0) if ctx.has_bias else None


def column_major(linear: nn.Linear) -> None:
    """Store ``linear``'s weight column-major and route it through :class:`TransposedInputLinear`."""
    linear.weight = nn.Parameter(linear.weight.detach().t().contiguous().t())
    bias = linear.bias

    def forward(x: torch.Tensor) -> torch.Tensor:
        return TransposedInputLinear.apply(x, linear.weight, bias)

    linear.forward = forward  # type: ignore[method-assign]


def _round_robin_ms(fns: list[Callable[[], object]], repeats: int) -> list[float]:
    """Median ms of each of ``fns``, timed one after another in each round: load that comes and goes hits
    them alike."""
    for fn in fns:
        for _ in range(3):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, spent in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - start)
    return [statistics.median(t) * 1e3 for t in times]


def gemm_table(tokens: int, repeats: int) -> Table:
    table = Table(title=f"bf16 GEMMs of a linear layer, {tokens} tokens (ms, GFLOP/s)")
    for col in ("in x out", "forward x @ W.t()", "input grad g @ W", "weight grad g.t() @ x (autograd)",
                "x.t().contiguous() @ g (copy included)", "ratio"):
        table.add_column(col, justify="right")
    gen = torch.Generator().manual_seed(0)
    for n_in, n_out in SHAPES:
        x, w, g = (torch.randn(*s, generator=gen).to(BF16) for s in ((tokens, n_in), (n_out, n_in),
                                                                      (tokens, n_out)))
        gflop = 2 * tokens * n_in * n_out / 1e9
        products = (lambda x, w, g: x @ w.t(), lambda x, w, g: g @ w, lambda x, w, g: g.t() @ x,
                    lambda x, w, g: x.t().contiguous() @ g)
        times = _round_robin_ms([lambda f=f, args=(x, w, g): f(*args) for f in products], repeats)
        cells = [f"{t:.2f} ({gflop / t * 1e3:,.0f})" for t in times]
        table.add_row(f"{n_in} x {n_out}", *cells, f"{times[3] / times[2]:.2f}x")
    return table


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(784, 8192), nn.ReLU(), nn.Linear(8192, 10))


def _gpt() -> nn.Module:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from train_step import GPT_SIZE, GPTLogits  # the benchmark's GPT, at the size

    return GPTLogits(GPT_SIZE)


def _mlp_layers(model: nn.Module) -> list[nn.Linear]:
    return [model[0]]  # type: ignore[index]


def _gpt_layers(model: nn.Module) -> list[nn.Linear]:
    # the layers whose inputs are narrower than their outputs (x^T is the smaller copy)
    return [layer for b in model.blocks for layer in (b.attn.c_attn, b.mlp[0])]  # type: ignore[union-attr]


Model = tuple[Callable[[], nn.Module], Callable[[nn.Module], list[nn.Linear]], Callable[[], tuple]]
MODELS: dict[str, Model] = {
    "MLP 784-8192-10, b2048": (_mlp, _mlp_layers,
                               lambda: (torch.randn(2048, 784).to(BF16), torch.randint(0, 10, (2048,)))),
    "GPT d512 L4 H8 T128 V4096, b16": (_gpt, _gpt_layers,
                                       lambda: (torch.randint(0, 4096, (16, 128)),
                                                torch.randint(0, 4096, (16, 128)))),
}


def training_pass(name: str, layout: str) -> Callable[[], None]:
    """One compiled bf16 forward + backward of the model, with autograd's linear or column-major weights."""
    make, layers, batch = MODELS[name]
    torch.manual_seed(0)
    model = make().to(BF16)
    if layout == "column-major":
        for layer in layers(model):
            column_major(layer)
    compiled = torch.compile(model)
    x, y = batch()

    def step() -> None:
        out = compiled(x)
        F.cross_entropy(out.float().flatten(0, -2), y.flatten()).backward()  # the loss in fp32
        for p in model.parameters():
            p.grad = None

    return step


def model_table(repeats: int) -> Table:
    table = Table(title="compiled bf16 forward + backward (ms, median, round-robin)")
    for col in ("model", "autograd's linear", "column-major weights", "ratio"):
        table.add_column(col, justify="right")
    for name in MODELS:
        steps = [training_pass(name, layout) for layout in ("autograd", "column-major")]
        a, c = _round_robin_ms(steps, repeats)
        table.add_row(name, f"{a:.1f}", f"{c:.1f}", f"{c / a:.2f}x")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--tokens", type=int, default=2048, help="rows of x and g in the GEMM table")
    parser.add_argument("--gemms-only", action="store_true", help="skip the compiled models")
    args = parser.parse_args(argv)
    keep_freed_memory()  # no page faults per step, as train_step.py
    console = Console(width=150)
    console.print(hardware_line())
    console.print(load_line())
    console.print(gemm_table(args.tokens, args.repeats))
    if not args.gemms_only:
        console.print(model_table(args.repeats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
