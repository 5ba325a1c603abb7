"""torch's Python functions whose inner GEMMs a region must see: run with the region's mode still on.

A torch-function mode is taken off the stack while it handles a call, so when it passes on a function that
is itself Python composed of torch ops, the mode sees none of those ops. For most such functions that is
right (``F.softmax`` calls one kernel, and a rule for it names it). ``F.multi_head_attention_forward``
(what ``nn.MultiheadAttention`` and every ``nn.Transformer*`` layer call in training) runs four GEMMs
inside; unseen, they ran as torch's autocast casts them, in torch's own half kernels, which on a CPU without
half units made a small Transformer's bf16 step 5-10x fp32's (a user trial of pytorch/examples'
word_language_model), where its ``nn.Linear`` layers beside them ran at fp32's speed.

So a region's mode runs such a function with itself pushed back on: its inner linears, matmuls and softmax
are then handled as anywhere else in the region (emulated where the hardware asks for it), in eager and in
compiled code alike. The function checks ``has_torch_function`` first and would hand the call straight back
to the mode; the copy run here is the same bytecode over the same module globals, with that one global
read under another name (``_mixprec_no_torch_function``, set in the function's module, answering no).
Reading the module's own globals keeps a patch of ``F.linear`` or ``F.scaled_dot_product_attention`` made
later in view, and lets Dynamo trace the copy as it traces the function (it reads a function's globals as
a plain dict, so a dict that answers missing names from elsewhere did not work there). Every function it
calls checks as usual. A torch whose function is wrapped (a closure) or reads the name other than as a
global gets no copy: the function is then passed on as it is.

``TRACEABLE_FORMS``: a Tensor method written in Python that Dynamo cannot trace when a mode passes it on,
and the torch function that computes the same. ``Tensor.unflatten`` ends in ``super().unflatten()``,
which Dynamo cannot call from a mode's frame: it gave up on the whole compiled function and ran it
eagerly (a graph break torch.autocast does not have; ``nn.MultiheadAttention`` unflattens its
projections).
"""

from __future__ import annotations

import dis
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["COMPOSITES", "TRACEABLE_FORMS", "composite_of", "traceable_form"]


# The name the copies read instead of has_torch_function (set in each copied function's module).
UNCHECKED_NAME = "_mixprec_no_torch_function"


def _no_torch_function(*_: Any) -> bool:
    return False


def _unchecked(func: Callable[..., Any]) -> Callable[..., Any] | None:
    """``func`` with its own ``has_torch_function`` check answering no (see the module docstring); None
    where ``func`` is not a plain function that reads that name as a global only."""
    code = getattr(func, "__code__", None)
    if code is None or func.__closure__ is not None:  # type: ignore[attr-defined]
        return None
    uses = [i.opname for i in dis.get_instructions(code) if i.argval == "has_torch_function"]
    if not uses or any(op != "LOAD_GLOBAL" for op in uses):
        return None
    names = tuple(UNCHECKED_NAME if n == "has_torch_function" else n for n in code.co_names)
    func.__globals__.setdefault(UNCHECKED_NAME, _no_torch_function)  # type: ignore[attr-defined]
    copy = types.FunctionType(
        code.replace(co_names=names), func.__globals__, func.__name__, func.__defaults__  # type: ignore[attr-defined]
    )
    copy.__kwdefaults__ = func.__kwdefaults__  # type: ignore[attr-defined]
    return copy


# function a mode receives -> the copy it runs with itself on (functions whose one torch-function check is
# `has_torch_function(...)` at the top, returning handle_torch_function's result)
COMPOSITES: dict[Callable[..., Any], Callable[..., Any]] = {
    func: copy for func in (F.multi_head_attention_forward,) if (copy := _unchecked(func)) is not None
}


def composite_of(func: Any) -> Callable[..., Any] | None:
    """The copy to run for ``func``, or None (most functions)."""
    try:
        return COMPOSITES.get(func)
    except TypeError:  # an unhashable callable (a dataclass instance that checks has_torch_function itself)
        return None


# Tensor method a mode receives -> the torch function to call for it in compiled code (module docstring)
TRACEABLE_FORMS: tuple[tuple[Callable[..., Any], Callable[..., Any]], ...] = (
    (torch.Tensor.unflatten, torch.unflatten),
)


def traceable_form(func: Any) -> Any:
    """What compiled code calls for ``func``: a torch function Dynamo traces, or ``func`` itself. (Pairs
    compared by identity: Dynamo did not find a Tensor method as a dict key.)"""
    for method, form in TRACEABLE_FORMS:
        if func is method:
            return form
    return func
