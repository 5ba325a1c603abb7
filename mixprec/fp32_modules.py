"""Modules that run in fp32 inside any autocast region: :func:`keep_fp32` per instance, and the hooks that
apply a policy's ``fp32_modules`` (class names) while a region that has them is current.

The module's forward runs with autocast off and its floating inputs cast to fp32; parameter storage is
not touched (an fp16 model stays fp16).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from mixprec.errors import AutocastError
from mixprec.hardware import HALF_DTYPES
from mixprec.outside_region import is_prepared
from mixprec.policy.devices import DEVICES
from mixprec.region import Region, in_any_region, is_current
from mixprec.tensor_args import map_tensors
from mixprec.tree import iter_tensors
from mixprec.warn_site import user_stacklevel

__all__ = ["ModuleRules", "is_kept_fp32", "keep_fp32", "release_fp32"]


class _Scopes(threading.local):
    def __init__(self) -> None:
        # (id of the module, devices whose autocast its forward switched off), innermost last
        self.stack: list[tuple[int, tuple[str, ...]]] = []


_SCOPES = _Scopes()


def _enter_fp32(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    devices = tuple(d for d in DEVICES if torch.is_autocast_enabled(d))
    _SCOPES.stack.append((id(module), devices))
    if not devices:
        _warn_if_half_model_runs_it_half(module, args, kwargs)
        return None
    for device_type in devices:
        torch.set_autocast_enabled(device_type, False)

    def cast(t: torch.Tensor) -> torch.Tensor:
        eligible = t.is_floating_point() and t.dtype is not torch.float64 and t.device.type in devices
        return t.float() if eligible else t

    return map_tensors(cast, args), map_tensors(cast, kwargs)


def _exit_fp32(module: torch.nn.Module, *_: Any) -> None:
    scopes = _SCOPES.stack
    if scopes and scopes[-1][0] == id(module):
        _, devices = scopes.pop()
        for device_type in devices:
            torch.set_autocast_enabled(device_type, True)


_KEEP_ATTR = "_mixprec_keep_fp32_handles"
# set by half_model.prepare on the marked modules whose tensors it kept fp32 (their inputs go to fp32 there)
HANDLED_ATTR = "_mixprec_fp32_in_half_model"
_WARNED_ATTR = "_mixprec_keep_fp32_warned"


def _warn_if_half_model_runs_it_half(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
    """A half model's region (O2, to_fp16(), half_compute) has no torch autocast to switch off: there a
    marked module runs in fp32 only where prepare saw the mark before the cast. Elsewhere (marked after
    it, a parameterless module; a model cast by hand in half_compute) its half inputs would run it in
    half, silently: said once per module."""
    if (getattr(module, HANDLED_ATTR, False) or getattr(module, _WARNED_ATTR, False)
            or torch.compiler.is_compiling() or not in_any_region()):
        return
    half = [t for t in iter_tensors((args, kwargs)) if t.dtype in HALF_DTYPES]
    if half:
        object.__setattr__(module, _WARNED_ATTR, True)
        warnings.warn(
            f"mixprec.keep_fp32: this {type(module).__name__} gets {half[0].dtype} inputs in a half model's "
            "region, which keep_fp32 does not switch off: it runs in half. Fix: mark it before "
            "initialize(..., 'O2') or fit with to_fp16() (mixprec then keeps it fp32 and casts its inputs), "
            "or compute it from .float() tensors in its forward.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


def keep_fp32(module: torch.nn.Module) -> torch.nn.Module:
    """Run ``module`` (and everything it calls) in fp32 inside any autocast region; returns it.

    Works under mixprec.autocast and plain torch.autocast: the module's forward runs with autocast off
    and its floating inputs cast to fp32. Parameter storage is not touched (an fp16 model stays fp16).
    Marked before mixprec casts a model to half (``initialize(..., "O2")``, ``to_fp16()``), the module's
    parameters and buffers stay fp32 (stepped as they are, as BatchNorm's), its half inputs are cast to
    fp32 and its outputs back to the model's dtype (half_model.py).
    """
    if not isinstance(module, torch.nn.Module):
        raise AutocastError(
            f"keep_fp32 needs an nn.Module, got {type(module).__name__}",
            "for a function use mixprec.policy.register_float_function",
        )
    cast = [p for p in module.parameters() if p.dtype in HALF_DTYPES and is_prepared(p)]
    if cast:
        raise AutocastError(
            f"keep_fp32 marks a module before mixprec casts the model to half, and this "
            f"{type(module).__name__}'s parameters are {cast[0].dtype} already (initialize(..., 'O2'), "
            "to_fp16() ran): its fp32 values are gone",
            "call mixprec.keep_fp32(module) on the fp32 model, before initialize or fit; or compute the "
            "module from .float() tensors in its forward",
        )
    if getattr(module, _KEEP_ATTR, None) is None:
        pre = module.register_forward_pre_hook(_enter_fp32, with_kwargs=True)
        post = module.register_forward_hook(_exit_fp32, always_call=True)
        object.__setattr__(module, _KEEP_ATTR, (pre, post))
    return module


def is_kept_fp32(module: torch.nn.Module) -> bool:
    """Whether :func:`keep_fp32` marked ``module``."""
    return getattr(module, _KEEP_ATTR, None) is not None


def release_fp32(module: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`keep_fp32`."""
    handles = getattr(module, _KEEP_ATTR, None)
    if handles is not None:
        for handle in handles:
            handle.remove()
        object.__delattr__(module, _KEEP_ATTR)
    return module


class ModuleRules:
    """Global forward hooks applying ``Policy.fp32_modules`` while a region that has them is current."""

    def __init__(self, region: Region, keys: tuple[str, ...],
                 on_enter: Callable[[], None] | None = None) -> None:
        """``on_enter``: called before a matching module is switched to fp32 (autocast passes
        activation_checkpoint.cover_segment: a checkpointed segment's recompute must switch it too)."""
        self.region = region
        self.keys = frozenset(keys)
        self.on_enter = on_enter
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
        if self._matches(module) and is_current(self.region):
            if self.on_enter is not None:
                self.on_enter()
            result = _enter_fp32(module, args, {})
            return None if result is None else result[0]
        return None

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._matches(module):
            _exit_fp32(module)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
