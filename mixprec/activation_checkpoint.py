"""Activation checkpointing inside mixprec regions: the recompute runs under the same cast rules.

``torch.utils.checkpoint`` re-runs a segment's forward during backward. It restores torch's own autocast
state for that recompute, but not mixprec's Python layer (the policy's changed ops, emulated fp16 GEMMs,
``half_compute``): the recompute then runs other kernels in other dtypes than the forward did, and
non-reentrant checkpointing raises ``CheckpointError`` (saved tensors' dtypes differ) while reentrant
checkpointing silently gives other gradients.

The supported way is non-reentrant checkpointing with :func:`checkpoint_context` as its ``context_fn``,
or :func:`checkpoint`, which passes it for you::

    from mixprec.activation_checkpoint import checkpoint, checkpoint_context

    y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False, context_fn=checkpoint_context)
    y = checkpoint(block, x)  # the same

``checkpoint_context`` records the mixprec regions in force when the segment's forward runs and
re-enters exactly those for its recompute. A model mixprec prepared (``initialize`` at O1-O3, ``to_fp16``,
``to_bf16``) needs neither for its modules: each submodule re-enters the model's region when called
outside it in a recompute (``half_model._submodule_forward``), so torch's checkpoint of either kind, and
``checkpoint_sequential``, recompute its blocks as the forward ran them.

**Reentrant checkpointing (``use_reentrant=True``) offers no context hook and is not supported under an
autocast region with a Python layer** (CPU fp16 with emulated GEMMs, custom policies), nor for a half
model's checkpointed functions that are not modules; :func:`checkpoint` refuses it with an error that
names the fix. Under torch's own tables alone (default policy on CPU bf16 or CUDA) both kinds work, as
they do under torch.autocast.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint

from mixprec.errors import AutocastError
from mixprec.fp32_modules import ModuleRules
from mixprec.region import STATE, Region, RegionMode, is_current

__all__ = ["checkpoint", "checkpoint_context"]


def _active_modes() -> list[RegionMode]:
    return [m for m in torch.overrides._get_current_function_mode_stack() if isinstance(m, RegionMode)]


@contextlib.contextmanager
def _reentered(regions: list[Region], modes: list[RegionMode]) -> Iterator[None]:
    """The forward's region stack and modes again, for a recompute that may run outside them."""
    saved = STATE.regions
    STATE.regions = list(regions)
    rules = None
    try:
        with contextlib.ExitStack() as stack:
            for mode in modes:
                stack.enter_context(mode)
            innermost = regions[-1] if regions else None
            if innermost is not None and innermost.enabled and innermost.policy.fp32_modules:
                rules = ModuleRules(innermost, innermost.policy.fp32_modules)
                stack.callback(rules.remove)
            yield
    finally:
        STATE.regions = saved
        if not saved:
            # The recompute ran after the forward's region had closed: its casts (made from this step's
            # weights) must not outlive it, or the next step's region would reuse them after the optimizer
            # changed the weights (fused optimizers update in place without a version bump we can see).
            STATE.cache.clear()


_Contexts = tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]


def checkpoint_context() -> _Contexts:
    """``context_fn`` for ``torch.utils.checkpoint(..., use_reentrant=False)`` under mixprec regions.

    Called by torch when the segment's forward starts; returns (forward context: nothing to add,
    recompute context: the mixprec regions and modes active now, re-entered).
    """
    return contextlib.nullcontext(), _reentered(list(STATE.regions), _active_modes())


def _python_layer_active() -> bool:
    region = STATE.regions[-1] if STATE.regions else None
    return bool(_active_modes()) or (region is not None and is_current(region) and bool(region.actions))


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    use_reentrant: bool = False,
    context_fn: Callable[[], tuple[Any, Any]] | None = None,
    **kwargs: Any,
) -> Any:
    """``torch.utils.checkpoint.checkpoint`` whose recompute runs under the forward's mixprec regions.

    Non-reentrant (torch's recommended kind) by default. ``use_reentrant=True`` is refused while a mixprec
    Python layer is active (see the module docstring); ``context_fn`` is taken by this function.
    """
    if context_fn is not None:
        raise AutocastError(
            "mixprec's checkpoint supplies its own context_fn (the recompute re-enters the mixprec regions)",
            "call torch.utils.checkpoint.checkpoint directly and combine your contexts with "
            "mixprec.activation_checkpoint.checkpoint_context()",
        )
    if use_reentrant:
        if _python_layer_active():
            raise AutocastError(
                "reentrant activation checkpointing cannot re-enter mixprec's cast rules for the recompute "
                "(it would run other kernels than the forward and give other gradients)",
                "use use_reentrant=False (the default here, and torch's recommendation)",
            )
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=True, **kwargs)
    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, context_fn=checkpoint_context, **kwargs
    )
