"""Gradient clipping in any precision: bound the norm of the gradients the optimizer steps on."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mixprec.amp import master_params
from mixprec.callbacks.core import Callback, positive_finite
from mixprec.errors import ConfigError

__all__ = ["GradientClipping", "clip_master_grads", "check_max_norm"]


def check_max_norm(name: str, value: float | None) -> None:
    """Refuse a clipping norm that is not positive and finite, naming the caller's argument ``name``: a
    negative norm turns every update into gradient ascent, 0 zeroes every gradient."""
    if value is not None and not positive_finite(value):
        raise ConfigError(
            f"{name} must be a positive, finite gradient norm (clip <= 0 would reverse or zero every "
            f"update), got {value!r}.",
            f"e.g. {name}=1.0; None for no clipping.",
        )


def clip_master_grads(opt: torch.optim.Optimizer, max_norm: float) -> Tensor:
    """Clip the gradients the optimizer reads (the fp32 masters under ``MasterWeights``, the parameters
    otherwise) to a total norm of ``max_norm``; returns the norm before clipping (a device tensor: no
    sync). An optimizer with its own ``clip_grad_norm_`` (MasterWeights, LowPrecisionOptimizer) clips
    itself: over half gradients (split masters, master_grads=False) it takes the norm in fp32."""
    own = getattr(opt, "clip_grad_norm_", None)
    if callable(own):
        return own(max_norm)
    # master_params moves gradients the masters have not received yet (a MasterWeights built by hand, no
    # callback to fill them) into them first, and the step uses what this clip did
    return nn.utils.clip_grad_norm_(list(master_params(opt)), max_norm)


class GradientClipping(Callback):
    """Clip the gradient norm to ``max_norm`` before every step, in fp32, fp16 or bf16 alike (fastai v1's
    ``GradientClipping``; nanoGPT's ``clip_grad_norm_(model.parameters(), 1.0)``).

    Ordered after the loss-scaling callbacks (order 100): under loss scaling it clips the unscaled fp32
    gradients the optimizer will read, not the scaled half ones (whose norm is the loss scale times too
    large). A step with inf/NaN gradients gets a NaN norm here and is skipped by the scaler anyway."""

    order = 110

    def __init__(self, max_norm: float = 1.0) -> None:
        check_max_norm("max_norm", max_norm)
        self.max_norm = max_norm

    def on_backward_end(self) -> None:
        clip_master_grads(self.opt, self.max_norm)

    def __repr__(self) -> str:
        return f"GradientClipping(max_norm={self.max_norm:g})"
