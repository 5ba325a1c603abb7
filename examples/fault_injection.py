"""Recipe: inject inf/NaN faults into a mixed-precision run and check that it survives them.

    python examples/fault_injection.py --grad-rate 0.05 --activation-rate 0.02

fp16 model, fp32 master weights, dynamic loss scaling, trained on the bundled digits. ``mixprec.faults``
puts an inf into one gradient element on ~5% of the steps and a NaN into one hidden activation on ~2%
(the NaN then reaches the loss and every gradient behind it). What must hold, and is checked here:

* every poisoned step is skipped, and nothing non-finite reaches the fp32 masters or Adam's moments;
* the scale backs off at each fault and grows back (``growth_interval`` clean steps later);
* the final accuracy is that of the clean run, give or take a sample or two.
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.faults import inject_activation_faults, inject_grad_faults, nonfinite_optimizer_state

GROWTH_INTERVAL = 10  # short, so the scale visibly grows back between faults in a run of a few hundred steps


def setup(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, mixprec.DataBunch]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    return model, opt, mixprec.digits(batch_size=32, flatten=True, seed=seed)


@torch.no_grad()
def accuracy(model: nn.Module, data: mixprec.DataBunch, dtype: torch.dtype) -> float:
    """Fraction of the validation set classified correctly."""
    model.eval()
    hits = sum(int((model(x.to(dtype)).argmax(1) == y).sum()) for x, y in data.valid)
    model.train()
    return hits / len(data.valid.dataset)


def main(
    grad_rate: float = 0.05,
    activation_rate: float = 0.02,
    epochs: int = 6,
    seed: int = 0,
    check_state: bool = True,
) -> dict[str, Any]:
    """Train with faults; returns accuracy, scale history, the steps that got faults, the steps skipped, and
    the steps after which the optimizer state held a non-finite value (must be none)."""
    model, opt, data = setup(seed)
    model.half()  # fp16 weights and gradients ...
    opt = mixprec.MasterWeights(opt)  # ... fp32 masters and fp32 Adam state
    scaler = mixprec.GradScaler("cpu", growth_interval=GROWTH_INTERVAL)
    # Annealed to zero: the final accuracy is that of a converged model, not of wherever the last step landed.
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs * len(data.train))
    grad_faults = inject_grad_faults(model[0].weight, rate=grad_rate, seed=seed + 1)
    act_faults = inject_activation_faults(model[1], rate=activation_rate, seed=seed + 2, kind="nan")
    skipped, corrupted, scales = [], [], []
    batches = itertools.chain.from_iterable(itertools.repeat(data.train, epochs))
    for step, (x, y) in enumerate(batches):
        opt.zero_grad()
        before = [p.detach().clone() for p in opt.param_groups[0]["params"]]
        with mixprec.half_compute("cpu", torch.float16):  # fp16 GEMMs at fp32's speed; the loss in fp32
            loss = F.cross_entropy(model(x.half()), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        scales.append(scaler.get_scale())
        after = opt.param_groups[0]["params"]
        if all(torch.equal(b, a) for b, a in zip(before, after, strict=True)):
            skipped.append(step)
        if check_state and nonfinite_optimizer_state(opt):
            corrupted.append(step)
    return {
        "accuracy": accuracy(model, data, torch.float16),
        "scales": scales,
        "faults": sorted(set(grad_faults.fired) | set(act_faults.fired)),
        "skipped": skipped,
        "corrupted": corrupted,
        "steps": step + 1,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grad-rate", type=float, default=0.05)
    parser.add_argument("--activation-rate", type=float, default=0.02)
    parser.add_argument("--epochs", type=int, default=6)
    args = parser.parse_args()
    clean = main(0.0, 0.0, args.epochs)
    faulty = main(args.grad_rate, args.activation_rate, args.epochs)
    print(f"clean accuracy {clean['accuracy']:.4f}; with faults {faulty['accuracy']:.4f}")
    print(f"{len(faulty['faults'])} faults, {len(faulty['skipped'])} skipped steps of {faulty['steps']}, "
          f"{len(faulty['corrupted'])} steps with non-finite optimizer state; "
          f"scale min {min(faulty['scales']):g}, final {faulty['scales'][-1]:g}")  # fmt: skip
