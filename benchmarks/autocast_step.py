"""Training-step time under autocast: fp32 vs torch.autocast vs mixprec.autocast, fp16 and bf16.

One step = zero_grad + forward (in the region) + cross-entropy + backward + SGD step. Reports the median
step time per configuration and the ratio to fp32. What to look for on a CPU:

* torch.autocast fp16 is many times *slower* than fp32 (torch's CPU fp16 GEMMs run at 0.3-57 GFLOP/s,
  depending on operand layout; the 3-layer MLP's backward hits the slow layout);
* mixprec.autocast fp16 emulates fp16 tensor-core GEMMs (fp16-rounded inputs, fp32 accumulation, fp16
  result) with fp32 GEMMs, so it should stay within 1.3x of fp32;
* mixprec.autocast bf16 with the default policy *is* torch.autocast bf16 plus one Python enter/exit per
  step, so its overhead should be within 5%.

Configurations are timed round-robin (one step of each in turn) so that load drift on a shared machine
hits all of them alike. torch.autocast fp16 is timed on its own, with few steps, because it is so slow.

    python benchmarks/autocast_step.py            # full run (a few minutes on 2 cores)
    python benchmarks/autocast_step.py --quick    # smoke run
    python benchmarks/autocast_step.py --compile  # each model under torch.compile, inside the region

With ``--compile`` the region stays eager around the compiled model (the way a training loop is usually
written); mixprec's regions and modes are cached per plan, so the compiled model is not recompiled per
step (issue 15 measured 1,203 ms/step for it before, against 94 ms for compiled fp32).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from mixprec import models
from mixprec.autocast import autocast as mixprec_autocast

Region = Callable[[], contextlib.AbstractContextManager[object]]


# ---- models: the package's, plus 3-layer MLPs whose backward hits torch's slow fp16 GEMM layout


def mlp3(n_hidden: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(784, n_hidden), nn.ReLU(), nn.Linear(n_hidden, n_hidden), nn.ReLU(), nn.Linear(n_hidden, 10)
    )


@dataclass(frozen=True)
class Workload:
    name: str
    make_model: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    n_classes: int


WORKLOADS = (
    Workload("mlp 784-8192-10, b512", lambda: models.mlp(784, 8192, 10), (512, 784), 10),
    Workload("mlp 784-1024-1024-10, b128", lambda: mlp3(1024), (128, 784), 10),
    Workload("mlp 784-2048-2048-10, b128", lambda: mlp3(2048), (128, 784), 10),
    Workload("simple_cnn (3,16,16,2), b64 3x32x32", models.simple_cnn, (64, 3, 32, 32), 2),
)


# ---- configurations -------------------------------------------------------------------------------------


def _region(factory: Callable[..., contextlib.AbstractContextManager[object]], dtype: torch.dtype) -> Region:
    return lambda: factory("cpu", dtype=dtype)


CONFIGS: dict[str, Region] = {
    "fp32": contextlib.nullcontext,
    "torch fp16": _region(torch.autocast, torch.float16),
    "mixprec fp16": _region(mixprec_autocast, torch.float16),
    "torch bf16": _region(torch.autocast, torch.bfloat16),
    "mixprec bf16": _region(mixprec_autocast, torch.bfloat16),
}
SLOW = {"torch fp16"}  # timed separately, few steps


class Trainer:
    """One model + optimizer + fixed batch per configuration (same initial weights for all)."""

    def __init__(
        self, workload: Workload, region: Region, state: dict[str, torch.Tensor], compile: bool = False
    ) -> None:
        self.model = workload.make_model()
        self.model.load_state_dict(state)
        self.forward: Callable[[torch.Tensor], torch.Tensor] = (
            torch.compile(self.model) if compile else self.model
        )
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(workload.input_shape, generator=gen)
        self.y = torch.randint(0, workload.n_classes, (workload.input_shape[0],), generator=gen)
        self.region = region

    def step(self) -> float:
        start = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        with self.region():
            loss = F.cross_entropy(self.forward(self.x), self.y)
        loss.backward()
        self.opt.step()
        return time.perf_counter() - start


def _round_robin(trainers: dict[str, Trainer], steps: int) -> Iterator[tuple[str, float]]:
    for _ in range(steps):
        for name, trainer in trainers.items():
            yield name, trainer.step()


def time_workload(
    workload: Workload, steps: int, slow_steps: int, warmup: int, compile: bool = False
) -> dict[str, float]:
    torch.manual_seed(0)
    state = workload.make_model().state_dict()
    trainers = {name: Trainer(workload, region, state, compile) for name, region in CONFIGS.items()}
    fast = {n: t for n, t in trainers.items() if n not in SLOW}
    slow = {n: t for n, t in trainers.items() if n in SLOW}
    for _ in range(warmup):
        for trainer in fast.values():
            trainer.step()
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for name, seconds in _round_robin(fast, steps):
        times[name].append(seconds)
    for trainer in slow.values():
        trainer.step()  # warm-up
    for name, seconds in _round_robin(slow, slow_steps):
        times[name].append(seconds)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _cell(seconds: float, base: float | None) -> str:
    return f"{seconds * 1e3:.1f}" + ("" if base is None else f" ({seconds / base:.2f}x)")


def report(results: dict[str, dict[str, float]], console: Console) -> None:
    table = Table(title="median training-step time on CPU (ms), and ratio to fp32 (lower is better)")
    table.add_column("model")
    for name in CONFIGS:
        table.add_column(name, justify="right")
    table.add_column("mixprec bf16 vs torch bf16", justify="right")
    for workload, medians in results.items():
        base = medians["fp32"]
        cells = [_cell(medians[n], None if n == "fp32" else base) for n in CONFIGS]
        overhead = medians["mixprec bf16"] / medians["torch bf16"] - 1
        table.add_row(workload, *cells, f"{overhead:+.1%}")
    console.print(table)
    console.print(
        "targets: mixprec fp16 within 1.3x of fp32 (torch fp16 shown for comparison); "
        "mixprec bf16 within 5% of torch bf16."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few steps and the smaller models only")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per configuration")
    parser.add_argument("--compile", action="store_true", help="torch.compile each model (region eager)")
    args = parser.parse_args(argv)
    if args.compile:
        # one compiled graph per (model instance, region): more than Dynamo's default 8 per code object
        torch._dynamo.config.cache_size_limit = 64
    steps = args.steps or (3 if args.quick else 15)
    slow_steps = 1 if args.quick else 3
    workloads = WORKLOADS[1:2] + WORKLOADS[3:] if args.quick else WORKLOADS
    console = Console(width=max(Console().width, 150))
    mode = "compiled models" if args.compile else "eager"
    threads = torch.get_num_threads()
    console.print(f"torch {torch.__version__}, {threads} threads; {steps} steps per config; {mode}")
    results = {}
    for workload in workloads:
        console.print(f"timing {workload.name} ...")
        warmup = 1 if args.quick else 3
        results[workload.name] = time_workload(workload, steps, slow_steps, warmup, args.compile)
    report(results, console)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
