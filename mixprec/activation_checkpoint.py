"""Activation checkpointing inside mixprec regions: the recompute runs under the same cast rules.

``torch.utils.checkpoint`` re-runs a segment's forward during backward. It restores torch's own autocast
state for that recompute, but not mixprec's Python layer (the policy's changed ops, emulated half GEMMs,
``half_compute``, ``fp32_modules``): left alone, the recompute runs other kernels in other dtypes than the
forward did; non-reentrant checkpointing then raises ``CheckpointError`` (saved tensors' dtypes differ)
and reentrant checkpointing silently gives other gradients.

So the first op inside a segment that a region's Python layer changes calls :func:`cover_segment`, which
wraps the recompute of the segment (of every non-reentrant one around that op, and of a reentrant one) to
re-enter the regions in force when the segment started: torch's checkpoint of either kind, and
``checkpoint_sequential``, work as they do under torch.autocast. It reaches into torch's private
checkpoint code (torch 2.11 to 2.14); where that is not the shape it knows, it warns with the fix.

The explicit way, which needs nothing of torch's internals: non-reentrant checkpointing with
:func:`checkpoint_context` as its ``context_fn``, or :func:`checkpoint`, which passes it for you::

    from mixprec.activation_checkpoint import checkpoint, checkpoint_context

    y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False, context_fn=checkpoint_context)
    y = checkpoint(block, x)  # the same

``checkpoint_context`` records the mixprec regions in force when the segment's forward runs and
re-enters exactly those for its recompute. A model mixprec prepared (``initialize`` at O1-O3, ``to_fp16``,
``to_bf16``) also re-enters by module: each submodule re-enters the model's region when called outside it
in a recompute (``half_model._submodule_forward``).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint

from mixprec.errors import AutocastError
from mixprec.fp32_modules import ModuleRules
from mixprec.region import STATE, EntryMark, Region, RegionMode, reentrant_forward_ctxs, top_pack_hook

__all__ = ["checkpoint", "checkpoint_context"]


def _active_modes() -> list[RegionMode]:
    return [m for m in torch.overrides._get_current_function_mode_stack() if isinstance(m, RegionMode)]


@contextlib.contextmanager
def _reentered(regions: list[Region], modes: list[RegionMode]) -> Iterator[None]:
    """The forward's region stack and modes again, for a recompute that may run outside them."""
    saved, saved_under = STATE.regions, STATE.entered_under
    STATE.regions = list(regions)
    # re-entered for the recompute: under its hook, inside no reentrant segment
    STATE.entered_under = [EntryMark(top_pack_hook(), None)] * len(regions)
    rules = None
    try:
        with contextlib.ExitStack() as stack:
            for mode in modes:
                stack.enter_context(mode)
            innermost = regions[-1] if regions else None
            if innermost is not None and innermost.enabled and innermost.policy.fp32_modules:
                modules = innermost.policy.fp32_modules
                rules = ModuleRules(innermost, modules, functools.partial(cover_segment, None))
                stack.callback(rules.remove)
            yield
    finally:
        STATE.regions, STATE.entered_under = saved, saved_under
        if not saved:
            # The recompute ran after the forward's region had closed: its casts (made from this step's
            # weights) must not outlive it, or the next step's region would reuse them after the optimizer
            # changed the weights (fused optimizers update in place without a version bump we can see).
            STATE.cache.clear()


_Contexts = tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]


def checkpoint_context() -> _Contexts:
    """``context_fn`` for ``torch.utils.checkpoint(..., use_reentrant=False)`` under mixprec regions.

    Called by torch when the segment's forward starts; returns (forward context: marks the segment as
    covered, for :func:`cover_segment`; recompute context: the mixprec regions and modes active now,
    re-entered).
    """
    return _marked_covered(), _reentered(list(STATE.regions), _active_modes())


