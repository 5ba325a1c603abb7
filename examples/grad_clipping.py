"""Recipe: gradient clipping in mixed precision.

The gradients that backward leaves are multiplied by the loss scale (2**16 at first), so their norm is
2**16 times too large: clipping them against ``max_norm`` directly would clip every step by a factor the
scale invented. Unscale first, then clip what the optimizer will see:

* GradScaler: ``scaler.unscale_(opt)`` -> ``clip_grad_norm_(model.parameters())`` -> ``scaler.step(opt)``
  (``step`` knows the gradients are unscaled already and skips the step if one is inf/NaN; an inf norm
  is fine, the step is skipped anyway).
* opt levels: ``scale_loss`` unscales when its block exits; under O2 the optimizer updates fp32 masters, so
  clip ``mixprec.master_params(opt)``, not the fp16 model parameters.

Run:  python examples/grad_clipping.py --api scaler --precision fp16
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mixprec

MAX_NORM = 0.5  # below the typical gradient norm of this model, so most steps are really clipped


def setup(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, mixprec.DataBunch]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    data = mixprec.synthetic(n=320, input_shape=(16,), n_classes=4, batch_size=32, seed=seed)
    return model, opt, data


def train_scaler(half: bool, steps: int) -> dict[str, Any]:
    model, opt, data = setup()
    scaler = mixprec.GradScaler("cpu", enabled=half)  # disabled: every call below is a pass-through
    losses, norms = [], []
    for x, y in itertools.islice(itertools.cycle(data.train), steps):
        opt.zero_grad()
        with mixprec.autocast("cpu", torch.float16, enabled=half):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)  # the gradients now hold their true values
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        scaler.step(opt)  # does not unscale again; skips the step on inf/NaN
        scaler.update()
        losses.append(loss.item())
    return {"model": model, "losses": losses, "norms": norms}


def train_amp(half: bool, steps: int) -> dict[str, Any]:
    model, opt, data = setup()
    model, opt = mixprec.initialize(model, opt, opt_level="O2" if half else "O0", verbosity=0)
    losses, norms = [], []
    for x, y in itertools.islice(itertools.cycle(data.train), steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        with mixprec.scale_loss(loss, opt) as scaled_loss:
            scaled_loss.backward()
        # Unscaled on exit, into the fp32 masters under O2: clip the tensors the optimizer updates.
        norms.append(float(nn.utils.clip_grad_norm_(mixprec.master_params(opt), MAX_NORM)))
        opt.step()  # skipped if a gradient was inf/NaN
        losses.append(loss.item())
    mixprec.amp.reset()  # the run is over: another initialize in this process starts afresh, unwarned
    return {"model": model, "losses": losses, "norms": norms}


def main(api: str = "scaler", precision: str = "fp16", steps: int = 40) -> dict[str, Any]:
    """Train with clipping; returns the model, the losses and the pre-clipping gradient norms."""
    train = {"scaler": train_scaler, "amp": train_amp}[api]
    return train(precision == "fp16", steps)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--api", choices=["scaler", "amp"], default="scaler")
    parser.add_argument("--precision", choices=["fp16", "fp32"], default="fp16")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    result = main(args.api, args.precision, args.steps)
    clipped = sum(n > MAX_NORM for n in result["norms"])
    print(f"final loss {result['losses'][-1]:.4f}; {clipped}/{len(result['norms'])} steps clipped")
