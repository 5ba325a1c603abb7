"""Gradient accumulation in the Learner: :class:`GradientAccumulation`, fastai v2's callback
(``fastai.callback.training.GradientAccumulation``) in fastai v1's event names."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from mixprec.callbacks.core import Callback, CancelBatchException, positive_int
from mixprec.callbacks.fp16 import MixedPrecision
from mixprec.errors import ConfigError
from mixprec.warn_site import user_stacklevel

__all__ = ["GradientAccumulation"]


class GradientAccumulation(Callback):
    """Accumulate gradients over batches until at least ``n_acc`` samples have been seen, then step once:
    a batch size of ``n_acc`` (or more) in the memory of the loader's batch size.

    As fastai v2's ``GradientAccumulation(n_acc=32)``:

    * on_backward_begin -- the loss backward runs on is multiplied by ``batch size / n_acc``, so the
      gradients added up over batches of ``n_acc`` samples in all are those of the mean loss over the
      ``n_acc`` samples, as one batch of ``n_acc`` would give (``learn.loss``, which the Recorder logs,
      stays the batch's own mean);
    * on_backward_end -- while fewer than ``n_acc`` samples have been counted, raise
      :class:`~mixprec.callbacks.CancelBatchException`: no step, no on_step_end, no ``zero_grad``; the
      batch that reaches ``n_acc`` steps and the count starts again. If ``n_acc`` is not a multiple of the
      batch size the count overshoots, and the step's gradient is ``count / n_acc`` times the mean
      gradient (fastai's rule: the loss is divided by ``n_acc``, not by the samples counted);
    * the count carries over epoch ends: a partial accumulation at the end of an epoch goes on in the next
      one (validation leaves the gradients alone), and a :class:`~mixprec.callbacks.Checkpoint` saves and
      restores it (``state_dict`` holds the count and the pending gradients), so a resumed fit is still
      bit-identical. One left at the end of the fit is dropped: its gradients are cleared (fastai leaves
      them on the parameters, where the next fit's first step would add them in).

    Steps and schedules count batches, as fastai's ``train_iter`` and its schedules do: ``learn.iteration``
    (and ``fit(steps=N)``) count batches, a schedule moves at every batch, and the optimizer steps once
    per ``n_acc`` samples (its own step count, e.g. Adam's, is the optimizer steps). The Recorder logs a
    loss per batch and the learning rate, loss scale and skip flag per optimizer step.

    Order: before :class:`~mixprec.callbacks.MixedPrecision` (fastai's ``MixedPrecision.order - 4``), so
    the loss is divided before it is scaled and a micro-batch is cancelled before the mixed precision
    callback's on_backward_end: the gradients stay scaled (and, under fp32 masters, in the model's half
    ``.grad``) while they accumulate; the scaler unscales, copies to the masters and checks for inf/NaN
    once, at the step, and updates the scale once per step -- torch.amp's GradScaler recipe for
    accumulation. An inf/NaN in any micro-batch stays in the sum, so the whole step is skipped, and
    ``zero_grad`` discards it. Callbacks ordered after this one (clipping, 110) see only the summed
    gradients of real steps; those before it see every batch.
    """

    order = MixedPrecision.order - 4

    def __init__(self, n_acc: int = 32) -> None:
        if not positive_int(n_acc):
            raise ConfigError(
                f"n_acc must be an int >= 1 (the number of samples to accumulate before each optimizer "
                f"step), got {n_acc!r}.",
                "e.g. GradientAccumulation(n_acc=64) to step once per 64 samples; a multiple of the batch "
                "size gives each step exactly the mean gradient over n_acc samples.",
            )
        self.n_acc = int(n_acc)
        self.count = 0
        self._warned = False

    def on_train_begin(self) -> None:
        self.count = 0  # before a Checkpoint (order 200) restores a resumed fit's count
        self._warned = False
        others = [c for c in self.learn.callbacks if isinstance(c, GradientAccumulation) and c is not self]
        if others:
            raise ConfigError(
                f"two GradientAccumulation callbacks in one fit ({self!r} and {others[0]!r}): each would "
                "divide the loss and cancel steps on its own count.",
                "keep one: pass it either to Learner(callbacks=...) or to fit(callbacks=...).",
            )

    def on_backward_begin(self) -> None:
        # Not in place: learn.loss_grad is learn.loss (the logged loss) until a callback replaces it. The
        # factor rounds once in fp32, before the loss scale (a power of two: exact) is applied.
        self.learn.loss_grad = self.loss_grad / (self.n_acc / self.learn.batch_size)

    def on_backward_end(self) -> None:
        self.count += self.learn.batch_size
        if self.count < self.n_acc:
            raise CancelBatchException()  # keep the gradients: no unscale, step, update or zero_grad
        if self.count != self.n_acc and not self._warned:
            self._warned = True
            warnings.warn(
                f"GradientAccumulation(n_acc={self.n_acc}) counted {self.count} samples at this step "
                f"(batches of {self.learn.batch_size}): its gradient is {self.count}/{self.n_acc} times the "
                "mean over them, fastai's rule. An n_acc that is a multiple of the batch size gives the mean "
                "itself.",
                stacklevel=user_stacklevel(),  # the user's fit line, past the Learner's event loop
            )
        self.count = 0

    def on_train_end(self) -> None:
        if self.count and self.learn.opt is not None:
            # A partial accumulation nobody will step: clear it (model and, under MasterWeights, masters).
            self.learn.opt.zero_grad(set_to_none=True)
        self.count = 0

    def state_dict(self) -> dict[str, Any]:
        """The samples counted since the last step and the gradients they left (None when the count is 0):
        saved at an epoch end, they let a resumed fit finish the accumulation the saved one was in."""
        grads = None
        if self.count:
            params = self.learn.model.parameters()
            grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
        return {"count": self.count, "grads": grads}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.count = int(state_dict["count"])
        grads = state_dict.get("grads")
        if grads is None:
            return
        params = list(self.learn.model.parameters())
        if len(grads) != len(params):
            raise ConfigError(
                f"The saved accumulation has gradients for {len(grads)} parameters; this model has "
                f"{len(params)}.",
                "resume with the model (and precision) the checkpoint was saved with.",
            )
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                p.grad = None if g is None else g.to(device=p.device, dtype=p.dtype)

    def __repr__(self) -> str:
        return f"GradientAccumulation(n_acc={self.n_acc})"