# torch's non-reentrant checkpoint pushes this pack hook for a segment's forward (torch.utils.checkpoint.
# _checkpoint_hook, torch 2.11 to 2.14); its closure holds the segment's _CheckpointFrame, whose
# recompute_fn the backward calls. Private to torch: where the name or the closure differ, cover_segment
# warns with the fix instead.
SEGMENT_PACK_HOOK = "_checkpoint_hook.__init__.<locals>.pack_hook"

# Pack hooks of segments whose recompute already re-enters the regions: given checkpoint_context, or
# covered by cover_segment. Weak: a segment's hook lives as long as its saved tensors.
_COVERED: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()


@contextlib.contextmanager
def _marked_covered() -> Iterator[None]:
    pack = top_pack_hook()  # torch enters the segment's hook before this forward context
    if pack is not None:
        _COVERED.add(pack)
    yield


def _segment_frame(pack: Callable[..., Any]) -> Any:
    """The _CheckpointFrame that torch's segment pack hook ``pack`` closes over, or None if its shape is
    not the one this was written against."""
    code, cells = getattr(pack, "__code__", None), getattr(pack, "__closure__", None)
    if code is None or cells is None or "frame" not in code.co_freevars:
        return None
    frame = cells[code.co_freevars.index("frame")].cell_contents
    return frame if callable(getattr(frame, "recompute_fn", None)) else None


# Top hooks whose saved-tensors hook stack cover_segment has walked: while a hook stays on top, the stack
# under it cannot change, so each is walked once (weak: a hook lives as long as its context or segment).
_WALKED: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()


def cover_segment(mode: RegionMode | None) -> None:
    """Called by a region's ``mode`` (or its fp32-module rules, None) before its Python layer changes an op
    (torch takes the mode off the stack while it handles the op: it is passed, the ones below are read).

    Inside non-reentrant ``torch.utils.checkpoint`` segments given no :func:`checkpoint_context`, the
    recompute would run that op without the layer, after the region closed (torch's CheckpointError, or
    other gradients): each such segment on the saved-tensors hook stack, nested ones and those under a
    hook of the user's (``save_on_cpu``) included, has its recompute wrapped so that it re-enters the
    regions in force when it started, as ``checkpoint_context`` does. Regions entered inside a segment
    are left to the segment's own code."""
    if torch.compiler.is_compiling():
        return  # compiled code traces checkpoints itself
    if not torch.is_grad_enabled():  # where torch's reentrant checkpoint runs a segment: a frame walk,
        _cover_reentrant(mode)  # ~4-11 us per changed op under no_grad (evaluation pays it too)
    top = top_pack_hook()
    if top is None or top in _WALKED:
        return
    stack = _pack_hooks()
    _WALKED.add(top)
    for depth, pack in enumerate(stack):
        if getattr(pack, "__qualname__", None) == SEGMENT_PACK_HOOK and pack not in _COVERED:
            _COVERED.add(pack)
            _cover(pack, stack[depth:], mode)


def _cover_reentrant(mode: RegionMode | None) -> None:
    """:func:`cover_segment` for torch's reentrant checkpoint (Hugging Face's default): the recompute of
    each segment around this op (``ctx.run_function``) re-enters the regions in force when it started."""
    for ctx in reentrant_forward_ctxs():
        if ctx is None or getattr(ctx, "_mixprec_covered", False):
            continue
        ctx._mixprec_covered = True
        if not callable(getattr(ctx, "run_function", None)):
            _warn_unreachable("use_reentrant=False with context_fn=mixprec.checkpoint_context")
            continue
        inside: Callable[[EntryMark], bool] = functools.partial(EntryMark.inside_reentrant, ctx=ctx)
        _rewrap(ctx, "run_function", *_in_force_at_start(inside, mode))


