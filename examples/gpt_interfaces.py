"""Example: one GPT written in plain PyTorch, trained through each of mixprec's interfaces.

The model and data are examples/gpt_learner.py's (nanoGPT's shape: weight tying, a decay/no-decay AdamW
split, the loss computed inside ``forward``). The training loop is a user's own; what changes per interface
is a few lines:

    fp32       nothing
    autocast   ``with mixprec.autocast(dev, torch.float16)`` around the forward, ``mixprec.GradScaler``;
               clipping after ``scaler.unscale_(opt)``, on ``model.parameters()`` as torch.amp documents
    O1, O2     ``model, opt = mixprec.initialize(model, opt, opt_level=...)`` and ``mixprec.scale_loss``;
               clipping on ``mixprec.master_params(opt)`` as apex documents
    learner    ``Learner(...).to_fp16()`` (gpt_learner.train)

Each hand-written loop (not ``learner``, which runs gpt_learner.train) can be combined with
``torch.compile`` (``--compile``) and activation checkpointing of every block (``--checkpoint``, through
``mixprec.checkpoint_context`` where a mixprec region is active).

Run:  python examples/gpt_interfaces.py --interface O2 --steps 100
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint
from gpt_learner import BETAS, GPT, GRAD_CLIP, LR, WEIGHT_DECAY, GPTConfig, markov_language, train
from torch import nn

import mixprec

INTERFACES = ("fp32", "autocast", "O1", "O2", "O2-bf16", "learner")


def _fused_adamw(model: GPT) -> torch.optim.Optimizer:
    """nanoGPT's optimizer: AdamW with the decay split, fused (one kernel for every parameter)."""
    groups = model.configure_optimizers(WEIGHT_DECAY, LR, BETAS).param_groups
    split = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups]
    return torch.optim.AdamW(split, lr=LR, betas=BETAS, fused=True)


def _checkpointed(model: GPT, compiled: bool) -> None:
    """Recompute each block's activations in backward instead of storing them. Eager, the recompute must
    re-enter the mixprec region (``mixprec.checkpoint_context``); compiled, the graph Dynamo traced already
    holds the region's casts and Inductor replays it (torch accepts no Python context there). Before torch
    2.13, Dynamo cannot trace a checkpointed block inside a mixprec region and runs it eagerly: it needs the
    context there too."""
    traced = compiled and torch.__version__ >= (2, 13)  # a TorchVersion: compares with a tuple
    kwargs: dict[str, Any] = {} if traced else {"context_fn": mixprec.checkpoint_context}
    for block in model.blocks:
        block.forward = functools.partial(  # type: ignore[method-assign]
            torch.utils.checkpoint.checkpoint, block.forward, use_reentrant=False, **kwargs
        )


def _batches(data: Any, steps: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    while True:
        for batch in data.train:
            yield batch
            steps -= 1
            if steps == 0:
                return


def _loop(
    model: nn.Module, opt: Any, steps: int, data: Any, step: Callable[[nn.Module, Any, Any, Any], float]
) -> list[float]:
    return [step(model, opt, x, y) for x, y in _batches(data, steps)]


def _fp32_step(model: nn.Module, opt: Any, x: Any, y: Any) -> float:
    _, loss = model(x, y)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def _autocast_step(scaler: mixprec.GradScaler) -> Callable[[nn.Module, Any, Any, Any], float]:
    def step(model: nn.Module, opt: Any, x: Any, y: Any) -> float:
        with mixprec.autocast(x.device.type, torch.float16):
            _, loss = model(x, y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)  # torch.amp's clipping recipe: unscale, then clip the model's gradients
        nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def _amp_step(model: nn.Module, opt: Any, x: Any, y: Any) -> float:
    _, loss = model(x, y)
    with mixprec.scale_loss(loss, opt) as scaled:
        scaled.backward()
    nn.utils.clip_grad_norm_(mixprec.master_params(opt), GRAD_CLIP)  # apex's clipping recipe
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def run(interface: str, steps: int = 60, compile: bool = False, checkpoint: bool = False,
        cfg: GPTConfig | None = None, seed: int = 0) -> list[float]:  # fmt: skip
    """Train for ``steps`` steps through ``interface``; returns the training losses."""
    cfg = cfg or GPTConfig()
    if interface == "learner":
        if compile or checkpoint:
            raise ValueError("--compile and --checkpoint apply to the hand-written loops, not to the learner "
                             "(gpt_learner.train); drop them, or pick --interface autocast, O1 or O2.")
        learn = train("fp16", steps, cfg, seed)
        return [float(v) for v in learn.recorder.losses]
    data, _ = markov_language(cfg, seed=seed)
    torch.manual_seed(seed)
    model = GPT(cfg)
    if checkpoint:
        _checkpointed(model, compile)
    opt: Any = _fused_adamw(model)
    step: Callable[[nn.Module, Any, Any, Any], float] = _fp32_step
    if interface == "autocast":
        step = _autocast_step(mixprec.GradScaler("cpu"))
    elif interface in ("O1", "O2", "O2-bf16"):
        level, _, dtype = interface.partition("-")
        half = torch.bfloat16 if dtype == "bf16" else torch.float16
        model, opt = mixprec.initialize(model, opt, opt_level=level, dtype=half, verbosity=0)
        step = _amp_step
    if compile:
        model = torch.compile(model)
    try:
        return _loop(model, opt, steps, data, step)
    finally:
        mixprec.amp.reset()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interface", choices=INTERFACES, default="O2")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--checkpoint", action="store_true", help="activation checkpointing per block")
    args = parser.parse_args(argv)
    losses = run(args.interface, args.steps, args.compile, args.checkpoint)
    ref = run("fp32", args.steps)
    print(f"{args.interface}: final loss {losses[-1]:.4f} (fp32: {ref[-1]:.4f})")


if __name__ == "__main__":
    main()
