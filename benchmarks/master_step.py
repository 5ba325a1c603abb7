"""One master-weight AdamW step over >= 10M bf16 parameters against torch's AdamW over the same parameters
in fp32, fused (``fused=True``, the best torch offers) and foreach, timed side by side in one run.

What each moves per parameter (bytes, read + written):
  torch fused fp32     weight 4+4, grad 4, two moments 8+8                                   = 28, one pass
  torch foreach fp32   the same data, ~10 passes over memory
  torch fused + scaler torch.amp's fp16 recipe: the fused step, after torch's GradScaler checks the fp32
                       grads for inf/NaN (writing them back: 4+4); also behind mixprec's GradScaler, the
                       drop-in (its native check reads them only: 4)
  MasterWeights        bf16 grad -> fp32 master grad (2+4), fused kernel (28), master -> bf16 weight (4+2)
                       = 40, three passes; plus the scaler's inf check of the fp32 grads (4)
  master_grads=False   per 256K-element chunk: bf16 grad read (2), upcast into a 1 MiB scratch,
                       fused kernel on the chunk (24 + scratch from cache), bf16 weight written (2)
                       = ~30, one pass over memory; plus the scaler's inf check of the bf16 grads (2)
  compile_step=True    one compiled loop: bf16 grad (2), master, moments (12 + 12), bf16 weight (2)
                       = 28, one pass; plus the scaler's inf check (2) when a scaler is used
  split, native        LowPrecisionOptimizer(AdamW, "split"): the fp32 master held as the bf16 weight
                       plus an int16 low half (14 B/param in all); one native loop (mixprec/split_adam.c):
                       bf16 grad (2), both halves (4 + 4), moments (8 + 8) = 26, one pass
  split, generic       the same masters, stepped by rebuilding fp32 copies per chunk: several passes
The target: the master step no slower than torch's fused fp32 AdamW (ratio <= 1.0). Rows behind a
GradScaler are also compared with torch's fused step behind torch's own GradScaler ("same scaling").

Configurations are timed round-robin (one step of each in turn, ``--repeats`` rounds): load drift on a
shared machine hits all of them alike. Medians.

    python benchmarks/master_step.py [--params 13e6] [--repeats 15] [--device cpu] [--threads 1]
    python benchmarks/master_step.py --small-model --threads 1 --repeats 300   # host time per step

``--small-model`` steps the 52 tensors of a 4-layer d-32 GPT (~53K parameters) instead: the
arithmetic is nothing, so the step time is host time (Python, dispatch, Dynamo's guards, launches), what a
small model on a GPU pays per step whatever the GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from rich.console import Console
from rich.table import Table

from mixprec.hardware import hardware_line, load_line, synchronize
from mixprec.low_precision import LowPrecisionOptimizer
from mixprec.master import MasterWeights
from mixprec.scaler import GradScaler

# The gradients are set by hand, with no forward (here and in low_precision_step.py, which imports this):
# the optimizers' warning about a forward outside every mixprec region (outside_region.py) does not apply.
warnings.filterwarnings("ignore", message=".*outside any mixprec region")

Step = Callable[[], None]


def _shapes(n_params: float) -> list[tuple[int, ...]]:
    """A transformer-ish mix of matrices and vectors adding up to about n_params."""
    shapes: list[tuple[int, ...]] = []
    while sum(torch.Size(s).numel() for s in shapes) < n_params:
        shapes += [(1024, 1024), (4096, 1024), (1024, 4096), (1024,), (4096,), (1024,)]
    return shapes


def _small_model_shapes() -> list[tuple[int, ...]]:
    """The parameters of a 4-layer GPT with d 32 (vocab 64, context 16): 52 tensors."""
    d = 32
    layer = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,),  # norm, attention
             (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]  # norm, MLP
    return [(64, d), (16, d), *layer * 4, (d,), (d,)]  # embeddings, blocks, final norm


def _params(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: str) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=g).to(device, dtype))
        p.grad = (torch.randn(s, generator=g) * 1e-3).to(device, dtype)
        params.append(p)
    return params


def _torch_step(shapes: list[tuple[int, ...]], device: str, scaled: bool = False,
                scaler_class: type = torch.amp.GradScaler, **impl: bool) -> Step:
    """torch's AdamW on fp32 parameters; with ``scaled``, stepped by torch.amp's own GradScaler, as in
    torch.amp's fp16 recipe (the scaler checks the fp32 gradients for inf/NaN, the fused kernel unscales),
    or by ``scaler_class`` in its place (mixprec's drop-in)."""
    opt = torch.optim.AdamW(_params(shapes, torch.float32, device), lr=1e-3, **impl)
    if not scaled:
        return lambda: opt.step()  # the gradients stay: every step reads the same ones
    scaler = scaler_class(device, init_scale=1.0, growth_interval=10**9)
    dummy = torch.ones((), requires_grad=True, device=device)

    def step() -> None:
        scaler.scale(dummy).backward()
        scaler.step(opt)
        scaler.update()

    return step


def _master_step(
    shapes: list[tuple[int, ...]], device: str, flat: bool, master_grads: bool, compile_step: bool = False,
    scaled: bool = True,
) -> Step:
    """What a training step does after backward: scaler checks/unscales, fused update, copy back. Without
    ``scaled``, the update alone: what bf16 O2 runs when no loss scaling (and no inf check) is used."""
    half = _params(shapes, torch.bfloat16, device)  # the model's parameters (bf16 here, fp16 steps alike)
    opt = MasterWeights(
        torch.optim.AdamW(half, lr=1e-3), flat=flat, master_grads=master_grads, compile_step=compile_step
    )
    if not scaled:
        return lambda: opt.step()
    scaler = GradScaler(device, init_scale=1.0, dynamic=False)
    dummy = torch.ones((), requires_grad=True, device=device)  # scale() needs a tensor; its grad is free

    def step() -> None:
        scaler.scale(dummy).backward()
        scaler.step(opt)
        scaler.update()

    return step


def _split_step(shapes: list[tuple[int, ...]], device: str, kernel: str) -> Step:
    """The split fp32 masters (bf16 weight + int16 low half) stepped by AdamW, no scaler (bf16 needs none)."""
    opt = LowPrecisionOptimizer(torch.optim.AdamW(_params(shapes, torch.bfloat16, device), lr=1e-3), "split",
                                kernel=kernel)
    return lambda: opt.step()


def _round_robin(steps: dict[str, Step], repeats: int, device: str) -> dict[str, float]:
    """Median ms per configuration, one step of each in turn per round (after one warm-up round)."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(repeats + 1):
        for name, step in steps.items():
            synchronize(device)
            t0 = time.perf_counter()
            step()
            synchronize(device)
            if r:  # round 0 allocates optimizer state
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--params", type=float, default=13e6,
                        help="number of parameters, >= 10M; rounded up to whole blocks of 9.4M")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch's CPU threads (default: torch's); 1 is a control on a shared machine, "
                             "where a neighbour slows multi-threaded kernels far more than one-thread ones")
    parser.add_argument("--small-model", action="store_true",
                        help="52 small tensors (a d-32 transformer): time the host's share of a step")
    args = parser.parse_args()
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads {args.threads}: at least 1")
        torch.set_num_threads(args.threads)
    if args.params < 10e6 and not args.small_model:
        parser.error(f"--params {args.params:g}: at least 10e6, so that the tensors do not fit in the caches "
                     "and the step is timed against memory, as training a real model is.")
    shapes = _small_model_shapes() if args.small_model else _shapes(args.params)
    n = sum(torch.Size(s).numel() for s in shapes)
    dev = args.device
    steps = {
        "torch AdamW(fused=True), fp32 params": _torch_step(shapes, dev, fused=True),
        "torch AdamW(foreach=True), fp32 params": _torch_step(shapes, dev, foreach=True),
        "torch AdamW(fused=True), fp32 params + torch GradScaler": _torch_step(shapes, dev, True, fused=True),
        # the drop-in itself: the same optimizer behind mixprec's GradScaler (no master weights)
        "torch AdamW(fused=True), fp32 params + mixprec GradScaler": _torch_step(
            shapes, dev, True, GradScaler, fused=True),
        "MasterWeights(AdamW) + GradScaler": _master_step(shapes, dev, False, True),
        "MasterWeights(AdamW, flat=True) + GradScaler": _master_step(shapes, dev, True, True),
        "MasterWeights(AdamW, master_grads=False) + GradScaler": _master_step(shapes, dev, False, False),
        "MasterWeights(AdamW, flat=True, master_grads=False) + GradScaler": _master_step(
            shapes, dev, True, False),
        "MasterWeights(AdamW, master_grads=False, compile_step=True) + GradScaler": _master_step(
            shapes, dev, False, False, compile_step=True),
        "MasterWeights(AdamW, master_grads=False, compile_step=True), no scaler (bf16 needs none)":
            _master_step(shapes, dev, False, False, compile_step=True, scaled=False),
    }
    if dev == "cpu":  # the native split step is a CPU loop
        steps["split masters (bf16 + int16 low half), native one-pass step, no scaler"] = _split_step(
            shapes, dev, "native")
        steps["split masters (bf16 + int16 low half), generic step, no scaler"] = _split_step(
            shapes, dev, "generic")
    ms = _round_robin(steps, args.repeats, dev)
    fused, foreach = ms["torch AdamW(fused=True), fp32 params"], ms["torch AdamW(foreach=True), fp32 params"]
    fused_scaled = ms["torch AdamW(fused=True), fp32 params + torch GradScaler"]
    # like for like: a step behind a scaler against torch's fused step behind torch's scaler
    alike = {label: t / (fused if _unscaled(label) else fused_scaled) for label, t in ms.items()}
    size = (f"{len(shapes)} tensors, {n / 1e3:.0f}K parameters" if args.small_model
            else f"{n / 1e6:.1f}M parameters")
    table = Table(title=f"One AdamW step over {size} on {dev} (median of {args.repeats}, round-robin)")
    for column in ("step", "ms", "vs fused fp32", "vs fused fp32, same scaling", "vs foreach fp32"):
        table.add_column(column, justify="left" if column == "step" else "right")
    for label, t in ms.items():
        table.add_row(label, f"{t:.2f}", f"{t / fused:.2f}x", f"{alike[label]:.2f}x", f"{t / foreach:.2f}x")
    console = Console(width=160)  # wide enough for the labels when printed to a file
    console.print(hardware_line())
    console.print(load_line())
    console.print(table)
    best = min(t for label, t in ms.items() if label.startswith(("MasterWeights", "split"))) / fused
    if args.small_model:  # the target is for a model that streams through memory, not this one
        print(f"host time: best master step / torch fused fp32 AdamW = {best:.2f}")
    else:
        verdict = "meets" if best <= 1.0 else "MISSES"
        print(f"best master step / torch fused fp32 AdamW = {best:.2f}: {verdict} the target <= 1.0")
    ours = [r for label, r in alike.items() if label.startswith(("MasterWeights", "split"))
            and not _unscaled(label)]
    scaled = min(ours)
    print(f"best master step + GradScaler / torch fused fp32 AdamW + torch's GradScaler = {scaled:.2f}")


def _unscaled(label: str) -> bool:
    """Rows stepped without a GradScaler: every row with one says so in its label."""
    return "GradScaler" not in label


if __name__ == "__main__":
    main()
