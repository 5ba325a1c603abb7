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

**Emulated half GEMMs.** Where a device has no fast kernels for the region's dtype (fp16 or bf16;
:func:`mixprec.emulation.emulates`, from :mod:`mixprec.hardware`), every ``lower`` op is computed as a
tensor core would (:mod:`mixprec.emulation`: inputs rounded to the half format, fp32 compute and
accumulation, result rounded once). This module only decides which ops are
emulated and caches the rounded copy of each parameter once per region.

Limitations: the Python layer matches torch functions by name at the Python level (``torch.X``,
``torch.nn.functional.X``, ``Tensor.X``, ``torch.linalg.X``...). A Python-level composite in
``torch.nn.functional`` (e.g. ``multi_head_attention_forward``) is opaque to it: the ops it calls follow
torch's own tables (and, under fp16 on CPU, torch's slow fp16 kernels). Ops that exist only at the aten
level (``native_layer_norm``, ``upsample_*``) can be changed only through the Python function that calls
them.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from mixprec.emulation import emulated, emulates, round_to_half
from mixprec.errors import ConfigError, MixprecError
from mixprec.policy import (
    DEVICES,
    PY_ALIASES,
    Action,
    Policy,
    PolicyError,
    device_spec,
    effective_policy,
    registry_version,
)
from mixprec.tensor_args import iter_tensors, map_tensors

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


class AutocastError(ConfigError):
    """Bad arguments to mixprec.autocast or keep_fp32; the message names the fix."""


class BannedOpError(MixprecError, RuntimeError):
    """An op the policy bans was called inside an autocast region (a RuntimeError, like torch's ban)."""


# --------------------------------------------------------------------------------------------------------
# Region state
# --------------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Region:
    """One entered mixprec.autocast region (thread-local; innermost last)."""

    device_type: str
    dtype: torch.dtype
    enabled: bool
    cache_enabled: bool
    policy: Policy
    emulate: bool
    # Python-level function name -> action, for the ops the Python layer must handle (empty: none).
    actions: dict[str, Action]


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.regions: list[Region] = []
        self.cache = _CastCache()
        self.fp32_scopes: list[tuple[int, tuple[str, ...]]] = []


def current_region() -> Region | None:
    """The innermost mixprec.autocast region of this thread, or None outside any."""
    return _STATE.regions[-1] if _STATE.regions else None


def _is_current(region: Region) -> bool:
    """Whether ``region`` is in charge right now: innermost, and torch's autocast is on with its dtype.

    A nested ``enabled=False`` region, a keep_fp32 module or a registered function body turns torch's
    autocast off, and then the Python layer steps aside too.
    """
    regions = _STATE.regions
    return (
        bool(regions)
        and regions[-1] is region
        and torch.is_autocast_enabled(region.device_type)
        and torch.get_autocast_dtype(region.device_type) == region.dtype
    )


_Entry = tuple["weakref.ref[torch.Tensor]", int, torch.Tensor]


