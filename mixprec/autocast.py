"""The autocast engine: applies a :class:`~mixprec.policy.Policy` to the ops run inside a region.

``mixprec.autocast(device_type, dtype=None, enabled=True, cache_enabled=True, policy=None)`` is a drop-in
for ``torch.autocast`` (context manager and decorator). How it works, in two layers:

1. **torch's dispatcher-level autocast, always.** Every region enters a real ``torch.autocast`` with the
   same arguments. torch's C++ autocast kernels already implement the default tables (the ``"torch"``
   preset mirrors them), its weight-cast cache, nesting and ``enabled=False``. With the default policy on
   a device/dtype whose GEMMs are fast (CPU bf16, CUDA fp16/bf16) this is *all* that runs: the only extra
   cost over torch.autocast is this context manager's Python enter/exit, once per region.

2. **A Python layer, only where the policy changes something.** When the effective policy (preset + the
   user's global registrations) differs from torch's tables for the region's device and dtype
   (:meth:`Policy.overrides`), or half GEMMs must be emulated, a ``TorchFunctionMode`` is pushed. It sees
   every torch function call, looks up the call's op name in a dict of *only the changed ops* and passes
   everything else straight through (torch's layer still applies to those). A changed op's floating
   inputs are cast per its action and the op runs with torch's autocast switched off, so torch's table
   cannot cast them again -- the same "exclude the autocast key for this op" that torch's kernels do.
   Module rules (``Policy.fp32_modules``, :func:`keep_fp32`) use forward hooks that switch autocast off for
   the module's forward and cast its inputs to fp32.

   The layer works above autograd, so every cast it makes is an ordinary differentiable ``Tensor.to``:
   backward runs in the dtypes forward chose, and it also runs after the region has exited (where a
   ``TorchDispatchMode`` below autograd would no longer be active). The layer keeps its own cast cache,
   keyed like torch's (fp32 leaf tensors that require grad, i.e. parameters), released when the outermost
   mixprec region exits.

The engine, one concept per module: ``region`` (the thread's regions, autocast on/off), ``cast_cache``,
``cast_plan`` (which ops a (policy, device, dtype) region handles, cached), ``cast_handlers`` (one handler
per action), ``fp32_modules`` (keep_fp32 and ``Policy.fp32_modules``), ``half_compute`` (the arithmetic
of half models), ``activation_checkpoint`` (recompute under the same rules); this module is the context
manager and its torch-function mode.

**Emulated half GEMMs.** Where a device has no fast kernels for the region's dtype (fp16 or bf16;
:func:`mixprec.emulation.emulates`, from :mod:`mixprec.hardware`), every ``lower`` op is computed as a
tensor core would (:mod:`mixprec.emulation`: inputs rounded to the half format, fp32 compute and
accumulation, result rounded once). The engine only decides which ops are emulated and caches the
rounded copy of each parameter once per region.

Limitations: the Python layer matches torch functions by name at the Python level (``torch.X``,
``torch.nn.functional.X``, ``Tensor.X``, ``torch.linalg.X``...). A Python-level composite in
``torch.nn.functional`` (e.g. ``multi_head_attention_forward``) is opaque to it: the ops it calls follow
torch's own tables (and, under fp16 on CPU, torch's slow fp16 kernels). Ops that exist only at the aten
level (``native_layer_norm``, ``upsample_*``) can be changed only through the Python function that calls
them.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from mixprec.activation_checkpoint import cover_segment
from mixprec.cast_handlers import HANDLERS
from mixprec.cast_plan import plan, region_for
from mixprec.errors import AutocastError, BannedOpError, PolicyError
from mixprec.fp32_modules import ModuleRules, keep_fp32, release_fp32
from mixprec.half_compute import half_compute
from mixprec.half_relu import RELU_NAMES, relu
from mixprec.policy.cast_policy import Policy
from mixprec.policy.devices import device_spec
from mixprec.policy.names import PY_ALIASES
from mixprec.policy.presets import DEFAULT_POLICY
from mixprec.policy.registry import registry_version
from mixprec.region import (
    STATE,
    TRACEABLE_ENTER,
    Region,
    RegionMode,
    compiled_mode,
    current_region,
    eager_backward_tracing,
    func_name,
    is_current,
    pop_region,
    push_region,
)
from mixprec.warn_site import user_stacklevel

__all__ = [
    "autocast",
    "half_compute",
    "keep_fp32",
    "release_fp32",
    "AutocastError",
    "BannedOpError",
    "current_region",
    "Region",
]


# A plain dict for the mode to read: Dynamo breaks the graph at a mappingproxy read once the traced frame
# has written any dict (a forward filling an output dict: "mapping proxy affected by dictionary mutation").
_PY_ALIASES: dict[str, str] = dict(PY_ALIASES)


class _PolicyMode(RegionMode):
    """The Python layer: handles the ops in ``region.actions``, passes every other call through."""

    def __init__(self, region: Region) -> None:
        super().__init__()
        self.region = region
        self.actions = region.actions

    def in_charge(self) -> bool:
        return is_current(self.region)

    def changes(self, name: str) -> bool:
        return name in self.actions or (self.region.emulate and name in RELU_NAMES)

    def handle(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        name = func_name(func)
        action = self.actions.get(name) if name is not None else None
        # A policy rule for relu wins; without one, an emulated region's ReLU goes to half_relu.py.
        half_relu = action is None and self.region.emulate and name in RELU_NAMES
        if action is None and not half_relu:  # compiled code, and composites of GEMMs: pass_on decides
            return self.pass_on(func, args, kwargs)
        if not is_current(self.region):
            return func(*args, **kwargs)
        region = self.region
        cover_segment(self)  # in a checkpointed segment, its recompute must change this op the same way
        if half_relu:
            return relu(func, args, kwargs, region.dtype, region.device_type)
        return HANDLERS[action](region, _PY_ALIASES.get(name, name), func, args, kwargs)


# One mode per cached region: entering the same region every step reuses it, so a compiled model run
# inside keeps its guards instead of recompiling each step.
_MODES: dict[int, tuple[Region, _PolicyMode]] = {}


def _mode_for(region: Region) -> _PolicyMode:
    hit = _MODES.get(id(region))
    if hit is not None and hit[0] is region:
        return hit[1]
    mode = _PolicyMode(region)
    if len(_MODES) >= 64:  # bounded like the plans and regions it follows
        _MODES.clear()
    _MODES[id(region)] = (region, mode)
    return mode


def _untraced(method: Callable[..., Any]) -> Callable[..., Any]:
    return torch.compiler.disable(method, recursive=True)


@functools.cache
def _warn_eager_region() -> None:
    warnings.warn(
        f"mixprec.autocast inside torch.compile needs torch 2.13 or newer to be traced; with torch "
        f"{torch.__version__} the region is entered eagerly (a graph break) and the code inside it is "
        "compiled on its own. Fix: upgrade torch, or enter mixprec.autocast outside the compiled function.",
        stacklevel=user_stacklevel(),
    )


def _mode_of(policy_key: str, device_type: str, dtype: torch.dtype, cache_enabled: bool, _: int) -> Any:
    """The mode of an enabled region (None: no Python layer), for compiled code: the policy comes by its
    compile_key (never reused, where an id() of a freed policy could name a new one); the last argument,
    the registry version, is there to be part of the key."""
    made = plan(Policy.from_compile_key(policy_key), device_type, dtype)
    if made.policy.fp32_modules:
        raise AutocastError(
            f"policy {made.policy.name!r} has fp32_modules, which need global module hooks that "
            "torch.compile cannot trace",
            "mark those modules with mixprec.keep_fp32(module), or enter mixprec.autocast outside the "
            "compiled function",
        )
    region = region_for(made, device_type, dtype, cache_enabled)
    return _mode_for(region) if region.actions else None


def _resolve_dtype(device_type: str, dtype: torch.dtype | None, enabled: bool) -> tuple[torch.dtype, bool]:
    """The region's dtype and whether it is enabled, by torch.autocast's rules (the module docstring)."""
    if not enabled:
        # A disabled region casts nothing: torch accepts any device type it knows ("xpu", "mps", "cuda:0",
        # ...) and any dtype there, so that code written for several devices can switch autocast off.
        return (torch.get_autocast_dtype(device_type) if dtype is None else dtype), False
    spec = device_spec(device_type)
    supported = ", ".join(str(d) for d in spec.autocast_dtypes)
    if dtype is None:
        return torch.get_autocast_dtype(device_type), enabled
    if not isinstance(dtype, torch.dtype):
        raise AutocastError(f"dtype must be a torch.dtype, got {dtype!r}", f"use dtype={supported}")
    if dtype in spec.autocast_dtypes:
        return dtype, enabled
    if dtype is torch.float32:
        # torch warns and runs the region disabled: full precision is what an fp32 "autocast" asks for.
        warnings.warn(
            f"mixprec.autocast({device_type!r}, dtype=torch.float32) casts nothing: the region runs with "
            "autocast disabled, as torch.autocast does. Write enabled=False to say so, or use "
            f"dtype={supported}.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
        return dtype, False
    if not dtype.is_floating_point:
        raise AutocastError(
            f"autocast casts to a floating dtype, and {dtype} is not one",
            f"use dtype={supported} on {device_type!r} (integer types are for quantization, not autocast)",
        )
    # torch would disable the region and compute in fp32; a float64 request would silently get fp32.
    raise AutocastError(
        f"{device_type!r} autocast does not support {dtype}",
        f"use dtype={supported} (for full precision, use enabled=False)",
    )


def _torch_enables(device_type: str) -> bool:
    """Whether torch.autocast enables a region on ``device_type`` here: it disables a "cuda" one, with a
    warning, where CUDA is unavailable (the one device mixprec takes that torch can turn off). Asked when the
    region is made, as torch asks, so the warning names the user's line and comes once per region object
    (a decorator's: once), not from mixprec at every entry. No ``warnings.catch_warnings`` here: it would
    reset Python's once-per-line registry at every region made (an O1 model makes one per forward)."""
    if device_type != "cuda" or torch.cuda.is_available():
        return True
    warnings.warn(  # torch.autocast's own words
        "User provided device_type of 'cuda', but CUDA is not available. Disabling", UserWarning,
        stacklevel=user_stacklevel(),  # the user's region, or their call of a prepared model
    )
    return False


_Frame = tuple[Any, Region, "_PolicyMode | None", "ModuleRules | None", Any]


def _refuse_export() -> None:
    # torch.export (non-strict) records this object's region as torch's autocast around ops traced in
    # fp32: the program computes other dtypes than the eager run (a failed dtype check when run). An
    # error now beats a program that is wrong later. A prepared model's forward enters the region's
    # compiled_contexts instead, which export records as they run.
    raise AutocastError(
        "torch.export of code inside a `with mixprec.autocast(...)` block is not supported: the exported "
        "program would compute other dtypes than the eager run.",
        "export a model mixprec.initialize prepared (O1-O3: its region exports), the fp32 model "
        "(mixprec.amp.restore(model)), or code that uses torch.autocast itself.",
    )


class autocast:  # noqa: N801 - lower case like torch.autocast, which it replaces
    """Drop-in for ``torch.autocast`` that applies a mixprec cast policy (see the module docstring).

    Args:
        device_type: ``"cpu"`` or ``"cuda"``; with ``enabled=False`` any device type torch knows.
        dtype: the half-precision dtype; None takes torch's current default for the device
            (``torch.get_autocast_dtype``: bf16 on CPU, fp16 on CUDA). ``torch.float32`` runs the region
            disabled with a warning, as torch does; with ``enabled=False`` any dtype is accepted.
        enabled: False makes the region a no-op region that switches autocast *off*, as in torch.
        cache_enabled: cache the casts of fp32 parameters for the region; None (torch's default) takes
            ``torch.is_autocast_cache_enabled()`` when the region is made, so a region made inside one
            with ``cache_enabled=False`` does not cache either.
        policy: a :class:`~mixprec.policy.Policy`; None is ``mixprec.policy.DEFAULT_POLICY``. The user's
            global register_* registrations apply on top of it.

    Works inside ``torch.compile`` (fullgraph) with torch 2.13 or newer: there the region enters torch's
    autocast through the traceable ``torch.amp._enter_autocast`` and skips the thread-local stack and the
    cast cache, which Dynamo cannot trace (the compiler deduplicates casts itself). An older torch enters
    the region eagerly (a graph break, with a warning) and compiles the code inside it on its own.
    ``Policy.fp32_modules`` needs global module hooks and is refused in compiled code: use
    :func:`keep_fp32`, or enter the region outside.

    Where it differs from torch.autocast, on purpose (tests/test_autocast*.py compare the rest with it):
    an enabled region on a device other than "cpu" or "cuda", or with a dtype the device cannot autocast
    to (float64, integers), raises ``AutocastError`` naming the fix, where torch warns and runs the region
    disabled (full precision where half was asked for); ``torch.float32`` warns and disables, as torch. The
    default policy refuses ``binary_cross_entropy`` under fp16 (``BannedOpError``), where torch runs it in
    fp32: see ``mixprec.policy.tables``. One instance entered again while it is active (a recursive
    decorated function) restores the outer state on each exit; torch's keeps one saved state and leaves
    autocast on after the outer exit.
    """

    def __init__(
        self,
        device_type: str,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
        policy: Policy | None = None,
    ) -> None:
        self.device = device_type
        # torch raises this TypeError on entering; "yes" or 0 would otherwise read as a bool
        for name, value, kinds in (("enabled", enabled, bool), ("cache_enabled", cache_enabled, bool | None)):
            if not isinstance(value, kinds):
                kind = type(value)
                raise TypeError(f"{name} must be a bool (got {kind.__module__}.{kind.__qualname__})")
        # torch's rule: None inherits the cache setting in force where the region is made
        self._cache_enabled = torch.is_autocast_cache_enabled() if cache_enabled is None else cache_enabled
        self.policy = policy
        self._frames: list[_Frame] = []
        self._compiled_frames: list[tuple[Any, Any]] = []
        if not isinstance(device_type, str):
            raise AutocastError(f"device_type must be a string, got {device_type!r}", "use 'cpu' or 'cuda'")
        try:
            self.fast_dtype, self._enabled = _resolve_dtype(device_type, dtype, enabled)
        except PolicyError as err:
            raise AutocastError(err.problem, err.fix) from None
        if self._enabled and not torch.compiler.is_compiling():
            self._enabled = _torch_enables(device_type)
        if policy is not None and not isinstance(policy, Policy):
            raise AutocastError(
                f"policy must be a mixprec.policy.Policy, got {type(policy).__name__}",
                "use mixprec.policy.get_preset(name), or a Policy derived from one",
            )

    def _region(self, enabled: bool) -> Region:
        policy = self.policy if self.policy is not None else DEFAULT_POLICY
        if not enabled:
            return Region(self.device, self.fast_dtype, False, self._cache_enabled, policy, False, {})
        made = plan(policy, self.device, self.fast_dtype)
        return region_for(made, self.device, self.fast_dtype, self._cache_enabled)

    def __enter__(self) -> autocast:
        if torch.compiler.is_compiling() and not TRACEABLE_ENTER:
            # Before torch 2.13 Dynamo also answers is_exporting() with True in any traced code (a constant
            # it folds, not the flag torch.export sets), so the export check is made untraced, where it
            # reads the flag.
            return _untraced(self._enter_eager_from_compiled)()
        self._refuse_export_if_exporting()
        if torch.compiler.is_compiling():
            return self._enter_compiled()
        return self._enter_eager()

    def _refuse_export_if_exporting(self) -> None:
        if self._enabled and torch.compiler.is_exporting():
            _refuse_export()

    def _enter_eager_from_compiled(self) -> autocast:
        self._refuse_export_if_exporting()
        _warn_eager_region()  # here, not while tracing: Dynamo inlines the function and ignores its cache
        return self._enter_eager()

    def _enter_eager(self) -> autocast:
        torch_region = torch.autocast(
            self.device, dtype=self.fast_dtype, enabled=self._enabled, cache_enabled=self._cache_enabled
        )
        torch_region.__enter__()
        undo: list[Callable[[], Any]] = []  # what was entered so far, to leave if a later step raises
        try:
            # torch turns a region off (with a warning) when e.g. CUDA is unavailable; follow it.
            region = self._region(bool(getattr(torch_region, "_enabled", self._enabled)))
            push_region(region)
            undo.append(functools.partial(pop_region, region))
            mode = _mode_for(region) if region.actions else None
            if mode is not None:
                mode.__enter__()
                undo.append(functools.partial(mode.__exit__, None, None, None))
            tracing = eager_backward_tracing() if mode is not None else contextlib.nullcontext()
            tracing.__enter__()
            undo.append(functools.partial(tracing.__exit__, None, None, None))
            modules = region.policy.fp32_modules if region.enabled else ()
            rules = ModuleRules(region, modules, functools.partial(cover_segment, None)) if modules else None
        except BaseException:
            for step in reversed(undo):
                step()
            torch_region.__exit__(None, None, None)
            raise
        self._frames.append((torch_region, region, mode, rules, tracing))
        return self

    def compiled_contexts(self) -> tuple[Any, Any]:
        """The region as two context managers Dynamo can resume after a graph break: torch's autocast and
        the policy's torch-function mode. Dynamo cannot resume this class itself: after a break inside
        it, it ran the rest of the code outside the region, in fp32. For compiled code only (no fp32
        modules: they need hooks Dynamo cannot trace)."""
        torch_region = torch.autocast(
            self.device, dtype=self.fast_dtype, enabled=self._enabled, cache_enabled=self._cache_enabled
        )
        mode = self._compiled_mode()
        return torch_region, (mode if mode is not None else contextlib.nullcontext())

    def _compiled_mode(self) -> Any:
        # Reading the registry version here makes it a guard: a new registration recompiles. A disabled
        # region has no mode (its device may be one no policy plans for).
        if not self._enabled:
            return None
        policy = self.policy if self.policy is not None else DEFAULT_POLICY
        return compiled_mode(
            _mode_of, policy.compile_key, self.device, self.fast_dtype, self._cache_enabled,
            registry_version(),
        )

    def _enter_compiled(self) -> autocast:
        mode = self._compiled_mode()
        torch_region = torch.amp._enter_autocast(
            self.device, self.fast_dtype, self._enabled, self._cache_enabled
        )
        if mode is not None:
            mode.__enter__()
        self._compiled_frames.append((torch_region, mode))
        return self

    def __exit__(self, *exc: Any) -> None:
        if torch.compiler.is_compiling():
            if TRACEABLE_ENTER:
                self._exit_compiled(*exc)
            else:
                _untraced(self._exit_eager)(*exc)
            return
        self._exit_eager(*exc)

    def _exit_eager(self, *exc: Any) -> None:
        torch_region, region, mode, rules, tracing = self._frames.pop()
        try:
            if rules is not None:
                rules.remove()
            tracing.__exit__(*exc)
            if mode is not None:
                mode.__exit__(*exc)
        finally:
            pop_region(region)
            if not STATE.regions:
                STATE.cache.clear()  # casts live for the outermost region only, as in torch
            torch_region.__exit__(*exc)

    def _exit_compiled(self, *exc: Any) -> None:
        torch_region, mode = self._compiled_frames.pop()
        if mode is not None:
            mode.__exit__(*exc)
        torch.amp._exit_autocast(torch_region)

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(fn):  # as torch: a region decorates functions
            raise TypeError(f"mixprec.autocast decorates a function, got {type(fn).__name__}")

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not torch.compiler.is_compiling():
                with self:
                    return fn(*args, **kwargs)
            # Traced by torch.compile: this object, made outside the traced code, is a context manager
            # Dynamo refuses (fullgraph) or runs the function outside of (fp32); torch's autocast and the
            # policy's torch-function mode it traces, and resumes after a graph break, as torch's decorator
            torch_region, mode = self.compiled_contexts()
            with torch_region, mode:
                return fn(*args, **kwargs)

        return wrapper

    def __repr__(self) -> str:
        policy = self.policy.name if self.policy is not None else "default"
        return (
            f"mixprec.autocast({self.device!r}, dtype={self.fast_dtype}, enabled={self._enabled}, "
            f"cache_enabled={self._cache_enabled}, policy={policy!r})"
        )
