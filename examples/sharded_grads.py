"""Recipe: mixed precision with sharded gradients -- all-reduce the scaler's inf flags.

    python examples/sharded_grads.py          # spawns 2 local processes (gloo, 127.0.0.1)

Under DDP every rank all-reduces every gradient, so every rank sees every inf. Here, as in ZeRO-style
sharded optimizers, each rank *owns* a shard of the parameters: a gradient is reduced to its owner only,
the owner steps it, then broadcasts the new value. ``scaler.step`` then checks the owner's shard alone:
an overflow in rank 1's shard is invisible to rank 0. Without ``sync_found_inf`` rank 0 steps while
rank 1 skips, rank 1 halves its scale while rank 0 keeps its own, and from then on the ranks scale
their losses differently and sum gradients of different scales: training silently diverges from the
single-process run. ``GradScaler(..., sync_found_inf=True)`` all-reduces the inf flags (one small
collective per step) so every rank skips together and the scales stay equal.

(FSDP2's ``fully_shard`` does not need it: its gradients are DTensors, and torch's DTensor dispatcher
already all-reduces the found-inf flag of ``_amp_foreach_non_finite_check_and_unscale_``.)
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.distributed import DistInfo, launch
from mixprec.faults import inject_grad_faults

GLOBAL_BATCH = 64
FAULT_PARAM = 1  # index of the parameter whose gradient overflows; owned by rank 1 of 2 (round-robin)


def batch(step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one step, the same on every rank."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    x = torch.randn(GLOBAL_BATCH, 16, generator=g)
    return x, (x[:, :4] - x[:, 4:8]).argmax(1)


def train(info: DistInfo, steps: int, sync: bool, fault_step: int = -1, seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    params = list(model.parameters())
    owner = [i % info.world_size for i in range(len(params))]  # round-robin shards
    mine = [p for p, o in zip(params, owner, strict=True) if o == info.rank]
    opt = torch.optim.SGD(mine, lr=0.1, momentum=0.9)
    scaler = mixprec.GradScaler("cpu", sync_found_inf=sync)
    if fault_step >= 0 and owner[FAULT_PARAM] == info.rank:  # an overflow in this rank's shard only
        inject_grad_faults(params[FAULT_PARAM], at={fault_step})
    for step in range(steps):
        x, y = batch(step, seed)
        x, y = x[info.rank :: info.world_size], y[info.rank :: info.world_size]  # this rank's part
        model.zero_grad()
        with mixprec.autocast("cpu", torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        if info.distributed:
            for p, o in zip(params, owner, strict=True):
                dist.reduce(p.grad, dst=o)  # only the owner receives the summed gradient
                p.grad.div_(info.world_size)
        scaler.step(opt)  # checks the gradients of this rank's shard only (plus the all-reduce if sync)
        scaler.update()
        if info.distributed:
            for p, o in zip(params, owner, strict=True):
                dist.broadcast(p.data, src=o)
    return {
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "scales": scaler.scale_history(),
        "skipped_steps": scaler.skipped_steps,
    }


def compare(info: DistInfo, steps: int, fault_step: int) -> dict[bool, dict[str, Any]]:
    """One process group, both variants: with and without ``sync_found_inf``."""
    return {sync: train(info, steps, sync, fault_step) for sync in (True, False)}


def main(steps: int = 12, fault_step: int = 4, world_size: int = 2) -> dict[str, Any]:
    """Per-rank results of both variants, and the single-process run over the same global batches."""
    per_rank = launch(compare, world_size, (steps, fault_step))
    single = train(DistInfo(0, 1, 0, torch.device("cpu"), None), steps, sync=False, fault_step=fault_step)
    return {"ranks": per_rank, "single": single}


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Sharded gradients with and without sync_found_inf.")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--fault-step", type=int, default=4, help="the step with an inf on rank 1")
    p.add_argument("--world-size", type=int, default=2, help="local processes (gloo on CPU)")
    return p.parse_args(argv)


if __name__ == "__main__":
    cli_args = parse()
    result = main(cli_args.steps, cli_args.fault_step, cli_args.world_size)
    for sync in (True, False):
        scales = [r[sync]["scales"][-1] for r in result["ranks"]]
        diff = max(
            (r[sync]["weights"][k] - result["single"]["weights"][k]).abs().max().item()
            for r in result["ranks"] for k in r[sync]["weights"]
        )  # fmt: skip
        print(f"sync_found_inf={sync}: final scale per rank {scales}; max |w - single process| {diff:.2e}")
