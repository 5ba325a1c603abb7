"""The state of mixprec.autocast regions: the entered :class:`Region` s of this thread and their cast cache.

A region is in charge of an op when it is the innermost one and torch's autocast is on with its dtype
(:func:`is_current`). Regions entered inside compiled code are not pushed on the thread's stack (Dynamo
cannot trace thread-local state); there the torch-function mode stack alone decides who sees an op first.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode

from mixprec.cast_cache import CastCache
from mixprec.composite_ops import composite_of, traceable_form

if TYPE_CHECKING:
    from mixprec.policy.cast_policy import Policy
    from mixprec.policy.rules import Action

__all__ = [
    "EMULATED_NODE_KEY",
    "EntryMark",
    "Region",
    "RegionMode", "call_without_autocast", "eager_backward_tracing", "current_region", "in_any_region",
    "is_current", "pop_region", "push_region", "reentrant_forward_ctxs", "STATE", "top_pack_hook"]


@dataclass(eq=False)
class Region:
    """One kind of mixprec.autocast region (thread-local stack; innermost last).

    Regions are cached per (policy, device, dtype, cache_enabled) plan, so entering the same region every
    step gives the same object (what keeps compiled code that reads it from recompiling).
    """

    device_type: str
    dtype: torch.dtype
    enabled: bool
    cache_enabled: bool
    policy: Policy
    emulate: bool
    # Python-level function name -> action, for the ops the Python layer must handle (empty: none).
    actions: dict[str, Action]


# Dynamo of torch 2.11 ran torch.amp._enter_autocast eagerly while tracing, then failed its check that tracing
# leaves the global autocast state alone ("Global autocast(cuda)_enabled state changed while dynamo
# tracing"); 2.13 traces it. Before 2.13 a region met in compiled code is entered and left eagerly instead
# (a graph break; the code inside the region is compiled under the region's mode, which Dynamo inlines).
TRACEABLE_ENTER = torch.__version__ >= (2, 13)  # a TorchVersion: compares with a tuple


def _compiled_only_inlined(function: Callable[..., Any]) -> None:
    """Dynamo compiles ``function`` inside the code it traces (inlined), never as a frame of its own;
    called from code Dynamo runs eagerly, it runs eagerly, with whatever it calls.

    A mode's ``__torch_function__`` is called from eager frames of a compiled model wherever Dynamo gave up
    on a frame (a graph break in a loop, a side-effecting hook: the forward runs eagerly). Left to Dynamo,
    each such call was compiled as a frame of its own, once per op signature: torch 2.11 decided wrong there
    (a GPT's loss came out in fp16); 2.13 decides right but recompiles until ``recompile_limit`` (8) and
    warns, pointing into mixprec, and a BERT's step took 2.3x torch.autocast's (a user trial). Run
    eagerly, it decides as for an eager region (``is_current`` and the cast cache know a mode that compiled
    code entered).
    """
    try:  # Dynamo's frame-level switch (torch 2.6 and later); without it, frames are compiled as before
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except ImportError:
        return
    set_code_exec_strategy(function.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))


# Bound on a mode's memo of functions it leaves alone: torch's API is a few thousand callables, and a
# program that made new ones without end (fresh lambdas with __torch_function__) must not grow it for ever.
_PLAIN_MEMO_SIZE = 4096


class RegionMode(TorchFunctionMode):
    """Base of the torch-function modes mixprec regions push (a checkpoint recompute re-enters them).

    Most ops a region sees are ones its mode never changes (additions, views, activations): in eager code
    each function is looked up by name once, and later calls of it go straight through, ~0.6 us a call
    sooner (thousands of calls a step in a model of many small ops). A subclass says which names it may
    change (:meth:`changes`) and handles the ops that may be changed (:meth:`handle`).
    """

    def __init__(self) -> None:
        super().__init__()
        # function -> whether this mode leaves every call of it alone. It holds the functions (torch's, or
        # a library's callables with __torch_function__) alive while the mode is cached: bounded above.
        self._plain: dict[Any, bool] = {}

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        # Compiled code traces handle() every time: Dynamo would guard on the memo, which grows.
        if not torch.compiler.is_compiling() and self._leaves_alone(func):
            return func(*args, **kwargs)
        return self.handle(func, args, kwargs)

    def _leaves_alone(self, func: Any) -> bool:
        try:
            plain = self._plain.get(func)
        except TypeError:  # an unhashable callable: decided at each call
            return False
        if plain is None:
            name = func_name(func)
            plain = composite_of(func) is None and (name is None or not self.changes(name))
            if len(self._plain) >= _PLAIN_MEMO_SIZE:
                self._plain.clear()
            self._plain[func] = plain
        return plain

    def changes(self, name: str) -> bool:
        """Whether this mode may change a call of the function named ``name`` (then :meth:`handle` decides
        each call); False for every name it passes on whatever the arguments."""
        raise NotImplementedError

    def handle(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One call of ``func`` the mode may change (every call, in compiled code)."""
        raise NotImplementedError

    def in_charge(self) -> bool:
        """Whether the mode's region handles ops right now (a nested region or keep_fp32 may say no)."""
        return True

    def pass_on(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``func`` as the mode passes it on: as it is, but a composite of GEMMs (composite_ops.py) with
        this mode on, so its inner ops are handled too, and in compiled code a Tensor method Dynamo cannot
        trace from here as the torch function that computes the same. (Compiled code before torch 2.13,
        which enters a region eagerly, traces torch's own composite: untested there.)"""
        compiling = torch.compiler.is_compiling()
        composite = composite_of(func) if TRACEABLE_ENTER or not compiling else None
        if composite is None or not self.in_charge():
            return (traceable_form(func) if compiling else func)(*args, **kwargs)
        with self:
            return composite(*args, **kwargs)


_compiled_only_inlined(RegionMode.__torch_function__)  # the subclasses' handle() runs inside it


# Modes of regions entered inside compiled code, by a string key. Dynamo reads this dict as a global, so
# it can guard on the entry it uses; the key comes from _compiled_key, which Dynamo runs eagerly while
# tracing (assume_constant_result), because plan caches and the tables' cached properties are not
# traceable. Entries are never replaced, so a guard on one stays true.
_COMPILED_MODES: dict[str, RegionMode | None] = {}


@torch.compiler.assume_constant_result
def _compiled_key(make: Callable[..., RegionMode | None], *args: Any) -> str:
    if not all(isinstance(a, (str, bool, int, torch.dtype)) for a in args):
        # an id() would outlive its object and name the next one at that address
        raise TypeError(f"compiled_mode takes strings, bools, ints and dtypes, got {args!r}")
    parts = (str(a) for a in args)
    key = f"{make.__module__}.{make.__qualname__}(" + ", ".join(parts) + ")"
    if key not in _COMPILED_MODES:
        _COMPILED_MODES[key] = make(*args)
    return key


def compiled_mode(make: Callable[..., RegionMode | None], *args: Any) -> RegionMode | None:
    """``make(*args)`` -- the mode a region enters -- made once per distinct args, in compiled code.

    ``args`` are strings, bools, ints or dtypes: torch.compile before torch 2.13 cannot hand it anything
    else (a frozen dataclass raised while tracing), so a policy comes as its ``compile_key``.
    """
    return _COMPILED_MODES[_compiled_key(make, *args)]


def func_name(func: Any) -> str | None:
    """The Python-level name of a function a torch-function mode receives (None if it has none)."""
    if torch.compiler.is_compiling():
        # Dynamo traces attribute access on torch functions but not getattr() with a default; every
        # function it hands a mode is a torch function or method, which has a __name__.
        return func.__name__
    return getattr(func, "__name__", None)


@dataclass(frozen=True)
class EntryMark:
    """What a region was entered under, so that a checkpoint's recompute re-enters only the regions in
    force when its segment started (activation_checkpoint.cover_segment)."""

    # the saved-tensors pack hook then on top (None: none); a non-reentrant segment's own hook there
    # means the region was entered inside that segment, and its recompute enters it by itself
    hook: Any
    # ids of the reentrant checkpoint segments it was entered inside (None: entered with gradients on,
    # so inside none: torch runs those segments under no_grad)
    segments: frozenset[int] | None

    @classmethod
    def now(cls) -> EntryMark:
        return cls(top_pack_hook(), reentrant_segments())

    def inside_reentrant(self, ctx: Any) -> bool:
        return self.segments is not None and id(ctx) in self.segments


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.regions: list[Region] = []
        # Per entry of `regions`: what it was entered under (activation_checkpoint.cover_segment)
        self.entered_under: list[EntryMark] = []
        # half_compute regions entered eagerly and not left (autocast's are in `regions`): their mode, and
        # what it was entered under (activation_checkpoint.cover_segment)
        self.half_entries: list[tuple[Any, EntryMark]] = []
        self.cache = CastCache()
        # For diagnostics.CastTrace: how many traces are active, and the half dtype an emulated GEMM is
        # computing right now (its fp32 kernel then reports as emulated half arithmetic).
        self.traces = 0
        self.emulating: torch.dtype | None = None
        # regions of either kind entered eagerly so far (outside_region.RegionWatch compares two counts)
        self.entries = 0


# Key in an autograd node's metadata: the half dtype whose GEMM this (fp32) node's backward emulates.
EMULATED_NODE_KEY = "mixprec_emulated"


STATE = _ThreadState()


def current_region() -> Region | None:
    """The innermost mixprec.autocast region of this thread, or None outside any."""
    return STATE.regions[-1] if STATE.regions else None


def in_any_region() -> bool:
    """Whether a mixprec region is in force on this thread: an entered autocast region, or a region's
    torch-function mode on the stack (half_compute pushes only the mode)."""
    depth = torch._C._len_torch_function_stack()
    if depth and isinstance(torch._C._get_function_stack_at(depth - 1), RegionMode):
        return True  # the common case, first: inside the model's forward its region's mode is on top
    return bool(STATE.regions) or any(
        isinstance(torch._C._get_function_stack_at(i), RegionMode) for i in range(depth - 1)
    )


def is_current(region: Region) -> bool:
    """Whether ``region`` is in charge right now: innermost, and torch's autocast is on with its dtype.

    A nested ``enabled=False`` region, a keep_fp32 module or a registered function body turns torch's
    autocast off, and then the Python layer steps aside too.
    """
    if not (
        torch.is_autocast_enabled(region.device_type)
        and torch.get_autocast_dtype(region.device_type) == region.dtype
    ):
        return False
    if torch.compiler.is_compiling() or not STATE.regions:
        # No thread-local stack in compiled code: the mode stack's order decides. Nor where no region was
        # entered eagerly: the mode was entered by compiled code, and runs in a frame Dynamo runs eagerly.
        return True
    return STATE.regions[-1] is region


def eager_region_open() -> bool:
    """Whether a region entered eagerly is open on this thread: it clears the cast cache when it leaves.
    (A mode entered by compiled code can run eagerly, in a frame Dynamo gave up on; nothing clears there.)"""
    return bool(STATE.regions or STATE.half_entries)


def top_pack_hook() -> Any:
    """The pack hook of the innermost ``saved_tensors_hooks`` in force on this thread, or None."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks[0] if hooks else None


# torch's reentrant checkpoint runs a segment's forward under no_grad in this method, whose `ctx` local
# holds the run_function its backward recomputes with (torch 2.11 to 2.14).
REENTRANT_FORWARD = ("CheckpointFunction.forward", os.path.join("torch", "utils", "checkpoint.py"))


def reentrant_forward_ctxs(depth: int = 64) -> list[Any]:
    """The ``ctx`` of every torch reentrant checkpoint forward among the callers, innermost first (a
    frame walk: ~4 us at a depth of 10, 11 at 64; the caller decides when it is worth it)."""
    found = []
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            break
        code = frame.f_code
        if (getattr(code, "co_qualname", code.co_name) == REENTRANT_FORWARD[0]
                and code.co_filename.endswith(REENTRANT_FORWARD[1])):
            found.append(frame.f_locals.get("ctx"))
        frame = frame.f_back
    return found


def reentrant_segments() -> frozenset[int] | None:
    """None with gradients on, else the ids of the reentrant checkpoint segments the caller runs inside."""
    if torch.is_grad_enabled():
        return None
    return frozenset(id(ctx) for ctx in reentrant_forward_ctxs())


def push_region(region: Region) -> None:
    """Enter ``region`` on this thread's stack (innermost), recording the saved-tensors hook it is under."""
    STATE.regions.append(region)
    STATE.entered_under.append(EntryMark.now())
    STATE.entries += 1


def pop_region(region: Region) -> None:
    """Leave ``region``: its innermost entry (a cached region entered twice is one object, and each entry
    records the hook it was entered under)."""
    i = len(STATE.regions) - 1 - STATE.regions[::-1].index(region)
    del STATE.regions[i], STATE.entered_under[i]


class _AutocastOff:
    """Switch torch's autocast off for one device (cheaper than entering torch.autocast(enabled=False))."""

    __slots__ = ("device_type", "prev")

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type

    def __enter__(self) -> None:
        self.prev = torch.is_autocast_enabled(self.device_type)
        torch.set_autocast_enabled(self.device_type, False)

    def __exit__(self, *exc: object) -> None:
        torch.set_autocast_enabled(self.device_type, self.prev)


def autocast_off(device_type: str) -> Any:
    """A context that switches torch's autocast off for ``device_type``; the traceable one when compiling."""
    if torch.compiler.is_compiling():
        return torch.autocast(device_type, enabled=False)
    return _AutocastOff(device_type)


def eager_backward_tracing() -> Any:
    """A context under which a model compiled inside an eager region traces its backward without autocast.

    AOTAutograd traces a compiled function's backward when its forward first runs, and by default under the
    autocast state of that call (``torch._functorch.config.backward_pass_autocast = "same_as_forward"``).
    Inside a mixprec region that state is "fp16/bf16 on": the backward GEMMs of ops the Python layer kept
    in fp32 or emulated (fp32 kernels on rounded inputs) would be autocast to native half kernels -- on a
    CPU without half units 20x slower than eager, and with other numerics. Eager autograd runs the backward
    where ``.backward()`` is called, outside the region (torch's documented place), with autocast off: this
    makes compiled code trace it the same way.
    """
    return _BackwardTracingOff()


class _BackwardTracingOff:
    # One attribute set and put back: config.patch() would build a class on every region entry (~40 us).
    def __enter__(self) -> None:
        self.prev = torch._functorch.config.backward_pass_autocast
        torch._functorch.config.backward_pass_autocast = "off"

    def __exit__(self, *exc: object) -> None:
        torch._functorch.config.backward_pass_autocast = self.prev


def call_without_autocast(device_type: str, func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """``func(*args, **kwargs)`` with torch's autocast off, so its tables cannot cast the inputs again."""
    with autocast_off(device_type):
        return func(*args, **kwargs)
