"""One master-weight AdamW step over >= 10M bf16 parameters vs torch's foreach AdamW over the same
parameters in fp32, timed side by side in one run.

Both move about 28 bytes per parameter (fp32 weight, grad, two moments read, three written; the master
path adds the bf16 grad read and the bf16 weight write). Torch's foreach AdamW makes ~10 passes over
memory; mixprec's master step copies grads (one pass), runs torch's fused AdamW kernel on the fp32
masters (one pass) and copies back (one pass). The target: the master step is no slower than plain fp32.

    .venv/bin/python benchmarks/master_step.py [--params 13e6] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from rich.console import Console
from rich.table import Table

from mixprec.master import MasterWeights
from mixprec.scaler import GradScaler


def _shapes(n_params: float) -> list[tuple[int, ...]]:
    """A transformer-ish mix of matrices and vectors adding up to about n_params."""
    shapes: list[tuple[int, ...]] = []
    while sum(torch.Size(s).numel() for s in shapes) < n_params:
        shapes += [(1024, 1024), (4096, 1024), (1024, 4096), (1024,), (4096,), (1024,)]
    return shapes


def _params(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=g).to(dtype))
        p.grad = torch.randn(s, generator=g).to(dtype) * 1e-3
        params.append(p)
    return params


def _median_ms(step: Callable[[], None], repeats: int) -> float:
    step()  # warm-up: allocates optimizer state
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _keep_grads(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad for p in params]  # type: ignore[misc]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--params", type=float, default=13e6, help="number of parameters (>= 10M)")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    shapes = _shapes(args.params)
    n = sum(torch.Size(s).numel() for s in shapes)

    fp32 = _params(shapes, torch.float32)
    plain = torch.optim.AdamW(fp32, lr=1e-3, foreach=True)

    rows = [("torch AdamW(foreach) on fp32 params", _median_ms(plain.step, args.repeats))]

    for flat in (False, True):
        half = _params(shapes, torch.bfloat16)
        grads = _keep_grads(half)
        opt = MasterWeights(torch.optim.AdamW(half, lr=1e-3), flat=flat)
        scaler = GradScaler("cpu", init_scale=1.0, dynamic=False)
        dummy = torch.ones((), requires_grad=True)

        def master_step(
            opt: MasterWeights = opt, scaler: GradScaler = scaler, grads: list = grads, dummy=dummy
        ) -> None:
            # what a training step does after backward: copy+unscale+check, fused update, copy back
            for p, g in zip(opt.model_params(), grads, strict=True):
                p.grad = g
            scaler.scale(dummy).backward()
            scaler.step(opt)
            scaler.update()

        label = f"mixprec MasterWeights(AdamW, flat={flat}) on bf16 params + GradScaler"
        rows.append((label, _median_ms(master_step, args.repeats)))

    base = rows[0][1]
    table = Table(title=f"One AdamW step over {n / 1e6:.1f}M parameters (median of {args.repeats}, "
                  f"{torch.get_num_threads()} threads)")
    table.add_column("step")
    table.add_column("ms", justify="right")
    table.add_column("vs fp32 foreach", justify="right")
    for label, ms in rows:
        table.add_row(label, f"{ms:.1f}", f"{ms / base:.2f}x")
    Console().print(table)
    worst = max(ms for _, ms in rows[1:]) / base
    verdict = "meets" if worst <= 1.0 else "MISSES"
    print(f"master step / fp32 step = {worst:.2f} (slowest layout): {verdict} the target <= 1.0")


if __name__ == "__main__":
    main()