class _CastCache:
    """Casts of fp32 parameters, made once per region and reused by every op that reads them.

    Keyed by the tensor's id; a weakref guards against a new tensor reusing a freed id, the version
    counter against in-place updates (e.g. an optimizer step inside the region), and the grad mode
    against reusing a cast made under no_grad (which has no graph) for a forward that needs one.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[int, object, bool], _Entry] = {}

    def get(self, tensor: torch.Tensor, kind: object, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        key = (id(tensor), kind, torch.is_grad_enabled())
        hit = self._entries.get(key)
        if hit is not None and hit[0]() is tensor and hit[1] == tensor._version:
            return hit[2]
        value = make()
        self._entries[key] = (weakref.ref(tensor), tensor._version, value)
        return value

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


_STATE = _ThreadState()


# --------------------------------------------------------------------------------------------------------
# Casting
# --------------------------------------------------------------------------------------------------------


def _eligible(t: torch.Tensor, device_type: str) -> bool:
    # torch's rule (is_autocast_eligible): floating tensors on the region's device; float64 is left alone.
    return t.is_floating_point() and t.dtype is not torch.float64 and t.device.type == device_type


def _cacheable(t: torch.Tensor, region: Region) -> bool:
    # torch's rule: cache casts of fp32 leaves that require grad (parameters) and are not views.
    return (
        region.cache_enabled
        and t.dtype is torch.float32
        and t.requires_grad
        and t.is_leaf
        and not t._is_view()
    )


def _cast_to(region: Region, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    cache = _STATE.cache
    device_type = region.device_type

    def cast(t: torch.Tensor) -> torch.Tensor:
        if t.dtype is dtype or not _eligible(t, device_type):
            return t
        if dtype is not torch.float32 and _cacheable(t, region):
            return cache.get(t, dtype, lambda: t.to(dtype))
        return t.to(dtype)

    return cast


def _round_to_half(region: Region) -> Callable[[torch.Tensor], torch.Tensor]:
    """The emulation's input rounding for ``region``: each parameter rounded (an fp32 one) or upcast (a
    half one, in an O2 model) once per region however often the region uses it, and autograd saves that
    copy for backward, which therefore rounds no weight again."""
    cache = _STATE.cache
    device_type = region.device_type
    dtype = region.dtype

    def cast(t: torch.Tensor) -> torch.Tensor:
        if not _eligible(t, device_type):
            return t
        if region.cache_enabled and t.requires_grad and t.is_leaf and not t._is_view():
            return cache.get(t, ("rounded", dtype), lambda: round_to_half(t, dtype))
        return round_to_half(t, dtype)

    return cast


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


def _call(region: Region, func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    with _AutocastOff(region.device_type):
        return func(*args, **kwargs)


# --------------------------------------------------------------------------------------------------------
# One handler per action
# --------------------------------------------------------------------------------------------------------

Handler = Callable[[Region, str, Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]


def _run_cast(region: Region, dtype: torch.dtype, func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    cast = _cast_to(region, dtype)
    return _call(region, func, map_tensors(cast, args), map_tensors(cast, kwargs))


def _run_lower(region: Region, op: str, func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    if region.emulate:
        return _run_emulated(region, func, args, kwargs)
    return _run_cast(region, region.dtype, func, args, kwargs)


def _run_emulated(region: Region, func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    with _AutocastOff(region.device_type):
        return emulated(func, args, kwargs, region.dtype, round_input=_round_to_half(region))


def _run_fp32(region: Region, op: str, func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    return _run_cast(region, torch.float32, func, args, kwargs)


def _widest(region: Region, args: Any, kwargs: Any) -> torch.dtype:
    # torch's promote: fp32 if any eligible input is fp32, else the region's dtype. Where torch raises
    # (fp16 mixed with bf16) we take fp32, which holds both exactly.
    seen = {t.dtype for t in iter_tensors((args, kwargs)) if _eligible(t, region.device_type)}
    return region.dtype if seen <= {region.dtype} else torch.float32


def _run_promote(region: Region, op: str, func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    return _run_cast(region, _widest(region, args, kwargs), func, args, kwargs)


def _run_banned(region: Region, op: str, func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    rule = region.policy.rule(op, region.device_type, region.dtype)
    advice = (rule.reason if rule is not None else "") or "run it outside the region"
    raise BannedOpError(
        f"{op} is banned inside mixprec.autocast({region.device_type!r}, {region.dtype}) by policy "
        f"{region.policy.name!r}",
        advice,
    )


def _run_native(region: Region, op: str, func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    return _call(region, func, args, kwargs)


_HANDLERS: dict[Action, Handler] = {
    Action.LOWER: _run_lower,
    Action.FP32: _run_fp32,
    Action.PROMOTE: _run_promote,
    Action.BANNED: _run_banned,
    Action.NATIVE: _run_native,
}


class _PolicyMode(TorchFunctionMode):
    """The Python layer: handles the ops in ``region.actions``, passes every other call through."""

    def __init__(self, region: Region) -> None:
        super().__init__()
        self.region = region
        self.actions = region.actions

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", None)
        action = self.actions.get(name) if name is not None else None
        if action is None or not _is_current(self.region):
            return func(*args, **kwargs)
        return _HANDLERS[action](self.region, PY_ALIASES.get(name, name), func, args, kwargs)


def call_registered(key: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run a function wrapped by a register_* decorator under the current region's rule for ``key``."""
    region = _region_for_call(args, kwargs)
    if region is None:
        return fn(*args, **kwargs)
    rule = region.policy.rule(key, region.device_type, region.dtype)
    if rule is None:  # registrations were cleared: behave as an ordinary function
        return fn(*args, **kwargs)
    return _HANDLERS[rule.action](region, key, fn, args, kwargs)


