"""Recipe: gradient accumulation over N micro-batches in mixed precision.

One optimizer step per *effective* batch of N micro-batches:

* divide each micro-batch loss by N, so the accumulated gradient is the mean over the effective batch
  (as one big batch would give);
* scale every micro-batch loss with the same scale: the scale may change only at ``update()``, which runs
  once per effective batch, after ``step`` -- the accumulated gradients are all multiplied by one factor;
* unscale, check, step and update once per effective batch. An inf/NaN in *any* micro-batch is still in
  the accumulated sum, so the whole effective step is skipped; ``zero_grad`` afterwards (stepped or not)
  makes the next accumulation start clean.

With opt levels, ``scale_loss(..., delay_unscale=True)`` on all but the last micro-batch keeps the
gradients scaled while they accumulate; the last ``scale_loss`` unscales and checks the sum.

Run:  python examples/grad_accumulation.py --api scaler --precision fp16
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.faults import inject_grad_faults

ACCUM = 4  # micro-batches per optimizer step


def setup(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, mixprec.DataBunch]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    data = mixprec.synthetic(n=320, input_shape=(16,), n_classes=4, batch_size=16, seed=seed)
    return model, opt, data


def flat(model: nn.Module) -> torch.Tensor:
    return nn.utils.parameters_to_vector(model.parameters()).detach().float().clone()


def train_scaler(half: bool, steps: int, fault_micro: Iterable[int]) -> dict[str, Any]:
    model, opt, data = setup()
    scaler = mixprec.GradScaler("cpu", enabled=half)
    inject_grad_faults(model[0].weight, at=fault_micro)  # counts micro-batch backward passes
    history, skipped = [flat(model)], []
    micro = itertools.cycle(data.train)
    for step in range(steps):
        for _ in range(ACCUM):
            x, y = next(micro)
            with mixprec.autocast("cpu", torch.float16, enabled=half):
                loss = F.cross_entropy(model(x), y) / ACCUM  # mean over the effective batch
            scaler.scale(loss).backward()  # accumulates scaled gradients, all with the same scale
        scaler.step(opt)  # unscales the sum once; skips the whole effective step on inf/NaN
        scaler.update()  # the only place the scale changes
        opt.zero_grad()  # stepped or skipped: the next effective batch starts from zero
        history.append(flat(model))
        if scaler.last_step_skipped:
            skipped.append(step)
    return {"model": model, "history": history, "skipped": skipped, "scales": scaler.scale_history()}


def train_amp(half: bool, steps: int, fault_micro: Iterable[int]) -> dict[str, Any]:
    model, opt, data = setup()
    model, opt = mixprec.initialize(model, opt, opt_level="O2" if half else "O0", verbosity=0)
    inject_grad_faults(model[0].weight, at=fault_micro)
    history, skipped = [flat(model)], []
    micro = itertools.cycle(data.train)
    for step in range(steps):
        for i in range(ACCUM):
            x, y = next(micro)
            loss = F.cross_entropy(model(x), y) / ACCUM
            last = i == ACCUM - 1
            with mixprec.scale_loss(loss, opt, delay_unscale=not last) as scaled_loss:
                scaled_loss.backward()  # all but the last: gradients stay scaled and accumulate
        opt.step()  # skipped if the accumulated gradients held an inf/NaN
        opt.zero_grad()
        history.append(flat(model))
        if mixprec.amp.loss_scaler().last_step_skipped:
            skipped.append(step)
    mixprec.amp.reset()  # the run is over: another initialize in this process starts afresh, unwarned
    return {"model": model, "history": history, "skipped": skipped}


def main(
    api: str = "scaler", precision: str = "fp16", steps: int = 10, fault_micro: Iterable[int] = ()
) -> dict[str, Any]:
    """Train ``steps`` effective steps; ``fault_micro`` puts an inf into the gradient of those micro-batches
    (counted from 0). Returns the model, the flat weights after every step and the skipped steps."""
    train = {"scaler": train_scaler, "amp": train_amp}[api]
    return train(precision == "fp16", steps, fault_micro)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--api", choices=["scaler", "amp"], default="scaler")
    parser.add_argument("--precision", choices=["fp16", "fp32"], default="fp16")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--fault-micro", type=int, nargs="*", default=[5], help="micro-batches with an inf")
    args = parser.parse_args()
    result = main(args.api, args.precision, args.steps, args.fault_micro)
    print(f"skipped effective steps: {result['skipped']}")
