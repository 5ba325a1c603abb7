"""Recipe: a gradient penalty (the norm of the gradients added to the loss) in mixed precision.

The penalty needs the gradients as a differentiable graph: ``torch.autograd.grad(..., create_graph=True)``.
Take them from the *scaled* loss, so small fp16 gradients do not underflow in this first backward either,
then multiply them by 1/scale (out of place: they are part of the graph) before computing the penalty.
The penalty itself is ordinary forward math: compute it under autocast like the rest of the loss. Then
scale the total loss and run the usual backward / step / update; an inf in the first gradients makes the
penalty inf, the final gradients inf, and the step is skipped.

With opt levels: ``scale_loss(loss, opt, delay_unscale=True)`` yields the scaled loss for
``autograd.grad`` without touching ``.grad``; the scale to divide by is
``mixprec.amp.loss_scaler().get_scale()`` (with a model per ``initialize`` call, a GAN's critic and its
generator: ``loss_scaler(optimizer=critic_opt)``, the critic's call's, not the latest). Under O2 (and
``to_fp16()``) the gradients ``autograd.grad`` returns are the half model's dtype: upcast them before
multiplying by 1/scale, or the small ones fall below fp16's range again (a user trial: 44% of a
penalty's squared terms were zeros computed in fp16).

Run:  python examples/grad_penalty.py --api amp --opt-level O2 --precision fp16
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mixprec

PENALTY = 0.1  # weight of the gradient-norm penalty


def setup(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, mixprec.DataBunch]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))  # tanh: a smooth double backward
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    data = mixprec.synthetic(n=320, input_shape=(16,), n_classes=4, batch_size=32, seed=seed)
    return model, opt, data


def grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    # Squares summed in fp32: a sum of squared gradients can leave fp16's range where the gradients did not.
    return torch.stack([g.float().pow(2).sum() for g in grads]).sum().sqrt()


def train_scaler(half: bool, steps: int) -> dict[str, Any]:
    model, opt, data = setup()
    scaler = mixprec.GradScaler("cpu", enabled=half)
    params = list(model.parameters())
    losses, penalties = [], []
    for x, y in itertools.islice(itertools.cycle(data.train), steps):
        opt.zero_grad()
        with mixprec.autocast("cpu", torch.float16, enabled=half):
            loss = F.cross_entropy(model(x), y)
        scaled_grads = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)
        inv_scale = 1.0 / scaler.get_scale()  # a Python float: a constant in the graph (syncs once)
        grads = [g * inv_scale for g in scaled_grads]  # out of place: keep the graph (fp32 gradients here)
        with mixprec.autocast("cpu", torch.float16, enabled=half):
            penalty = grad_norm(grads)
            total = loss + PENALTY * penalty
        scaler.scale(total).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
        penalties.append(penalty.item())
    return {"model": model, "losses": losses, "penalties": penalties}


def train_amp(half: bool, steps: int, opt_level: str = "O1") -> dict[str, Any]:
    model, opt, data = setup()
    model, opt = mixprec.initialize(model, opt, opt_level=opt_level if half else "O0", verbosity=0)
    params = list(model.parameters())
    losses, penalties = [], []
    for x, y in itertools.islice(itertools.cycle(data.train), steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        with mixprec.scale_loss(loss, opt, delay_unscale=True) as scaled_loss:
            scaled_grads = torch.autograd.grad(scaled_loss, params, create_graph=True)
        inv_scale = 1.0 / mixprec.amp.loss_scaler().get_scale()
        # fp32 before 1/scale: under O2 the gradients are fp16, like the half parameters they belong to
        grads = [g.float() * inv_scale for g in scaled_grads]
        with mixprec.autocast("cpu", torch.float16, enabled=half):  # apex's O1 patched these ops too
            penalty = grad_norm(grads)
            total = loss + PENALTY * penalty
        with mixprec.scale_loss(total, opt) as scaled_total:
            scaled_total.backward()
        opt.step()
        losses.append(loss.item())
        penalties.append(penalty.item())
    mixprec.amp.reset()  # the run is over: another initialize in this process starts afresh, unwarned
    return {"model": model, "losses": losses, "penalties": penalties}


def main(
    api: str = "scaler", precision: str = "fp16", steps: int = 30, opt_level: str = "O1"
) -> dict[str, Any]:
    """Train with a gradient penalty; returns the model, the losses and the penalties. ``opt_level`` is
    for ``api="amp"``."""
    if api == "amp":
        return train_amp(precision == "fp16", steps, opt_level)
    return train_scaler(precision == "fp16", steps)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--api", choices=["scaler", "amp"], default="scaler")
    parser.add_argument("--precision", choices=["fp16", "fp32"], default="fp16")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--opt-level", choices=["O1", "O2"], default="O1", help="with --api amp")
    args = parser.parse_args()
    result = main(args.api, args.precision, args.steps, args.opt_level)
    print(f"final loss {result['losses'][-1]:.4f}, final penalty {result['penalties'][-1]:.4f}")
