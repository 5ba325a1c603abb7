"""The Learner loop's events, the :class:`Callback` base class, the exceptions that steer the loop, and the
state a callback reads (:class:`LearnerState`).

The loop fires fastai v1's events, in this order (:data:`EVENTS`; validation batches fire only
on_batch_begin, on_loss_begin and on_batch_end, with ``learn.training`` False)::

    on_train_begin
      on_epoch_begin
        on_batch_begin      xb, yb are on the device
        (forward)           pred = model(xb)
        on_loss_begin       pred may be changed (e.g. cast to fp32)
        (loss)              loss = loss_func(pred, yb); loss_grad = loss
        on_backward_begin   loss_grad may be changed (e.g. scaled)
        (backward)
        on_backward_end     gradients are ready; raise CancelStepException to skip the step
        (step)              scaler.step(opt) with a loss scaler (skips on inf/NaN), else opt.step()
        on_step_end         runs whether the step was taken or skipped (learn.step_skipped)
        (zero_grad)
        on_batch_end        also after CancelBatchException
      on_epoch_end          after validation: learn.valid_loss, learn.valid_metrics
    on_train_end            also when training stopped with an exception

A training batch that raises :class:`CancelBatchException` (fastai's name and meaning) skips the rest of the
batch -- backward, step, on_step_end and zero_grad, whichever are still to come -- and goes on at
on_batch_end: raised in on_backward_end it keeps the gradients for the next batch to add to
(:class:`~mixprec.callbacks.GradientAccumulation`).

A callback reads the learner's state as its own attributes (``self.loss`` is ``self.learn.loss``) and writes
it through ``self.learn``. Callbacks run in ascending ``order``.

This module imports nothing from :mod:`mixprec.learner`: the learner is known to callbacks only through
:class:`LearnerState`, so the learner imports the callbacks and never the other way round.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor, nn

from mixprec.errors import ConfigError
from mixprec.scaler import GradScaler, OptState

if TYPE_CHECKING:
    from mixprec.data import DataBunch

__all__ = [
    "EVENTS",
    "Callback",
    "CancelStepException",
    "CancelBatchException",
    "CancelTrainException",
    "LearnerState",
    "scaler_saw_step",
    "positive_finite",
    "positive_int",
]

# The loop's events, in the order they fire (see the module docstring).
EVENTS: tuple[str, ...] = (
    "on_train_begin",
    "on_epoch_begin",
    "on_batch_begin",
    "on_loss_begin",
    "on_backward_begin",
    "on_backward_end",
    "on_step_end",
    "on_batch_end",
    "on_epoch_end",
    "on_train_end",
)


class CancelStepException(Exception):
    """Raised in on_backward_end to skip this iteration's optimizer step (e.g. inf/NaN gradients).

    The loop catches it; on_step_end still runs, with ``learn.step_skipped`` True."""


class CancelBatchException(Exception):
    """Raised in a training batch's event to skip the rest of that batch: no step, no on_step_end and no
    zero_grad, so the gradients stay for the next batch to add to (fastai's ``CancelBatchException``, which
    its ``GradientAccumulation`` raises before the step). on_batch_end still runs, with
    ``learn.step_skipped`` True (no step was taken)."""


class CancelTrainException(Exception):
    """Raised by a callback to stop training early; on_train_end still runs."""


class LearnerState(Protocol):
    """What a callback may read (and, for the first group, replace) on ``self.learn`` during a fit."""

    model: nn.Module
    data: DataBunch
    opt: torch.optim.Optimizer | None  # built by fit(); MixedPrecision wraps it in MasterWeights
    lr: float  # the learning rate fit() built the optimizer with (a param group's own lr is a multiple)
    scaler: GradScaler | None  # the loss scaler in use, or None
    xb: Tensor
    yb: Tensor  # or a tuple of them (loss_func(pred, *yb))
    pred: Any
    loss: Tensor  # unscaled
    loss_grad: Tensor  # what backward runs on (scaled under loss scaling)
    callbacks: list[Callback]
    recorder: Any
    epoch: int
    n_epochs: int  # epochs this fit covers (the last one may be cut short by n_steps)
    n_steps: int  # training steps this fit covers: schedules span them
    start_epoch: int  # > 0 when a fit resumed from a checkpoint
    iteration: int  # training batches so far in this fit (micro-batches under GradientAccumulation)
    training: bool
    valid_loss: float
    valid_metrics: list[float]

    @property
    def metric_names(self) -> list[str]: ...

    @property
    def device(self) -> torch.device: ...  # the model's

    @property
    def batch_size(self) -> int: ...  # the current batch's (its first target's length)

    @property
    def step_skipped(self) -> bool: ...

    def step_skipped_async(self) -> bool | Tensor: ...


class Callback:
    """Base class: override the events you need (:data:`EVENTS`); every event is a no-op here."""

    order: int = 0  # callbacks run in ascending order
    learn: LearnerState

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the callback does not have: read them from the learner (fastai v2 style).
        if name == "learn" or "learn" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        return getattr(self.__dict__["learn"], name)

    def on_train_begin(self) -> None: ...
    def on_epoch_begin(self) -> None: ...
    def on_batch_begin(self) -> None: ...
    def on_loss_begin(self) -> None: ...
    def on_backward_begin(self) -> None: ...
    def on_backward_end(self) -> None: ...
    def on_step_end(self) -> None: ...
    def on_batch_end(self) -> None: ...
    def on_epoch_end(self) -> None: ...
    def on_train_end(self) -> None: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


# fastai v1 passed an event the loop's state as keywords and read back a returned dict: the state each of
# those keywords held, as a mixprec callback reads (self.NAME) and writes it (self.learn.NAME).
V1_KEYWORDS: dict[str, str] = {
    "last_input": "self.xb", "last_target": "self.yb", "last_output": "self.pred",
    "last_loss": "self.loss (what backward runs on: self.loss_grad)", "smooth_loss": "self.loss",
    "epoch": "self.epoch", "n_epochs": "self.n_epochs", "train": "self.training",
    "iteration": "self.iteration", "num_batch": "self.iteration", "last_metrics": "self.valid_metrics",
    "stop_training": "raise CancelTrainException()", "skip_step": "raise CancelStepException()",
}


def check_callback(cb: Callback) -> None:
    """Refuse a callback whose events need arguments (fastai v1's signature): the loop calls each event
    with none, and such an event would fail with a bare TypeError in the middle of a fit. Read from the
    bound event, so that ``self`` (or a classmethod's ``cls``) is not counted; ``**kwargs``, ``*args`` and
    parameters with defaults are fine: the call works."""
    for name in EVENTS:
        try:
            params = inspect.signature(getattr(cb, name)).parameters.values()
        except (TypeError, ValueError):  # a builtin without a signature: nothing to read
            continue
        required = [p.name for p in params if p.default is p.empty and p.kind in _NAMED]
        if required:
            known = {n: V1_KEYWORDS[n] for n in required if n in V1_KEYWORDS}
            hints = ", ".join(f"{k} -> {v}" for k, v in known.items())
            raise ConfigError(
                f"{type(cb).__name__}.{name} needs ({', '.join(required)}): fastai v1's event signature. The "
                "Learner calls every event with no arguments (fastai v2's convention).",
                "define it as def " + name + "(self) -> None, read the loop's state as attributes "
                + (f"({hints}) " if hints else "(self.xb, self.yb, self.pred, self.loss, self.epoch, ...) ")
                + "and change it through self.learn (e.g. self.learn.pred = ...); stop training with "
                "raise CancelTrainException() (docs/migrating-from-fastai.md).",
            )


# The parameters a call with no arguments must fill: named ones without a default.
_NAMED = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
          inspect.Parameter.KEYWORD_ONLY)


def check_event_result(cb: Callback, name: str, result: object) -> None:
    """An event returned a dict: fastai v1's way to change the loop's state, which this loop (as fastai
    v2's) does not read, so the change would be lost. Other results are ignored, as fastai v2 does."""
    if isinstance(result, dict):
        raise ConfigError(
            f"{type(cb).__name__}.{name} returned {result!r}: fastai v1's way to change the loop's state. "
            "The Learner does not read what events return (fastai v2's convention), so that change would "
            "be lost.",
            "set the state on the learner instead (self.learn.pred = ..., self.learn.loss_grad = ...), or "
            "raise CancelTrainException() / CancelBatchException() to steer the loop.",
        )


def stateful_callbacks(callbacks: Sequence[Callback]) -> list[Callback]:
    """Callbacks with their own state (the Recorder, schedules), in the given order. Looked up on the
    class: an instance would forward a missing ``state_dict`` to the learner (``Callback.__getattr__``)."""
    return [cb for cb in callbacks if callable(getattr(type(cb), "state_dict", None))]


def scaler_saw_step(scaler: GradScaler | None, optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether ``scaler`` unscaled or stepped ``optimizer`` in this iteration and has not been updated since.

    Read from the scaler's own per-optimizer stage (torch's record, same keys); ``.get`` so that asking
    does not create a record. No sync."""
    if scaler is None or optimizer is None:
        return False
    return scaler.stage(optimizer) is not OptState.READY


# Argument checks shared by the callbacks' constructors (numpy scalars pass, as torch accepts them; bools do
# not, though Python counts them as ints).
def positive_finite(value: Any) -> bool:
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    return real and math.isfinite(value) and value > 0


def positive_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1
