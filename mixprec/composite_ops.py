"""torch's Python functions whose inner GEMMs a region must see: run with the region's mode still on.

A torch-function mode is taken off the stack while it handles a call, so when it passes on a function that
is itself Python composed of torch ops, the mode sees none of those ops. For most such functions that is
right (``F.softmax`` calls one kernel, and a rule for it names it). ``F.multi_head_attention_forward``
(what ``nn.MultiheadAttention`` and every ``nn.Transformer*`` layer call in training) runs four GEMMs
inside; unseen, they ran as torch's autocast casts them, in torch's own half kernels, which on a CPU without
half units made a small Transformer's bf16 step 5-10x fp32's (a user trial of pytorch/examples'
word_language_model), where its ``nn.Linear`` layers beside them ran at fp32's speed.

So a region's mode runs such a function with itself pushed back on: its inner linears, matmuls and softmax
are then handled as anywhere else in the region (emulated where the hardware asks for it). The function
checks ``has_torch_function`` first and would hand the call straight back to the mode; the copy run here is
the same code whose check answers no (a function object made from the same code and a copy of its module's
globals, made once at import), so the body runs, and every function it calls checks as usual.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch.nn.functional as F

__all__ = ["COMPOSITES"]


def _no_torch_function(*_: Any) -> bool:
    return False


def _unchecked(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` with its own ``has_torch_function`` check answering no (see the module docstring)."""
    code = func.__code__  # type: ignore[attr-defined]
    names = dict(func.__globals__)  # type: ignore[attr-defined]
    names["has_torch_function"] = _no_torch_function
    copy = types.FunctionType(code, names, func.__name__, func.__defaults__,  # type: ignore[attr-defined]
                              func.__closure__)  # type: ignore[attr-defined]
    copy.__kwdefaults__ = func.__kwdefaults__  # type: ignore[attr-defined]
    return copy


# function a mode receives -> the copy it runs with itself on (only functions whose one torch-function
# check is `has_torch_function(...)` at the top, returning handle_torch_function's result)
COMPOSITES: dict[Callable[..., Any], Callable[..., Any]] = {
    F.multi_head_attention_forward: _unchecked(F.multi_head_attention_forward),
}
