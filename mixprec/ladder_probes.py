"""What the ladder measures in every rung: Learner callbacks that look at the tensors themselves.

- :class:`MemoryProbe`: bytes of the training state (weights, gradients, fp32 masters or a low-precision
  optimizer's extra buffers, optimizer state) and of the tensors autograd saved for backward, first step.
- :class:`GradientProbe`: gradient entries that are 0, subnormal in their dtype, or below fp16's smallest
  subnormal (what an fp16 gradient would flush to 0), before unscaling.
- :class:`UpdateProbe`: updates lost to rounding, as measured (the value the optimizer holds did not move)
  and as the theory predicts (the update is below half the spacing of numbers at the weight).

The gradient and update probes sample the last training batch of every epoch: a few samples suffice, and
their cost stays out of most timed steps (ms/step is a median).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mixprec.callbacks import Callback
from mixprec.diagnostics.memory import SavedTensors
from mixprec.formats import info
from mixprec.low_precision import footprint

__all__ = ["MemoryProbe", "GradientProbe", "UpdateProbe", "FP16_FLUSH", "FP16_NORMAL", "below_half_spacing"]

# Half of fp16's smallest subnormal (2**-24): a value below it rounds to 0 when stored in fp16.
FP16_FLUSH = info(torch.float16).smallest_subnormal / 2
# fp16's smallest normal, 2**-14: below it fp16 keeps fewer than its 11 significant bits.
FP16_NORMAL = info(torch.float16).smallest_normal


def _sampled(cb: Callback) -> bool:
    return (cb.iteration + 1) % len(cb.data.train) == 0


class MemoryProbe(Callback):
    """Memory of the first training step, counted from the tensors (not an allocator peak, which the CPU
    does not report): ``state`` is :func:`mixprec.low_precision.footprint` of the optimizer -- weights,
    gradients, fp32 masters and their gradients or the extra buffers of a low-precision optimizer, and
    optimizer state -- taken at on_step_end before gradients are cleared; ``saved`` is the bytes of the
    tensors autograd saved for backward during that forward, beyond the parameters, taken while they are
    alive. Distinct storages are counted once."""

    order = 150  # after the callbacks that replace the optimizer at on_train_begin (MixedPrecision: 100)

    def on_train_begin(self) -> None:
        self.saved_bytes: int | None = None
        self.state_bytes: int | None = None
        self.per_param: float | None = None
        self.hooks: Any = None

    def on_batch_begin(self) -> None:
        if self.training and self.saved_bytes is None:
            optimized = [p for g in self.opt.param_groups for p in g["params"]]
            self.saved = SavedTensors.beyond(self.model.parameters(), optimized)
            self.hooks = self.saved.counting()
            self.hooks.__enter__()

    def on_backward_begin(self) -> None:
        if self.hooks is None:
            return
        self.hooks.__exit__(None, None, None)
        self.hooks = None
        self.saved_bytes = self.saved.total
        del self.saved

    def on_step_end(self) -> None:
        if self.state_bytes is None:
            held = footprint(self.opt)
            self.state_bytes, self.per_param = held.total, held.per_param

    def on_train_end(self) -> None:
        if self.hooks is not None:
            self.hooks.__exit__(None, None, None)

    def mib(self) -> tuple[float | None, float | None]:
        state, saved = self.state_bytes, self.saved_bytes
        return (None if state is None else state / 2**20, None if saved is None else saved / 2**20)


class GradientProbe(Callback):
    """Gradient entries as backward left them in the model (scaled, before unscaling): the share that is
    exactly 0; the share stored as a subnormal of its dtype (below ``finfo.smallest_normal``: 2**-14 in
    fp16, where a value keeps fewer significant bits, down to 2**-24 and then 0); and the share that is
    nonzero but below :data:`FP16_FLUSH` -- in an fp32 rung, the gradients fp16 would have flushed to 0
    (in an fp16 rung they are already 0) -- or below :data:`FP16_NORMAL` (fp16 would keep fewer bits).
    fp32 shows the zeros that are real (e.g. ReLU units inactive for the whole batch); what fp16 adds is
    underflow."""

    order = 50  # before LossScaling (100) unscales

    def on_train_begin(self) -> None:
        self.zero: list[float] = []
        self.subnormal: list[float] = []
        self.flushed: list[float] = []
        self.below_fp16_normal: list[float] = []

    def on_backward_end(self) -> None:
        if not _sampled(self):
            return
        grads = [p.grad for p in self.learn.model.parameters() if p.grad is not None]
        n = max(1, sum(g.numel() for g in grads))
        self.zero.append(sum(int((g == 0).sum()) for g in grads) / n)
        tiny = [torch.finfo(g.dtype).smallest_normal for g in grads]
        subnormal = sum(int(((g != 0) & (g.abs() < t)).sum()) for g, t in zip(grads, tiny, strict=True))
        self.subnormal.append(subnormal / n)
        self.flushed.append(sum(int(((g != 0) & (g.abs() < FP16_FLUSH)).sum()) for g in grads) / n)
        self.below_fp16_normal.append(sum(int(((g != 0) & (g.abs() < FP16_NORMAL)).sum()) for g in grads) / n)


def below_half_spacing(weight: Tensor, update: Tensor) -> Tensor:
    """Where ``weight + update``, rounded to nearest in ``weight``'s dtype, is ``weight`` again: the update
    is smaller than half the distance to the neighbour of ``weight`` in the update's direction. (At a power
    of two the spacing below is half the spacing above, so the direction matters.) Ties (exactly half)
    round to even, which keeps the weight or not: they are not counted."""
    toward = torch.where(update > 0, torch.inf, -torch.inf).to(weight.dtype)
    spacing = (torch.nextafter(weight, toward).double() - weight.double()).abs()
    return update.double().abs() < spacing / 2


def _held_values(opt: torch.optim.Optimizer) -> list[Tensor]:
    """The values the optimizer holds for its parameters: a low-precision optimizer's fp32 view (weight
    plus compensation, or the 16+16 split's exact master), else the parameters themselves (fp32 masters
    under MasterWeights, the half weights of a naive half model, fp32 weights)."""
    master_values = getattr(opt, "master_values", None)
    if master_values is not None:
        return list(master_values())
    return [p.detach().clone() for g in opt.param_groups for p in g["params"]]


class UpdateProbe(Callback):
    """Updates lost to rounding, among the entries the optimizer updates whose gradient is nonzero.

    ``lost``: measured -- the share whose held value (:func:`_held_values`) did not change in the step.
    ``predicted``: the theory -- for plain SGD (no momentum, no weight decay) the update is ``-lr * grad``,
    and it is lost where it is below half the spacing of the stored weight's dtype at the weight
    (:func:`below_half_spacing`). Not computed for other optimizers, whose update is not ``lr * grad``."""

    order = 150  # after LossScaling put the unscaled gradients where the optimizer reads them

    def on_train_begin(self) -> None:
        self.lost: list[float] = []
        self.predicted: list[float] = []
        self.before: list[Tensor] = []
        self.moved: list[Tensor] = []
        self.pending: float | None = None

    def on_backward_end(self) -> None:
        if not _sampled(self):
            return
        params = [p for g in self.opt.param_groups for p in g["params"]]
        self.moved = [p.grad != 0 if p.grad is not None else torch.zeros_like(p, dtype=torch.bool)
                      for p in params]
        self.before = _held_values(self.opt)
        self.pending = self._predicted(params)

    def _predicted(self, params: list[Tensor]) -> float | None:
        groups = self.opt.param_groups
        if any(g.get("momentum", 0) or g.get("weight_decay", 0) or "betas" in g for g in groups):
            return None
        lost = 0
        for group in groups:
            for p in group["params"]:
                if p.grad is not None:
                    update = -group["lr"] * p.grad.float()
                    lost += int((below_half_spacing(p.detach(), update) & (p.grad != 0)).sum())
        return lost / max(1, sum(int(m.sum()) for m in self.moved))

    def on_step_end(self) -> None:
        if self.before and not self.learn.step_skipped:
            after = _held_values(self.opt)
            pairs = zip(after, self.before, self.moved, strict=True)
            lost = sum(int(((a == b) & m).sum()) for a, b, m in pairs)
            self.lost.append(lost / max(1, sum(int(m.sum()) for m in self.moved)))
            if self.pending is not None:
                self.predicted.append(self.pending)
        self.before, self.moved, self.pending = [], [], None
