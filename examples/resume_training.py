"""Recipe: checkpoint a mixed-precision run and resume it exactly after a crash.

    python examples/resume_training.py --ckpt runs/resume/last.pt --steps 60 --every 10
    python examples/resume_training.py --ckpt runs/resume/last.pt --steps 60 --every 10 --resume

fp16 model + fp32 master weights (``MasterWeights`` around AdamW) + dynamic loss scaling + a one-cycle
LR schedule + dropout + shuffled data + injected overflows. ``save_checkpoint`` stores every piece of state
that decides the next step: weights, fp32 masters, Adam moments, the loss scale and its counters, the
schedule, the RNGs (dropout), and the data position (``ResumableLoader``: epoch, batch, shuffle
generator). Resumed from its last checkpoint, a run killed at any point ends with the same bits as a run
that was never interrupted. Checkpoints are written atomically: a kill during the write leaves the
previous one whole.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.checkpoint import ResumableLoader, load_checkpoint, save_checkpoint
from mixprec.faults import inject_grad_faults


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train, checkpoint every k steps, resume exactly.")
    p.add_argument("--ckpt", type=Path, required=True, help="checkpoint file (replaced atomically)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10, help="checkpoint every EVERY steps")
    p.add_argument("--resume", action="store_true", help="continue from --ckpt if it exists")
    p.add_argument("--out", type=Path, help="write the final weights and masters here")
    p.add_argument("--fault-rate", type=float, default=0.05, help="fraction of steps with an inf gradient")
    p.add_argument("--delay", type=float, default=0.0, help="seconds to sleep per step (to be killed)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    for path in (args.ckpt, args.out):  # as docs/recipes.md gives it, on a fresh checkout: no run/ yet
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
    # The CPU GEMMs' summation order depends on the thread count: fix it so two runs can agree bit for bit.
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    data = mixprec.digits(batch_size=32, flatten=True, seed=args.seed)
    loader = ResumableLoader(data.train)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 10)).half()
    opt = mixprec.MasterWeights(torch.optim.AdamW(model.parameters(), lr=3e-3))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=args.steps)
    # growth_interval=8: the scale moves during this short run, so its state matters on resume
    scaler = mixprec.GradScaler("cpu", growth_interval=8)
    faults = inject_grad_faults(model[0].weight, rate=args.fault_rate, seed=args.seed)
    step, losses = 0, []
    if args.resume and args.ckpt.exists():
        resumed = load_checkpoint(args.ckpt, model=model, optimizer=opt, scaler=scaler, scheduler=sched,
                                  loader=loader)  # fmt: skip
        step, losses = resumed.step, resumed.extra["losses"]
        faults.calls = step  # one backward per step: the fault schedule continues where it was
        print(f"resumed from step {step}", flush=True)
    while step < args.steps:
        for x, y in loader:
            opt.zero_grad()
            with mixprec.half_compute("cpu", torch.float16):  # fp16 GEMMs at fp32's speed; the loss in fp32
                loss = F.cross_entropy(model(x.half()), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            losses.append(loss.item())
            step += 1
            if step % args.every == 0:
                save_checkpoint(args.ckpt, model=model, optimizer=opt, scaler=scaler, scheduler=sched,
                                step=step, extra={"losses": losses}, loader=loader)  # fmt: skip
                print(f"checkpoint {step}", flush=True)
            time.sleep(args.delay)
            if step == args.steps:
                break
    result = {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "masters": [m.detach().clone() for m in opt.master_views()],
        "losses": losses,
        "scales": scaler.scale_history(),
        "skipped_steps": scaler.skipped_steps,
    }
    if args.out is not None:
        torch.save(result, args.out)
    return result


if __name__ == "__main__":
    r = main(sys.argv[1:])
    print(f"done: final loss {r['losses'][-1]:.4f}, {r['skipped_steps']} skipped, scale {r['scales'][-1]:g}")
