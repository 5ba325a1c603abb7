"""Whether torch.func's transforms or forward-mode AD are running, for the parts of mixprec that step aside.

Inside ``torch.func.grad``, ``vmap``, ``jvp``, ``jacrev``/``jacfwd``, ``hessian`` (and under
``torch.autograd.forward_ad``'s dual levels) mixprec computes with plain torch ops only, as torch.autocast
does, because those compose with every transform and every nesting of them:

* the emulated GEMMs and ReLU take their generic path (torch's ops on rounded operands), not the autograd
  functions that save half activations (:mod:`mixprec.half_saving_gemms`, :mod:`mixprec.half_relu`): a
  custom autograd function needs a vmap rule, a jvp, and for nested forward mode a jvp that is itself
  differentiable (a PINN's second derivative through one came out 0);
* the cast cache neither stores nor returns (:mod:`mixprec.cast_cache`): a parameter's rounding made at a
  transform's level has no autograd link to the parameter outside it, and a later plain forward in the same
  region that reused it trained without gradients for that parameter;
* the one-time input check of a half model reads no values (a data-dependent branch inside vmap fails:
  :func:`values_readable`);
* GradScaler makes its state tensors outside the transform (:func:`outside_transforms`), so they are not
  the transform's wrapped tensors when ``scale(loss)`` first runs on a per-sample loss.

torch has no public query or switch for these; each private name is read guarded, so that a torch without
it counts as "not running" (the behaviour before this module existed).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.autograd.forward_ad as forward_ad

__all__ = ["inside_transform", "outside_transforms", "values_readable"]

# torch.func's interpreter stack: None when no transform is running (torch >= 2.0).
_peek_interpreter = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", lambda: None)


def inside_transform() -> bool:
    """Whether a torch.func transform or a forward-AD dual level is active (never in compiled code, which
    Dynamo traces with its own view of both)."""
    if torch.compiler.is_compiling():
        return False
    return _peek_interpreter() is not None or getattr(forward_ad, "_current_level", -1) >= 0


def values_readable() -> bool:
    """Whether code here may read a tensor's values (``.any()``, ``.item()``): not while Dynamo traces, nor
    inside a torch.func transform (vmap's batched tensors have none to give)."""
    return not torch.compiler.is_compiling() and not inside_transform()


def outside_transforms() -> Any:
    """A context in which tensors are made outside torch.func's transforms (torch's own private switch,
    ``torch._C._DisableFuncTorch``; a torch without it makes them as before)."""
    disable = getattr(torch._C, "_DisableFuncTorch", None)
    return disable() if disable is not None else contextlib.nullcontext()