def _region_for_call(args: Any, kwargs: Any) -> Region | None:
    region = current_region()
    if region is not None:
        return region if _is_current(region) else None
    # Under a plain torch.autocast: apply the registration with torch's dtype, no cache, no emulation.
    for t in iter_tensors((args, kwargs)):
        device_type = t.device.type
        if device_type in DEVICES and torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            policy = _plan(_default(), device_type, dtype).policy  # cached: no table rebuild per call
            return Region(device_type, dtype, True, False, policy, False, {})
    return None


# --------------------------------------------------------------------------------------------------------
# Plans: what a (policy, device, dtype) region needs from the Python layer, computed once
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    policy: Policy
    emulate: bool
    actions: dict[str, Action]


_PLANS: dict[tuple[int, int, str, torch.dtype, bool], tuple[Policy, _Plan]] = {}
_PLANS_MAX = 64  # policies are usually a few long-lived presets; bound the cache for the rest


def _python_names(op: str) -> list[str]:
    return [op] + [alias for alias, target in PY_ALIASES.items() if target == op]


def _plan(policy: Policy, device_type: str, dtype: torch.dtype) -> _Plan:
    # The hardware's answer is part of the key: MIXPREC_HALF_ARITHMETIC may change between regions.
    allow = dtype is not torch.float16 or policy.emulate_fp16  # emulate_fp16=False: torch's fp16 kernels
    emulate = emulates(device_type, dtype, allow)
    key = (id(policy), registry_version(), device_type, dtype, emulate)
    hit = _PLANS.get(key)
    if hit is not None and hit[0] is policy:
        return hit[1]
    effective = effective_policy(policy)
    changed = effective.overrides(device_type, dtype)
    if emulate:
        for op, rule in effective.table(device_type).rules_for(dtype).items():
            if rule.action is Action.LOWER:
                changed[op] = Action.LOWER
    actions = {name: action for op, action in changed.items() for name in _python_names(op)}
    plan = _Plan(effective, emulate, actions)
    if len(_PLANS) >= _PLANS_MAX:
        _PLANS.clear()
    _PLANS[key] = (policy, plan)
    return plan


# --------------------------------------------------------------------------------------------------------
# fp32 modules
# --------------------------------------------------------------------------------------------------------


