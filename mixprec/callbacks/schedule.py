"""Learning-rate (and momentum) schedules as callbacks: fastai's one-cycle, and the transformers' linear
warm-up followed by cosine decay."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from mixprec.callbacks.core import Callback
from mixprec.errors import ConfigError

__all__ = ["StepScheduler", "OneCycleScheduler", "WarmupCosineScheduler"]


def _cos_anneal(start: float, end: float, pct: float) -> float:
    return start + (end - start) * (1 - math.cos(math.pi * pct)) / 2


class StepScheduler(Callback):
    """Base of the schedules: before each training step, every param group's learning rate (and momentum,
    where the schedule has one) is set from the step number alone, over the fit's ``n_steps``. The step
    number is the whole state (``state_dict``): a resumed fit continues the same curve.

    A param group that ``opt_func`` gave a learning rate of its own (open_clip's 10x for ``logit_scale``)
    follows the schedule times its multiple of the others' (:func:`_lr_multiples`), as torch's schedulers
    scale each group's base lr: the groups keep their ratios (fastai set one rate for all, which dropped
    them unsaid)."""

    order = -15  # before anything that reads the learning rate of this step

    def _at(self, i: int) -> tuple[float, float | None]:
        """(learning rate, momentum or None to leave it) at step ``i`` of ``self.total``."""
        raise NotImplementedError

    def _begin(self) -> None:
        """Check the schedule fits ``self.total`` steps (raise ConfigError if not)."""

    def on_train_begin(self) -> None:
        self.total = max(1, self.n_steps)
        self.step_no = 0
        self.setters = [_momentum_setter(g) for g in self.opt.param_groups]
        self.multiples = _lr_multiples([g["lr"] for g in self.opt.param_groups], self.lr)
        self._begin()

    def on_batch_begin(self) -> None:
        if not self.training:
            return
        lr, mom = self._at(min(self.step_no, self.total - 1))
        for group, set_momentum, multiple in zip(self.opt.param_groups, self.setters, self.multiples,
                                                 strict=True):
            group["lr"] = lr * multiple
            if mom is not None:
                set_momentum(group, mom)

    def on_batch_end(self) -> None:
        if self.training:
            self.step_no += 1

    def state_dict(self) -> dict[str, Any]:
        return {"step_no": self.step_no}  # the rest is rebuilt from the arguments and n_steps

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step_no = int(state_dict["step_no"])


class OneCycleScheduler(StepScheduler):
    """fastai's 1cycle policy: the learning rate rises from ``lr_max / div_factor`` to ``lr_max`` over the
    first ``pct_start`` of the steps, then falls to ``lr_max / final_div``, both on cosine curves (the
    schedule of torch's OneCycleLR with ``final_div_factor = final_div / div_factor``); momentum
    (or Adam's beta1) moves the opposite way between ``moms``. High lr with low momentum explores, the long
    descent settles. Momentum is scheduled only for optimizers that use it (betas, or momentum > 0)."""

    def __init__(
        self,
        lr_max: float,
        div_factor: float = 25.0,
        pct_start: float = 0.3,
        final_div: float | None = None,
        moms: tuple[float, float] = (0.95, 0.85),
    ) -> None:
        if not 0.0 <= pct_start <= 1.0:
            raise ConfigError(f"pct_start must be in [0, 1], got {pct_start}.", "e.g. pct_start=0.3.")
        self.lr_max, self.div_factor, self.pct_start, self.moms = lr_max, div_factor, pct_start, moms
        # fastai's default: end 1e4 times below the start, so the last steps barely move the weights
        self.final_div = final_div if final_div is not None else div_factor * 1e4

    def _begin(self) -> None:
        # Step indices where the rise ends and the fall ends: both ends are reached exactly, as in
        # torch.optim.lr_scheduler.OneCycleLR (two phases), which the tests compare against.
        self.peak = max(0.0, self.pct_start * self.total - 1)

    def _at(self, i: int) -> tuple[float, float | None]:
        lr_start, lr_end = self.lr_max / self.div_factor, self.lr_max / self.final_div
        if i <= self.peak:
            pct = i / self.peak if self.peak > 0 else 1.0
            return _cos_anneal(lr_start, self.lr_max, pct), _cos_anneal(*self.moms, pct)
        pct = (i - self.peak) / max(1e-12, self.total - 1 - self.peak)
        return _cos_anneal(self.lr_max, lr_end, pct), _cos_anneal(self.moms[1], self.moms[0], pct)


class WarmupCosineScheduler(StepScheduler):
    """The transformer schedule (nanoGPT's ``get_lr``): the learning rate rises linearly to ``lr_max`` over
    ``warmup_steps`` (step i uses ``lr_max * (i + 1) / (warmup_steps + 1)``), then follows half a cosine
    down to ``min_lr``, reached at the fit's last step. Momentum is left as the optimizer has it.

    Warm-up: Adam's second-moment estimates are noise in the first steps, so full-size updates then can
    throw a transformer's weights (and an fp16 loss scale) far off; the cosine tail settles the weights.
    ``min_lr`` defaults to ``lr_max / 10`` (nanoGPT's choice, after Chinchilla)."""

    def __init__(self, lr_max: float, warmup_steps: int, min_lr: float | None = None) -> None:
        if not (isinstance(warmup_steps, int) and warmup_steps >= 0):
            raise ConfigError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}.", "e.g. 100.")
        self.lr_max, self.warmup_steps = lr_max, warmup_steps
        self.min_lr = lr_max / 10 if min_lr is None else min_lr

    def _begin(self) -> None:
        if self.warmup_steps >= self.total:
            raise ConfigError(
                f"warmup_steps={self.warmup_steps} leaves no step of this {self.total}-step fit to decay in.",
                "use fewer warm-up steps (a few percent of the fit is usual), or fit for more steps.",
            )

    def _at(self, i: int) -> tuple[float, float | None]:
        if i < self.warmup_steps:
            return self.lr_max * (i + 1) / (self.warmup_steps + 1), None
        pct = (i - self.warmup_steps) / max(1, self.total - 1 - self.warmup_steps)
        return _cos_anneal(self.lr_max, self.min_lr, pct), None


def _lr_multiples(group_lrs: list[float], fit_lr: float) -> list[float]:
    """Each group's lr as a multiple of the reference: the fit's lr where a group was built at it, else the
    first group's (an opt_func that sets its own lr for every group: the schedule then gives the first
    group the schedule's rate, as before). Read at the fit's start, before a resume loads a scheduled lr."""
    reference = fit_lr if fit_lr in group_lrs else group_lrs[0]
    return [lr / reference if reference else 1.0 for lr in group_lrs]


def _set_beta1(group: dict[str, Any], mom: float) -> None:
    group["betas"] = (mom, group["betas"][1])


def _set_momentum(group: dict[str, Any], mom: float) -> None:
    group["momentum"] = mom


def _momentum_setter(group: dict[str, Any]) -> Callable[[dict[str, Any], float], None]:
    if "betas" in group:
        return _set_beta1
    if group.get("momentum", 0) > 0:
        return _set_momentum
    return lambda group, mom: None  # plain SGD: leave it without momentum


