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
read under another name (``_mixprec_no_torch_function``, set in the function's module, answering no;
likewise torch's key_padding_mask shape check, as plain Python Dynamo traces: ``RENAMED``).
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


def _no_torch_function(*_: Any) -> bool:
    return False


def _check_key_padding_mask(key_padding_mask: torch.Tensor, src_len: int, bsz: int) -> None:
    """torch's check of an attention's key_padding_mask shape, as plain Python: torch's passes its message
    as a closure to ``torch._check_with``, which Dynamo cannot convert inside the copy (a graph break per
    padded attention call, a user trial's seq2seq model; torch's own attention Dynamo records whole)."""
    for dim, want in ((0, bsz), (1, src_len)):
        if key_padding_mask.shape[dim] != want:
            raise AssertionError(
                f"Expected key_padded_mask.shape[{dim}] to be {want}, but got {key_padding_mask.shape[dim]}"
            )


# global a copy reads -> (the name it reads instead, set in the function's module; the function there).
# has_torch_function must be among a function's globals; the others are renamed where present.
RENAMED: dict[str, tuple[str, Callable[..., Any]]] = {
    "has_torch_function": ("_mixprec_no_torch_function", _no_torch_function),
    "_check_key_padding_mask": ("_mixprec_check_key_padding_mask", _check_key_padding_mask),
}


def _unchecked(func: Callable[..., Any]) -> Callable[..., Any] | None:
    """``func`` with its own ``has_torch_function`` check answering no (see the module docstring); None
    where ``func`` is not a plain function that reads that name, and every name it renames, as a global
    only."""
    code = getattr(func, "__code__", None)
    if code is None or func.__closure__ is not None:  # type: ignore[attr-defined]
        return None
    uses = [(i.argval, i.opname) for i in dis.get_instructions(code) if i.argval in RENAMED]
    if "has_torch_function" not in {name for name, _ in uses} or any(op != "LOAD_GLOBAL" for _, op in uses):
        return None
    module_globals = func.__globals__  # type: ignore[attr-defined]
    for new_name, replacement in RENAMED.values():
        module_globals.setdefault(new_name, replacement)
    names = tuple(RENAMED[n][0] if n in RENAMED else n for n in code.co_names)
    copy = types.FunctionType(
        code.replace(co_names=names), module_globals, func.__name__, func.__defaults__  # type: ignore[attr-defined]
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
