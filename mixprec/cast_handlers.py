"""What the Python layer does to one op, one handler per :class:`~mixprec.policy.Action`.

A handler casts the op's floating inputs as its action says and runs the op with torch's autocast off,
so torch's table cannot cast them again (the "exclude the autocast key for this op" that torch's own
kernels do). Every cast is an ordinary differentiable ``Tensor.to``: backward runs in the dtypes forward
chose. Casts of fp32 parameters go through the region's :class:`~mixprec.cast_cache.CastCache`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mixprec.cast_plan import plan
from mixprec.emulation import emulated, round_to_half
from mixprec.errors import BannedOpError
from mixprec.func_transforms import inside_transform
from mixprec.policy.devices import DEVICES
from mixprec.policy.presets import DEFAULT_POLICY
from mixprec.policy.registry import install_runner
from mixprec.policy.rules import Action
from mixprec.region import (
    EMULATED_NODE_KEY,
    STATE,
    Region,
    autocast_off,
    call_without_autocast,
    current_region,
    eager_region_open,
    is_current,
)
from mixprec.tensor_args import iter_tensors, map_tensors

__all__ = ["HANDLERS", "Handler", "call_registered", "eligible", "run_emulated"]

Handler = Callable[[Region, str, Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]


def eligible(t: torch.Tensor, device_type: str) -> bool:
    """torch's rule (is_autocast_eligible): floating tensors on the region's device; float64 left alone."""
    return t.is_floating_point() and t.dtype is not torch.float64 and t.device.type == device_type


def _cacheable_now(region: Region) -> bool:
    # Not in compiled code: the cache's keys (ids, version counters) would be guards that change every step.
    # Nor without an eager region, whose exit clears the cache (a compiled region's mode run eagerly: the
    # casts would outlive the step).
    return region.cache_enabled and not torch.compiler.is_compiling() and eager_region_open()


def _leaf_parameter(t: torch.Tensor) -> bool:
    # Parameters: leaves that require grad and are not views.
    return t.requires_grad and t.is_leaf and not t._is_view()


def _cacheable(t: torch.Tensor, region: Region) -> bool:
    # torch's rule: cache casts of fp32 parameters. (_cacheable_now first: compiled code asks nothing of t)
    return t.dtype is torch.float32 and _cacheable_now(region) and _leaf_parameter(t)


def _cast_to(region: Region, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    cache = STATE.cache
    device_type = region.device_type

    def cast(t: torch.Tensor) -> torch.Tensor:
        if t.dtype is dtype or not eligible(t, device_type):
            return t
        if dtype is not torch.float32 and _cacheable(t, region):
            return cache.get(t, dtype, lambda: t.to(dtype))
        return t.to(dtype)

    return cast


def _rounded(region: Region) -> Callable[[torch.Tensor], torch.Tensor]:
    """The emulation's input rounding for ``region``: each parameter rounded (an fp32 one) or upcast (a
    half one, in an O2 model) once per region however often the region uses it, and autograd saves that
    copy for backward, which therefore rounds no weight again. Made once per op: what holds for the whole
    op (compiled or not, a region open, a torch.func transform running) is asked here, not per tensor."""
    cache = STATE.cache
    device_type = region.device_type
    dtype = region.dtype
    # (_cacheable_now first: it is False in compiled code, which must not call the transform query)
    caching = _cacheable_now(region) and not inside_transform()

    def cast(t: torch.Tensor) -> torch.Tensor:
        if not eligible(t, device_type):
            return t
        # Every leaf that requires grad (torch's rule: parameters, and torch.func's plain-tensor ones), but
        # in a backward only parameters: a reentrant checkpoint's recompute makes its block's input such a
        # leaf, and one shared rounding summed that input's gradients in fp32 where the forward (one
        # rounding per use) had summed them in half: other gradients than without the checkpoint.
        if caching and _leaf_parameter(t) and (
            isinstance(t, torch.nn.Parameter) or torch._C._current_graph_task_id() == -1
        ):
            return cache.get_outside_transforms(t, ("rounded", dtype), lambda: round_to_half(t, dtype))
        return round_to_half(t, dtype)

    return cast


def run_emulated(region: Region, func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """``func`` as a ``region.dtype`` tensor core computes it (:mod:`mixprec.emulation`), autocast off."""
    with autocast_off(region.device_type):
        if not STATE.traces or torch.compiler.is_compiling():
            return emulated(func, args, kwargs, region.dtype, round_input=_rounded(region))
        return _traced_emulated(region, func, args, kwargs)


def _traced_emulated(region: Region, func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """:func:`run_emulated` while a CastTrace looks: flag the forward op and tag its backward node."""
    outer, STATE.emulating = STATE.emulating, region.dtype
    before = {t.grad_fn for t in iter_tensors((args, kwargs)) if t.grad_fn is not None}
    try:
        result = emulated(func, args, kwargs, region.dtype, round_input=_rounded(region))
    finally:
        STATE.emulating = outer
    _tag_new_nodes([t.grad_fn for t in iter_tensors(result)], before, region.dtype)
    return result


def _tag_new_nodes(roots: list[Any], before: set[Any], dtype: torch.dtype) -> None:
    """Tag the backward nodes an emulated call made (the GEMM's, and the views and casts around it: a 3-d
    linear's addmm sits under a view) as emulating ``dtype``, walking from its results down to the nodes
    its inputs came with; parameters' gradient accumulators are not its own."""
    todo, seen = [n for n in roots if n is not None], set(before)
    while todo:
        node = todo.pop()
        if node in seen or type(node).__name__ == "AccumulateGrad":
            continue
        seen.add(node)
        node.metadata[EMULATED_NODE_KEY] = dtype
        todo += [n for n, _ in node.next_functions if n is not None]


def _run_cast(region: Region, dtype: torch.dtype, func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    cast = _cast_to(region, dtype)
    return call_without_autocast(region.device_type, func, map_tensors(cast, args), map_tensors(cast, kwargs))


def _run_lower(region: Region, op: str, func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    if region.emulate:
        return run_emulated(region, func, args, kwargs)
    return _run_cast(region, region.dtype, func, args, kwargs)


def _run_fp32(region: Region, op: str, func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    return _run_cast(region, torch.float32, func, args, kwargs)


def _widest(region: Region, args: Any, kwargs: Any) -> torch.dtype:
    # torch's promote: fp32 if any eligible input is fp32, else the region's dtype. Where torch raises
    # (fp16 mixed with bf16) we take fp32, which holds both exactly.
    seen = {t.dtype for t in iter_tensors((args, kwargs)) if eligible(t, region.device_type)}
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
    return call_without_autocast(region.device_type, func, args, kwargs)


HANDLERS: dict[Action, Handler] = {
    Action.LOWER: _run_lower,
    Action.FP32: _run_fp32,
    Action.PROMOTE: _run_promote,
    Action.BANNED: _run_banned,
    Action.NATIVE: _run_native,
}


def call_registered(key: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run a function wrapped by a register_* decorator under the current region's rule for ``key``."""
    region = _region_for_call(args, kwargs)
    if region is None:
        return fn(*args, **kwargs)
    rule = region.policy.rule(key, region.device_type, region.dtype)
    if rule is None:  # registrations were cleared: behave as an ordinary function
        return fn(*args, **kwargs)
    return HANDLERS[rule.action](region, key, fn, args, kwargs)


def _region_for_call(args: Any, kwargs: Any) -> Region | None:
    region = current_region()
    if region is not None:
        return region if is_current(region) else None
    # Under a plain torch.autocast: apply the registration with torch's dtype, no cache, no emulation.
    for t in iter_tensors((args, kwargs)):
        device_type = t.device.type
        if device_type in DEVICES and torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            policy = plan(DEFAULT_POLICY, device_type, dtype).policy  # cached: no table rebuild per call
            return Region(device_type, dtype, True, False, policy, False, {})
    return None


install_runner(call_registered)