def _enter_fp32(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    devices = tuple(d for d in DEVICES if torch.is_autocast_enabled(d))
    _STATE.fp32_scopes.append((id(module), devices))
    if not devices:
        return None
    for device_type in devices:
        torch.set_autocast_enabled(device_type, False)

    def cast(t: torch.Tensor) -> torch.Tensor:
        eligible = t.is_floating_point() and t.dtype is not torch.float64 and t.device.type in devices
        return t.float() if eligible else t

    return map_tensors(cast, args), map_tensors(cast, kwargs)


def _exit_fp32(module: torch.nn.Module, *_: Any) -> None:
    scopes = _STATE.fp32_scopes
    if scopes and scopes[-1][0] == id(module):
        _, devices = scopes.pop()
        for device_type in devices:
            torch.set_autocast_enabled(device_type, True)


_KEEP_ATTR = "_mixprec_keep_fp32_handles"


def keep_fp32(module: torch.nn.Module) -> torch.nn.Module:
    """Run ``module`` (and everything it calls) in fp32 inside any autocast region; returns it.

    Works under mixprec.autocast and plain torch.autocast: the module's forward runs with autocast off
    and its floating inputs cast to fp32. Parameter storage is not touched (an fp16 model stays fp16).
    """
    if not isinstance(module, torch.nn.Module):
        raise AutocastError(
            f"keep_fp32 needs an nn.Module, got {type(module).__name__}",
            "for a function use mixprec.policy.register_float_function",
        )
    if getattr(module, _KEEP_ATTR, None) is None:
        pre = module.register_forward_pre_hook(_enter_fp32, with_kwargs=True)
        post = module.register_forward_hook(_exit_fp32, always_call=True)
        object.__setattr__(module, _KEEP_ATTR, (pre, post))
    return module


def release_fp32(module: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`keep_fp32`."""
    handles = getattr(module, _KEEP_ATTR, None)
    if handles is not None:
        for handle in handles:
            handle.remove()
        object.__delattr__(module, _KEEP_ATTR)
    return module


class _ModuleRules:
    """Global forward hooks applying ``Policy.fp32_modules`` while a region that has them is current."""

    def __init__(self, region: Region, keys: tuple[str, ...]) -> None:
        self.region = region
        self.keys = frozenset(keys)
        self.matches: dict[type, bool] = {}
        self.handles = (
            torch.nn.modules.module.register_module_forward_pre_hook(self._pre),
            torch.nn.modules.module.register_module_forward_hook(self._post, always_call=True),
        )

    def _matches(self, module: torch.nn.Module) -> bool:
        cls = type(module)
        hit = self.matches.get(cls)
        if hit is None:
            names = {n for c in cls.__mro__ for n in (c.__name__, f"{c.__module__}.{c.__qualname__}")}
            hit = self.matches[cls] = bool(names & self.keys)
        return hit

    def _pre(self, module: torch.nn.Module, args: tuple[Any, ...]) -> Any:
        if self._matches(module) and _is_current(self.region):
            result = _enter_fp32(module, args, {})
            return None if result is None else result[0]
        return None

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._matches(module):
            _exit_fp32(module)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


# --------------------------------------------------------------------------------------------------------
# The public context manager
# --------------------------------------------------------------------------------------------------------


def _resolve_dtype(device_type: str, dtype: torch.dtype | None) -> torch.dtype:
    spec = device_spec(device_type)
    supported = ", ".join(str(d) for d in spec.autocast_dtypes)
    if dtype is None:
        return torch.get_autocast_dtype(device_type)
    if not isinstance(dtype, torch.dtype):
        raise AutocastError(f"dtype must be a torch.dtype, got {dtype!r}", f"use dtype={supported}")
    if not dtype.is_floating_point:
        raise AutocastError(
            f"autocast casts to a floating dtype, and {dtype} is not one",
            f"use dtype={supported} on {device_type!r} (integer types are for quantization, not autocast)",
        )
    if dtype not in spec.autocast_dtypes:
        hint = " (for full precision, use enabled=False)" if dtype in (torch.float32, torch.float64) else ""
        raise AutocastError(
            f"{device_type!r} autocast does not support {dtype}", f"use dtype={supported}{hint}"
        )
    return dtype


class autocast:  # noqa: N801 - lower case like torch.autocast, which it replaces
    """Drop-in for ``torch.autocast`` that applies a mixprec cast policy (see the module docstring).

    Args:
        device_type: ``"cpu"`` or ``"cuda"``.
        dtype: the half-precision dtype; None takes torch's current default for the device
            (``torch.get_autocast_dtype``: bf16 on CPU, fp16 on CUDA).
        enabled: False makes the region a no-op region that switches autocast *off*, as in torch.
        cache_enabled: cache the casts of fp32 parameters for the region (torch's default: True).
        policy: a :class:`~mixprec.policy.Policy`; None is ``mixprec.policy.DEFAULT_POLICY``. The user's
            global register_* registrations apply on top of it.
    """

    def __init__(
        self,
        device_type: str,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool = True,
        policy: Policy | None = None,
    ) -> None:
        self.device = device_type
        self._enabled = bool(enabled)
        self._cache_enabled = bool(cache_enabled)
        self.policy = policy
        self.fast_dtype = dtype
        self._frames: list[tuple[torch.autocast, Region, _PolicyMode | None, _ModuleRules | None]] = []
        if not isinstance(device_type, str):
            raise AutocastError(f"device_type must be a string, got {device_type!r}", "use 'cpu' or 'cuda'")
        try:
            self.fast_dtype = _resolve_dtype(device_type, dtype)
        except PolicyError as err:
            raise AutocastError(err.problem, err.fix) from None
        if policy is not None and not isinstance(policy, Policy):
            raise AutocastError(
                f"policy must be a mixprec.policy.Policy, got {type(policy).__name__}",
                "use mixprec.policy.get_preset(name), or a Policy derived from one",
            )

    def __enter__(self) -> autocast:
        torch_region = torch.autocast(
            self.device, dtype=self.fast_dtype, enabled=self._enabled, cache_enabled=self._cache_enabled
        )
        torch_region.__enter__()
        try:
            # torch turns a region off (with a warning) when e.g. CUDA is unavailable; follow it.
            enabled = bool(getattr(torch_region, "_enabled", self._enabled))
            policy = self.policy if self.policy is not None else _default()
            plan = _plan(policy, self.device, self.fast_dtype) if enabled else None
            region = Region(
                self.device,
                self.fast_dtype,
                enabled,
                self._cache_enabled,
                plan.policy if plan else policy,
                plan.emulate if plan else False,
                plan.actions if plan else {},
            )
            _STATE.regions.append(region)
            mode = _PolicyMode(region) if region.actions else None
            if mode is not None:
                mode.__enter__()
            modules = plan.policy.fp32_modules if plan else ()
            rules = _ModuleRules(region, modules) if modules else None
        except BaseException:
            torch_region.__exit__(None, None, None)
            raise
        self._frames.append((torch_region, region, mode, rules))
        return self

    def __exit__(self, *exc: Any) -> None:
        torch_region, region, mode, rules = self._frames.pop()
        try:
            if rules is not None:
                rules.remove()
            if mode is not None:
                mode.__exit__(*exc)
        finally:
            _STATE.regions.remove(region)
            if not _STATE.regions:
                _STATE.cache.clear()  # casts live for the outermost region only, as in torch
            torch_region.__exit__(*exc)

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)

        return wrapper

    def __repr__(self) -> str:
        policy = self.policy.name if self.policy is not None else "default"
        return (
            f"mixprec.autocast({self.device!r}, dtype={self.fast_dtype}, enabled={self._enabled}, "
            f"cache_enabled={self._cache_enabled}, policy={policy!r})"
        )


def _default() -> Policy:
    from mixprec import policy as policy_module

    return policy_module.DEFAULT_POLICY


# --------------------------------------------------------------------------------------------------------
# half_compute: the arithmetic of a half-precision *model* (O2/O3, Learner.to_fp16), without a cast policy
# --------------------------------------------------------------------------------------------------------


class _HalfComputeMode(TorchFunctionMode):
    """Emulates the GEMM family for operands of the region's half dtype; every other call (and every call
    while a torch autocast region is on, which has its own rules) passes straight through."""

    def __init__(self, region: Region, names: frozenset[str]) -> None:
        super().__init__()
        self.region = region
        self.names = names

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if (
            getattr(func, "__name__", None) not in self.names
            or torch.is_autocast_enabled(self.region.device_type)
            or not any(t.dtype is self.region.dtype for t in iter_tensors((args, kwargs)))
        ):
            return func(*args, **kwargs)
        return _run_emulated(self.region, func, args, kwargs)


# (plan, GEMM op names, region) per plan: plans are few and long-lived (see _PLANS_MAX)
_HALF_COMPUTE_MODES: dict[tuple[int, str], tuple[_Plan, frozenset[str], Region]] = {}


class half_compute:  # noqa: N801 - a context manager used like autocast
    """Run a model whose weights are already half precision with tensor-core arithmetic.

    ``autocast`` decides *which dtype* each op runs in; a model cast to fp16 (apex O2/O3, fastai's
    ``to_fp16``/``to_bf16``) has already decided: everything is half. What remains is *how* half GEMMs
    compute. Where :mod:`mixprec.hardware` says the device has no fast kernels for ``dtype`` (CPU fp16:
    3x-500x slower than fp32 in torch; bf16 without AVX-512 BF16/AMX: ~90x) this region computes every
    GEMM/convolution with a ``dtype`` operand as a tensor core does: exact fp32 upcasts, fp32
    accumulation, result rounded to ``dtype`` (:mod:`mixprec.emulation`). It casts nothing else. Where
    the device's half kernels are fast, it is a no-op.
    """

    def __init__(self, device_type: str, dtype: torch.dtype = torch.float16) -> None:
        self.device_type = device_type
        self.dtype = dtype
        self._modes: list[_HalfComputeMode | None] = []

    def _mode(self) -> _HalfComputeMode | None:
        # The same cached plan as autocast(device, dtype): honours the hardware's answer, emulate_fp16 and
        # the user's register_half_function registrations, and costs a dict lookup per forward.
        plan = _plan(_default(), self.device_type, self.dtype)
        if not plan.emulate:
            return None
        key = (id(plan), self.device_type)
        cached = _HALF_COMPUTE_MODES.get(key)
        if cached is None or cached[0] is not plan:
            names = frozenset(name for name, action in plan.actions.items() if action is Action.LOWER)
            # cache_enabled: a weight used several times in one forward is upcast once (see __exit__)
            region = Region(self.device_type, self.dtype, True, True, plan.policy, True, {})
            cached = _HALF_COMPUTE_MODES[key] = (plan, names, region)
        return _HalfComputeMode(cached[2], cached[1])

    def __enter__(self) -> half_compute:
        mode = self._mode()
        if mode is not None:
            mode.__enter__()
        self._modes.append(mode)
        return self

    def __exit__(self, *exc: Any) -> None:
        mode = self._modes.pop()
        if mode is not None:
            mode.__exit__(*exc)
            if not _STATE.regions:  # the upcasts live for this forward only (autograd keeps its own)
                _STATE.cache.clear()
