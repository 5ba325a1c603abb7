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
the same code whose check answers no: a function object made from the same code over the module's globals
read live (a patch of ``F.linear`` or ``F.scaled_dot_product_attention`` made later is seen), but for that
one name. Every function it calls checks as usual. A torch whose function is wrapped (a closure) or checks
by another name gets no copy: the function is then passed on as it is, as before.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch.nn.functional as F

__all__ = ["COMPOSITES", "composite_of"]


def _no_torch_function(*_: Any) -> bool:
    return False


class _LiveGlobals(dict):  # type: ignore[type-arg]
    """A module's globals read live, but for the names set here (Python looks a function's globals up with
    ``__getitem__``, so ``__missing__`` answers every other name from the module as it is now)."""

    def __init__(self, module_globals: dict[str, Any], **overrides: Any) -> None:
        super().__init__(overrides)
        self.module_globals = module_globals

    def __missing__(self, name: str) -> Any:
        return self.module_globals[name]


def _unchecked(func: Callable[..., Any]) -> Callable[..., Any] | None:
    """``func`` with its own ``has_torch_function`` check answering no (see the module docstring); None
    where ``func`` is not a plain function that checks by that name."""
    code = getattr(func, "__code__", None)
    if code is None or func.__closure__ is not None or "has_torch_function" not in code.co_names:  # type: ignore[attr-defined]
        return None
    module_globals = func.__globals__  # type: ignore[attr-defined]
    names = _LiveGlobals(
        module_globals, has_torch_function=_no_torch_function, __name__=module_globals["__name__"],
        __builtins__=module_globals["__builtins__"],
        # warnings.warn keeps its once-per-line registry in the calling function's globals: the module's
        __warningregistry__=module_globals.setdefault("__warningregistry__", {}),
    )
    copy = types.FunctionType(code, names, func.__name__, func.__defaults__)  # type: ignore[attr-defined]
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
