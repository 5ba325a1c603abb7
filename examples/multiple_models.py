"""Recipe: several models, losses and optimizers in mixed precision.

Two models, two losses that each depend on both models' outputs, one optimizer per model:

* one ``GradScaler`` for all of them: every loss is scaled by the same factor, so the gradients they
  accumulate into a shared parameter add up consistently;
* ``scaler.step(opt)`` per optimizer: each optimizer checks *its own* gradients and skips on its own (an
  overflow in model 1's gradients skips optimizer 1 only);
* ``scaler.update()`` once per iteration, after every optimizer stepped: the scale backs off if any of
  them saw an inf/NaN.

With opt levels (apex's way): ``initialize([m0, m1], [opt0, opt1], num_losses=2)`` and one ``scale_loss``
per loss, each naming the optimizers its backward reaches and its own ``loss_id`` (one scaler per loss).
Skipping follows apex there: when a loss overflowed, every optimizer named in its ``scale_loss`` skips its
next step, whichever model's gradients held the inf.

Run:  python examples/multiple_models.py --api scaler --precision fp16
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.faults import inject_grad_faults


def setup(seed: int = 0) -> tuple[list[nn.Module], list[torch.optim.Optimizer], mixprec.DataBunch]:
    torch.manual_seed(seed)
    models = [nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)) for _ in range(2)]
    opts: list[torch.optim.Optimizer] = [
        torch.optim.SGD(models[0].parameters(), lr=0.02, momentum=0.9),
        torch.optim.Adam(models[1].parameters(), lr=1e-3),
    ]
    data = mixprec.synthetic(n=320, input_shape=(16,), n_classes=4, batch_size=32, seed=seed)
    return models, opts, data


def losses_of(out0: torch.Tensor, out1: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return F.cross_entropy(2 * out0 + 3 * out1, y), F.cross_entropy(3 * out0 - 5 * out1, y)


def flat(model: nn.Module) -> torch.Tensor:
    return nn.utils.parameters_to_vector(model.parameters()).detach().float().clone()


def train_scaler(half: bool, steps: int, fault_at: Iterable[int]) -> dict[str, Any]:
    (m0, m1), (opt0, opt1), data = setup()
    scaler = mixprec.GradScaler("cpu", enabled=half)
    # Two backward passes reach model 1 per iteration: iteration k is passes 2k and 2k+1.
    inject_grad_faults(m1[0].weight, at={2 * k for k in fault_at})
    history, losses = [(flat(m0), flat(m1))], []
    for x, y in itertools.islice(itertools.cycle(data.train), steps):
        opt0.zero_grad()
        opt1.zero_grad()
        with mixprec.autocast("cpu", torch.float16, enabled=half):
            loss0, loss1 = losses_of(m0(x), m1(x), y)
        scaler.scale(loss0).backward(retain_graph=True)
        scaler.scale(loss1).backward()
        scaler.step(opt0)  # checks model 0's gradients only
        scaler.step(opt1)  # checks model 1's gradients only
        scaler.update()  # once: backs off if either optimizer saw inf/NaN
        history.append((flat(m0), flat(m1)))
        losses.append((loss0.item(), loss1.item()))
    return {"models": [m0, m1], "history": history, "losses": losses, "scales": scaler.scale_history()}


def train_amp(half: bool, steps: int, fault_at: Iterable[int]) -> dict[str, Any]:
    models, opts, data = setup()
    (m0, m1), (opt0, opt1) = mixprec.initialize(
        models, opts, opt_level="O2" if half else "O0", num_losses=2, verbosity=0
    )
    inject_grad_faults(m1[0].weight, at={2 * k for k in fault_at})
    history, losses = [(flat(m0), flat(m1))], []
    for x, y in itertools.islice(itertools.cycle(data.train), steps):
        opt0.zero_grad()
        opt1.zero_grad()
        loss0, loss1 = losses_of(m0(x), m1(x), y)
        with mixprec.scale_loss(loss0, [opt0, opt1], loss_id=0) as scaled:
            scaled.backward(retain_graph=True)
        with mixprec.scale_loss(loss1, [opt0, opt1], loss_id=1) as scaled:
            scaled.backward()
        opt0.step()  # both skip when either loss overflowed (apex's rule)
        opt1.step()
        history.append((flat(m0), flat(m1)))
        losses.append((loss0.item(), loss1.item()))
    mixprec.amp.reset()  # the run is over: another initialize in this process starts afresh, unwarned
    return {"models": [m0, m1], "history": history, "losses": losses}


def main(
    api: str = "scaler", precision: str = "fp16", steps: int = 30, fault_at: Iterable[int] = ()
) -> dict[str, Any]:
    """Train both models; ``fault_at`` puts an inf into model 1's gradient at those iterations. Returns the
    models, both models' flat weights after every iteration and the losses."""
    train = {"scaler": train_scaler, "amp": train_amp}[api]
    return train(precision == "fp16", steps, fault_at)


# The iteration with an injected inf by default: fp16 only. In fp32 the scaler API runs a disabled scaler
# (GradScaler(enabled=False), torch.amp's way to keep one loop for every precision), which checks nothing,
# so an inf gradient is applied and every loss after it is NaN. O0 keeps apex's static scale of 1 and
# its inf check, so it would skip; the fp32 run is the reference without faults either way.
DEFAULT_FAULTS = {"fp16": [3], "fp32": []}


def cli(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--api", choices=["scaler", "amp"], default="scaler")
    parser.add_argument("--precision", choices=["fp16", "fp32"], default="fp16")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--fault-at", type=int, nargs="*", default=None,
                        help="iterations with an inf in model 1's gradient (default: 3 in fp16, none in "
                        "fp32)")
    args = parser.parse_args(argv)
    faults = DEFAULT_FAULTS[args.precision] if args.fault_at is None else args.fault_at
    if faults and args.precision == "fp32" and args.api == "scaler":
        print("note: a disabled GradScaler (fp32) skips nothing: the injected inf reaches the weights")
    result = main(args.api, args.precision, args.steps, faults)
    print(f"final losses {result['losses'][-1]}")
    return result


if __name__ == "__main__":
    cli()
