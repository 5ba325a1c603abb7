"""Activation checkpointing and torch.compile under an emulated mixprec region: where the checkpoint goes.

Two checkpointed MLP blocks (512-2048-512, batch 256), bf16 ``mixprec.autocast``, one thread: eager
checkpoints; the loop compiled with the checkpoints inside (Dynamo traces the checkpointed body without
the region's torch-function mode: torch's half kernels); compiled blocks checkpointed eagerly with
``context_fn=mixprec.checkpoint_context`` (the recipe in docs/recipes.md). Median ms per step after two
warm-up steps, each variant in turn in one process.

    python benchmarks/compiled_checkpoint.py [--steps 4]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import mixprec
from mixprec.hardware import hardware_line

Step = Callable[[torch.Tensor], torch.Tensor]


def _blocks() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(
        nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)) for _ in range(2)
    )


def variants(blocks: nn.ModuleList) -> dict[str, Step]:
    def eager(x: torch.Tensor) -> torch.Tensor:
        for block in blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x

    compiled_blocks = [torch.compile(block) for block in blocks]

    def compiled_then_checkpointed(x: torch.Tensor) -> torch.Tensor:
        for block in compiled_blocks:
            x = checkpoint(block, x, use_reentrant=False, context_fn=mixprec.checkpoint_context)
        return x

    return {
        "eager checkpoints": eager,
        "compiled loop, checkpoints inside": torch.compile(eager),
        "compiled blocks, eager checkpoints + checkpoint_context": compiled_then_checkpointed,
    }


def time_step(step: Step, x: torch.Tensor) -> float:
    start = time.perf_counter()
    with mixprec.autocast("cpu", torch.bfloat16):
        y = step(x)
    y.float().square().mean().backward()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"hardware: {hardware_line()}")
    x = torch.randn(256, 512)
    for name, step in variants(_blocks()).items():
        times = [time_step(step, x) for _ in range(args.steps + 2)][2:]
        print(f"{name:58s} {statistics.median(times):8.1f} ms/step (median of {len(times)})")


if __name__ == "__main__":
    main()
