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
* the one-time input check of a half model reads no values (a data-dependent branch inside vmap fails).

torch has no public query for either; both reads are guarded so that a torch without them counts as
"not running" (the behaviour before this module existed).
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as forward_ad

__all__ = ["inside_transform"]

# torch.func's interpreter stack: None when no transform is running (torch >= 2.0).
_peek_interpreter = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", lambda: None)


def inside_transform() -> bool:
    """Whether a torch.func transform or a forward-AD dual level is active (never in compiled code, which
    Dynamo traces with its own view of both)."""
    if torch.compiler.is_compiling():
        return False
    return _peek_interpreter() is not None or getattr(forward_ad, "_current_level", -1) >= 0