def _pack_hooks() -> list[Callable[..., Any]]:
    """The pack hooks of this thread's saved-tensors hook stack, outermost first. torch exposes only the
    top: each is popped and all are pushed back, in order, whatever happens."""
    popped: list[tuple[Any, Any]] = []
    try:
        while (hooks := torch._C._autograd._top_saved_tensors_default_hooks(False)) is not None:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            popped.append(hooks)
    finally:
        for pack, unpack in reversed(popped):
            torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)
    return [pack for pack, _ in reversed(popped)]


def _cover(pack: Callable[..., Any], inner: list[Callable[..., Any]], mode: RegionMode | None) -> None:
    """Wrap the recompute of the non-reentrant segment whose pack hook is ``pack``; ``inner``: it and the
    hooks pushed after it (a region entered under any of them was entered inside the segment)."""
    frame = _segment_frame(pack)
    if frame is None:
        _warn_unreachable("pass context_fn=mixprec.checkpoint_context (use_reentrant=False), or call "
                          "mixprec.activation_checkpoint.checkpoint")
        return
    later = {id(h) for h in inner}
    _rewrap(frame, "recompute_fn", *_in_force_at_start(lambda mark: id(mark.hook) in later, mode))


def _in_force_at_start(
    inside: Callable[[EntryMark], bool], mode: RegionMode | None
) -> tuple[list[Region], list[RegionMode]]:
    """The regions and modes in force when a segment started: those entered before the first entry made
    ``inside`` it. A half_compute mode (one cached object, maybe entered again inside) counts if any of
    its entries came before; an autocast region's mode goes with its region."""
    cut = next((i for i, mark in enumerate(STATE.entered_under) if inside(mark)), None)
    regions = STATE.regions if cut is None else STATE.regions[:cut]
    half_before: dict[int, bool] = {}
    for m, mark in STATE.half_entries:
        half_before[id(m)] = half_before.get(id(m), False) or not inside(mark)

    def before(m: RegionMode) -> bool:
        if id(m) in half_before:
            return half_before[id(m)]
        return cut is None or any(getattr(m, "region", None) is r for r in regions)

    return list(regions), [m for m in [*_active_modes(), *([mode] if mode is not None else [])] if before(m)]


def _rewrap(owner: Any, attr: str, regions: list[Region], modes: list[RegionMode]) -> None:
    """Replace the recompute function ``owner.attr`` by one that runs it with ``regions`` re-entered."""
    run = getattr(owner, attr)

    def in_regions(*args: Any) -> Any:
        with _reentered(regions, modes):
            return run(*args)

    setattr(owner, attr, in_regions)


def _warn_unreachable(fix: str) -> None:
    warnings.warn(
        "a torch.utils.checkpoint segment runs under mixprec's cast rules, and this torch's checkpoint is "
        "not one mixprec can re-enter them for; its recompute may raise CheckpointError or give other "
        f"gradients. Fix: {fix}.",
        stacklevel=5,
    )


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    use_reentrant: bool = False,
    context_fn: Callable[[], tuple[Any, Any]] | None = None,
    **kwargs: Any,
) -> Any:
    """``torch.utils.checkpoint.checkpoint`` whose recompute runs under the forward's mixprec regions.

    Non-reentrant (torch's recommended kind) by default, with :func:`checkpoint_context`;
    ``use_reentrant=True`` is torch's, covered as in the module docstring. ``context_fn`` is taken by
    this function.
    """
    if context_fn is not None:
        raise AutocastError(
            "mixprec's checkpoint supplies its own context_fn (the recompute re-enters the mixprec regions)",
            "call torch.utils.checkpoint.checkpoint directly and combine your contexts with "
            "mixprec.activation_checkpoint.checkpoint_context()",
        )
    if use_reentrant:  # its recompute is covered by the first op the layer changes (cover_segment)
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=True, **kwargs)
    if torch.compiler.is_compiling():
        # Compiled code traces the segment and its recompute itself: nothing to re-enter. (torch.compile
        # takes only a context_fn of two TorchDispatchModes, and failed on this one: a user trial.)
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)
    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, context_fn=checkpoint_context, **kwargs
    )
