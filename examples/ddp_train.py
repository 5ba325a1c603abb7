"""Recipe: DistributedDataParallel training in mixed precision.

    torchrun --nproc_per_node 2 examples/ddp_train.py --steps 30     # gloo on CPU, NCCL on GPUs
    python examples/ddp_train.py --steps 30                           # one process, same global batch

The mixed-precision part does not change under DDP: autocast around the forward, ``scaler.scale(loss)
.backward()``, ``scaler.step``, ``scaler.update``. DDP all-reduces (averages) the scaled gradients during
backward, so every rank holds the same gradients, finds the same inf/NaN, skips or takes the same step and
moves its scale the same way: an overflow on one rank makes every rank skip, with no extra collective.

Same global batch: ``DistributedSampler`` deals every ``world_size``-th sample of one seeded permutation
to each rank, so the ranks together see, at every step, the samples one process sees with
``batch = GLOBAL_BATCH``; the mean of the ranks' mean losses is the global mean loss.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import mixprec
from mixprec.distributed import DistInfo, setup, teardown
from mixprec.faults import inject_grad_faults

GLOBAL_BATCH = 64  # split evenly over the ranks


def dataset(seed: int) -> TensorDataset:
    data = mixprec.synthetic(n=640, input_shape=(16,), n_classes=4, valid_pct=0.1, seed=seed)
    x, y = data.train.dataset.tensors
    return TensorDataset(x, y)


def train(
    info: DistInfo, steps: int, seed: int = 0, fault_step: int = -1, fault_rank: int = 0
) -> dict[str, Any]:
    torch.manual_seed(seed)  # same initial weights everywhere (DDP would broadcast rank 0's anyway)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)).to(info.device)
    data = dataset(seed)
    sampler = DistributedSampler(
        data, num_replicas=info.world_size, rank=info.rank, shuffle=True, seed=seed, drop_last=True
    )
    loader = DataLoader(data, batch_size=GLOBAL_BATCH // info.world_size, sampler=sampler, drop_last=True)
    net = model
    if info.distributed:
        device_ids = [info.device.index] if info.device.type == "cuda" else None
        net = DistributedDataParallel(model, device_ids=device_ids)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    scaler = mixprec.GradScaler(info.device.type)
    if fault_step >= 0 and info.rank == fault_rank:  # an overflow on this rank only, at one step
        inject_grad_faults(model[0].weight, at={fault_step})
    losses: list[float] = []
    epoch = 0
    while len(losses) < steps:
        sampler.set_epoch(epoch)  # a new permutation per epoch, the same on every rank
        for x, y in loader:
            if len(losses) == steps:
                break
            opt.zero_grad()
            with mixprec.autocast(info.device.type, torch.float16):
                loss = F.cross_entropy(net(x.to(info.device)), y.to(info.device))
            scaler.scale(loss).backward()  # DDP all-reduces the scaled gradients here
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
        epoch += 1
    return {
        "rank": info.rank,
        "weights": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "losses": losses,
        "skipped_steps": scaler.skipped_steps,
        "scales": scaler.scale_history(),
    }


def global_mean(info: DistInfo, value: float) -> float:
    """The mean of ``value`` over the ranks: each rank's loss is that of its half of the global batch."""
    if not info.distributed:
        return value
    total = torch.tensor(value, dtype=torch.float64, device=info.device)
    torch.distributed.all_reduce(total)
    return total.item() / info.world_size


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="DDP mixed-precision training (run it with torchrun).")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fault-step", type=int, default=-1, help="inject an inf gradient at this step")
    parser.add_argument("--fault-rank", type=int, default=0, help="...on this rank only")
    parser.add_argument("--out", type=Path, help="write each rank's result to OUT/rank<r>.pt")
    args = parser.parse_args(argv)
    info = setup()
    try:
        result = train(info, args.steps, args.seed, args.fault_step, args.fault_rank)
        final = global_mean(info, result["losses"][-1])
    finally:
        teardown()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(result, args.out / f"rank{info.rank}.pt")
    if info.is_main:
        averaged = " (mean over the ranks: the global batch's)" if info.distributed else ""
        print(
            f"world {info.world_size} ({info.backend or 'single process'}): final loss "
            f"{final:.4f}{averaged}, "
            f"{result['skipped_steps']} skipped step(s), "
            f"scale {result['scales'][-1]:g}"
        )
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
