"""Loss scaling: ``GradScaler``, a drop-in for ``torch.amp.GradScaler`` with static scaling, hysteresis,
scale bounds and sync-free observability.

Why loss scaling: fp16 flushes magnitudes below 2**-24 to zero, and many gradients live below that.
Multiplying the loss by S multiplies every gradient by S (backward is linear), lifting them into fp16's
range; we divide by S again in fp32 before the optimizer sees them. If S is too large some gradient
overflows to inf: the step is skipped and (dynamic scaling) S is halved. After ``growth_interval`` clean
steps S is doubled again, so S hovers just below the largest value that does not overflow.

The protocol per optimizer is explicit (``OptState``): READY -> (unscale_) UNSCALED -> (step) STEPPED,
and ``update()`` at the end of the iteration returns every optimizer to READY.

Host-device syncs: ``scale``, ``unscale_`` and ``update`` never sync (found-inf flags, the scale, the
growth tracker, the hysteresis counter and the skip counters all stay device tensors). ``step`` syncs once
to decide whether to call ``optimizer.step()``, unless the optimizer can skip by itself
(``_step_supports_amp_scaling``, e.g. torch's fused Adam/AdamW/SGD), in which case nothing syncs.
``get_scale``, ``last_step_skipped``, ``skipped_steps`` and ``scale_history`` sync: read them when you log,
not on every step.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections import defaultdict
from collections.abc import Iterable
from typing import Any, Protocol, TypedDict, cast, overload, runtime_checkable

import torch

from mixprec.errors import (
    ConfigError,
    DeviceMismatchError,
    Fp16GradientError,
    PersistentOverflowError,
    ScalerStateError,
)

__all__ = ["GradScaler", "OptState", "HasMasterGrads"]

# Defaults, each with its reason (they equal torch.amp.GradScaler's, on purpose: drop-in).
DEFAULT_INIT_SCALE = 2.0**16  # large on purpose: a few overflowing first steps find the right scale fast
DEFAULT_GROWTH_FACTOR = 2.0  # powers of two: scaling by them is exact in binary floating point
DEFAULT_BACKOFF_FACTOR = 0.5  # halve on overflow, the mirror of doubling
DEFAULT_GROWTH_INTERVAL = 2000  # overflows are rare once tuned; probing upward too often wastes steps
DEFAULT_HISTORY_SIZE = 1024  # scales kept for plotting: a ring buffer, 4 KiB on the device


# torch's own enum, not a copy: code written against torch.amp compares stages with `is`.
OptState = torch.amp.grad_scaler.OptState


@runtime_checkable
class HasMasterGrads(Protocol):
    """An optimizer that keeps fp32 master copies (``mixprec.MasterWeights``): the scaler asks it to copy
    the model's half-precision gradients into the master gradients before it unscales them."""

    def copy_grads_to_master(self) -> None: ...


# The scaler's device tensors; pickling turns them into Python values (see __getstate__).
_DEVICE_STATE = (
    "_scale",
    "_growth_tracker",
    "_hysteresis_left",
    "_skipped",
    "_last_skipped",
    "_consecutive",
    "_history",
)


class _PerOptimizer(TypedDict):
    """torch's per-optimizer record, same keys: code reading ``_per_optimizer_states[id(opt)]["stage"]``
    (and torch's own tests) keeps working."""

    stage: OptState
    # one float32 flag per device: > 0 when any gradient on that device was inf/NaN
    found_inf_per_device: dict[torch.device, torch.Tensor]


def _refresh_per_optimizer_state() -> _PerOptimizer:
    # Module-level (not a lambda) so that the defaultdict holding these records can be pickled.
    return {"stage": OptState.READY, "found_inf_per_device": {}}


def device_skip_is_safe(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a fused optimizer may be left to skip an overflowing step on the device.

    Not a fused SGD with momentum before its momentum buffers exist: torch 2.13's fused SGD allocates them
    with torch.empty and, when ``found_inf`` skips that first step, never fills them, so the next step
    reads garbage. Then we decide on the host (one sync) and do not call step() at all."""
    inner = getattr(optimizer, "optimizer", optimizer)  # MasterWeights wraps the optimizer that steps
    if not isinstance(inner, torch.optim.SGD):
        return True
    return all(
        group.get("momentum", 0) == 0 or "momentum_buffer" in inner.state.get(p, {})
        for group in inner.param_groups
        for p in group["params"]
    )


def _check_positive_finite(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ConfigError(
            f"{name} must be a positive, finite number, got {value!r}.",
            f"pass e.g. {name}=2.**16 (dynamic scaling) or a fixed power of two such as 512. (static).",
        )


class GradScaler:
    """Loss scaler with the constructor, methods, state machine, errors and pickling of
    ``torch.amp.GradScaler``; extras are keyword-only and default to torch's behaviour.

    Args (as torch):
        device: device type of the scaled tensors ("cuda", "cpu", ...). As in torch, "cuda" without CUDA
            warns and disables the scaler, so the same script runs unscaled on a CPU-only machine.
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as torch.amp.GradScaler.
    Extras (keyword-only):
        dynamic: False gives static loss scaling: ``init_scale`` never changes (steps with inf/NaN
            gradients are still skipped). fastai's default static scale is 512; the fp16-from-scratch
            recipe uses 8192.
        min_scale, max_scale: bounds for the dynamic scale (None: unbounded, as torch).
        hysteresis: back off only after this many consecutive overflowing iterations (DeepSpeed's
            ``hysteresis``); a clean iteration restores the allowance. 1 backs off at once (torch).
        history_size: how many per-iteration scales ``scale_history()`` keeps (a device ring buffer).
        allow_fp16_grads: unscale fp16 gradients in place (pure-fp16 training, apex O3). By default fp16
            gradients raise ``Fp16GradientError``: the fix is fp32 master weights.
        sync_found_inf: all-reduce the inf/NaN flags over the default ``torch.distributed`` process group
            (or ``process_group``) before deciding to skip, so every rank skips together. Needed when
            gradients are not already all-reduced (sharded or ``no_sync`` gradients, model parallelism);
            with DDP's all-reduced gradients every rank sees the same flags anyway. Costs one collective.
        skip_limit: raise ``PersistentOverflowError`` once this many consecutive iterations were skipped.
            Overflow from too large a scale stops after a few back-offs; a run that keeps skipping has
            inf/NaN for another reason (bad data, log(0)) and would otherwise skip forever. Checking it
            reads one counter per ``update()`` (a sync), so it is off (None) by default.
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = DEFAULT_INIT_SCALE,
        growth_factor: float = DEFAULT_GROWTH_FACTOR,
        backoff_factor: float = DEFAULT_BACKOFF_FACTOR,
        growth_interval: int = DEFAULT_GROWTH_INTERVAL,
        enabled: bool = True,
        *,
        dynamic: bool = True,
        min_scale: float | None = None,
        max_scale: float | None = None,
        hysteresis: int = 1,
        history_size: int = DEFAULT_HISTORY_SIZE,
        allow_fp16_grads: bool = False,
        sync_found_inf: bool = False,
        process_group: Any = None,
        skip_limit: int | None = None,
    ) -> None:
        self._device = device
        self._enabled = enabled
        if device == "cuda" and enabled and not torch.cuda.is_available():
            import warnings

            warnings.warn(
                "mixprec.GradScaler is enabled with device='cuda', but CUDA is not available. Disabling "
                "(pass device='cpu' to scale on the CPU).",
                stacklevel=2,
            )
            self._enabled = False
        if not self._enabled:
            return
        _check_positive_finite("init_scale", init_scale)
        if not growth_factor > 1.0:
            raise ConfigError(
                "The growth factor must be > 1.0.", f"got {growth_factor!r}; use e.g. growth_factor=2.0."
            )
        if not 0.0 < backoff_factor < 1.0:
            raise ConfigError(
                "The backoff factor must be < 1.0 (and > 0).",
                f"got {backoff_factor!r}; use e.g. backoff_factor=0.5.",
            )
        if not (isinstance(growth_interval, int) and growth_interval >= 1):
            raise ConfigError(
                f"growth_interval must be an int >= 1, got {growth_interval!r}.",
                "use e.g. growth_interval=2000 (iterations without overflow before the scale doubles).",
            )
        if not (isinstance(hysteresis, int) and hysteresis >= 1):
            raise ConfigError(f"hysteresis must be an int >= 1, got {hysteresis!r}.", "1 means no delay.")
        if not (isinstance(history_size, int) and history_size >= 1):
            raise ConfigError(
                f"history_size must be an int >= 1, got {history_size!r}.", "use e.g. history_size=1024."
            )
        for name, bound in (("min_scale", min_scale), ("max_scale", max_scale)):
            if bound is not None:
                _check_positive_finite(name, bound)
        if min_scale is not None and max_scale is not None and min_scale > max_scale:
            raise ConfigError(
                f"min_scale {min_scale} is larger than max_scale {max_scale}.",
                "swap them, or leave one of them None.",
            )

        self._init_scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = growth_interval
        self._dynamic = dynamic
        self._min_scale = min_scale
        self._max_scale = max_scale
        self._hysteresis = hysteresis
        self._history_size = history_size
        self._allow_fp16_grads = allow_fp16_grads
        self._sync_found_inf = sync_found_inf
        self._process_group = process_group
        if skip_limit is not None and not (isinstance(skip_limit, int) and skip_limit >= 1):
            raise ConfigError(f"skip_limit must be None or an int >= 1, got {skip_limit!r}.", "e.g. 50.")
        self._skip_limit = skip_limit
        self._init_consecutive = 0
        # Python-side counters: known without a sync.
        self._init_growth_tracker = 0
        self._init_hysteresis_left = hysteresis
        self._init_skipped = 0
        self._init_last_skipped = False
        self._updates = 0
        self._init_history: list[float] = []
        # Device tensors, created lazily on the device of the first scaled output (as torch does).
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        self._hysteresis_left: torch.Tensor | None = None
        self._skipped: torch.Tensor | None = None
        self._last_skipped: torch.Tensor | None = None
        self._consecutive: torch.Tensor | None = None
        self._history: torch.Tensor | None = None
        self._per_optimizer_states: defaultdict[int, _PerOptimizer] = defaultdict(
            _refresh_per_optimizer_state
        )

    # ------------------------------------------------------------------ lazy device state
    def _lazy_init(self, dev: torch.device) -> None:
        if dev.type != self._device:
            raise DeviceMismatchError(
                f"This GradScaler was made for device '{self._device}' but is scaling a tensor on '{dev}'.",
                f"create it with mixprec.GradScaler('{dev.type}', ...), one scaler per device type.",
            )
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=dev)
        self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=dev)
        self._hysteresis_left = torch.full((), self._init_hysteresis_left, dtype=torch.int32, device=dev)
        self._skipped = torch.full((), self._init_skipped, dtype=torch.int64, device=dev)
        self._last_skipped = torch.full((), self._init_last_skipped, dtype=torch.bool, device=dev)
        self._consecutive = torch.full((), self._init_consecutive, dtype=torch.int64, device=dev)
        self._history = torch.zeros(self._history_size, dtype=torch.float32, device=dev)
        kept = self._init_history[-self._history_size :]
        for i, s in enumerate(kept, start=self._updates - len(kept)):
            self._history[i % self._history_size] = s

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self._scale is None or self._growth_tracker is None:
            raise ScalerStateError(
                f"Attempted {funcname} but _scale is None.",
                "call scaler.scale(loss) (and backward on it) earlier in the iteration.",
            )
        return self._scale, self._growth_tracker

    # ------------------------------------------------------------------ scale
    @overload
    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...
    @overload
    def scale(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]: ...
    @overload
    def scale(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]: ...
    @overload
    def scale(self, outputs: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]: ...

    def scale(self, outputs: Any) -> Any:
        """Multiply a tensor (or an iterable of tensors) by the scale. No sync."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if self._scale is None or outputs.device.type != self._device:
                self._lazy_init(outputs.device)  # raises DeviceMismatchError on a foreign device type
            return outputs * cast(torch.Tensor, self._scale).to(device=outputs.device, non_blocking=True)
        return self._scale_iterable(outputs)

    def _scale_iterable(self, outputs: Any) -> Any:
        if isinstance(outputs, torch.Tensor):
            return self.scale(outputs)
        if not isinstance(outputs, Iterable):
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")
        scaled = map(self._scale_iterable, outputs)
        if isinstance(outputs, list | tuple):
            return type(outputs)(scaled)
        return scaled

    # ------------------------------------------------------------------ unscale
    def _grads_by_device_and_dtype(
        self, optimizer: torch.optim.Optimizer, allow_fp16: bool
    ) -> dict[torch.device, dict[torch.dtype, list[torch.Tensor]]]:
        buckets: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(
            lambda: defaultdict(list)
        )
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if not allow_fp16 and param.grad.dtype == torch.float16:
                    raise Fp16GradientError(
                        "Attempting to unscale FP16 gradients. Unscaling in fp16 would flush the small "
                        "gradients that loss scaling exists to protect, and the update itself would be "
                        "rounded to fp16's 11-bit precision.",
                        "keep fp32 master weights: wrap the optimizer, opt = mixprec.MasterWeights(opt) "
                        "(or use mixprec.initialize(..., opt_level='O2')); for deliberate pure-fp16 "
                        "training pass GradScaler(..., allow_fp16_grads=True).",
                    )
                grad = param.grad
                if grad.is_sparse:
                    # Duplicate indices of a sparse fp16 grad may overflow only once summed: coalesce first.
                    if grad.dtype is torch.float16:
                        param.grad = grad = grad.coalesce()
                    grad = grad._values()
                buckets[grad.device][grad.dtype].append(grad)
        return buckets

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        if isinstance(optimizer, HasMasterGrads):
            optimizer.copy_grads_to_master()
        per_device_found: dict[torch.device, torch.Tensor] = {}
        with torch.no_grad():
            for device, per_dtype in self._grads_by_device_and_dtype(optimizer, allow_fp16).items():
                found = per_device_found.setdefault(device, found_inf.to(device, copy=True))
                dev_inv_scale = inv_scale.to(device)
                for grads in per_dtype.values():
                    # One fused kernel per (device, dtype): multiplies by 1/scale and sets `found` on inf/NaN.
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, dev_inv_scale)
        if self._sync_found_inf and torch.distributed.is_available() and torch.distributed.is_initialized():
            for found in per_device_found.values():
                torch.distributed.all_reduce(found, group=self._process_group)  # SUM: > 0 if any rank saw inf
        return per_device_found

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale, in place, and record whether any is inf/NaN.

        Call it before clipping or inspecting gradients; ``step`` calls it for you otherwise. No sync.
        """
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise ScalerStateError(
                "unscale_() has already been called on this optimizer since the last update().",
                "call unscale_(optimizer) at most once per iteration, between backward and step.",
            )
        if state["stage"] is OptState.STEPPED:
            raise ScalerStateError(
                "unscale_() is being called after step().", "call unscale_ before scaler.step(optimizer)."
            )
        scale = cast(torch.Tensor, self._scale)
        # FP32 division can be imprecise under some compile options, so take the reciprocal in FP64.
        inv_scale = scale.double().reciprocal().float()
        found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        state["found_inf_per_device"] = self._unscale_grads_(
            optimizer, inv_scale, found_inf, self._allow_fp16_grads
        )
        state["stage"] = OptState.UNSCALED

    # ------------------------------------------------------------------ step
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (if not done yet), then ``optimizer.step(*args, **kwargs)`` unless a gradient was inf/NaN.

        Syncs once to decide, unless the optimizer skips by itself (fused optimizers): then no sync.
        Returns what ``optimizer.step`` returned, or None when the step was skipped.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise ScalerStateError(
                "step() has already been called since the last update().",
                "call scaler.update() once at the end of each iteration, after stepping every optimizer.",
            )
        if getattr(optimizer, "_step_supports_amp_scaling", False) and device_skip_is_safe(optimizer):
            return self._step_self_skipping(optimizer, state, *args, **kwargs)
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if not state["found_inf_per_device"]:
            raise ScalerStateError(
                "No inf checks were recorded for this optimizer.",
                "none of its parameters has a gradient: call backward on the scaled loss before step().",
            )
        retval = None
        if not sum(v.item() for v in state["found_inf_per_device"].values()):
            retval = optimizer.step(*args, **kwargs)
        else:
            # The step was skipped, but the program called it in the right order: record the call where
            # LR schedulers look for it, so they do not warn "lr_scheduler.step() before optimizer.step()"
            # (pytorch#44511). The schedule advances with the iteration, as it does in torch.
            optimizer._opt_called = True  # type: ignore[attr-defined]
        state["stage"] = OptState.STEPPED
        return retval

    def _step_self_skipping(
        self, optimizer: torch.optim.Optimizer, state: _PerOptimizer, *args: Any, **kwargs: Any
    ) -> Any:
        """Optimizers with ``_step_supports_amp_scaling`` take ``grad_scale`` and ``found_inf`` tensors and
        unscale/skip inside their fused kernel: no host sync at all."""
        if "grad_scaler" in inspect.signature(optimizer.step).parameters:
            # The older protocol of custom optimizers; torch deprecates it with this FutureWarning.
            warnings.warn(
                "GradScaler passes itself to optimizer.step(grad_scaler=...); this protocol is deprecated "
                "(as in torch.amp). Fix: drop the grad_scaler argument and read the tensors "
                "`self.grad_scale` and `self.found_inf` that the scaler sets on the optimizer before step().",
                FutureWarning,
                stacklevel=3,
            )
            kwargs["grad_scaler"] = self
            retval = optimizer.step(*args, **kwargs)
            state["stage"] = OptState.STEPPED
            return retval
        scale = cast(torch.Tensor, self._scale)
        if state["stage"] is OptState.READY:
            ones = torch.ones((), dtype=torch.float32, device=scale.device)
            found = torch.zeros((), dtype=torch.float32, device=scale.device)
            state["found_inf_per_device"] = self._unscale_grads_(optimizer, ones, found, allow_fp16=True)
            optimizer.grad_scale = scale * getattr(optimizer, "grad_scale", 1)  # type: ignore[attr-defined]
        else:
            optimizer.grad_scale = getattr(optimizer, "grad_scale", None)  # type: ignore[attr-defined]
        found_inf = sum(t.to(scale.device, non_blocking=True) for t in state["found_inf_per_device"].values())
        optimizer.found_inf = found_inf  # type: ignore[attr-defined]
        try:
            retval = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]
        state["stage"] = OptState.STEPPED
        return retval

    # ------------------------------------------------------------------ update
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Update the scale for the next iteration (back off on overflow, grow after ``growth_interval``
        clean iterations), or set it to ``new_scale``. Call once per iteration after all steps. No sync."""
        if not self._enabled:
            return
        scale, tracker = self._check_scale_growth_tracker("update")
        found = self._combined_found_inf(scale) if new_scale is None else None
        self._record(scale, found)
        if new_scale is not None:
            self._set_scale(scale, new_scale)
        elif self._dynamic:
            self._update_dynamic(scale, tracker, cast(torch.Tensor, found))
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    def _set_scale(self, scale: torch.Tensor, new_scale: float | torch.Tensor) -> None:
        if isinstance(new_scale, float):
            _check_positive_finite("new_scale", new_scale)
            scale.fill_(new_scale)
            return
        reason = (
            "new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
            "torch.FloatTensor with requires_grad=False."
        )
        if new_scale.device.type != self._device or new_scale.numel() != 1 or new_scale.requires_grad:
            raise ConfigError(reason, "pass a Python float, e.g. scaler.update(1024.0).")
        scale.copy_(new_scale)

    def _combined_found_inf(self, scale: torch.Tensor) -> torch.Tensor:
        found_infs = [
            found.to(device=scale.device, non_blocking=True)
            for state in self._per_optimizer_states.values()
            for found in state["found_inf_per_device"].values()
        ]
        if not found_infs:
            raise ScalerStateError(
                "No inf checks were recorded prior to update.",
                "call scaler.step(optimizer) (or unscale_) for at least one optimizer before update().",
            )
        return torch.stack(found_infs).sum()

    def _record(self, scale: torch.Tensor, found: torch.Tensor | None) -> None:
        """Sync-free bookkeeping: the scale this iteration used, whether it skipped, how many skipped."""
        history = cast(torch.Tensor, self._history)
        history[self._updates % self._history_size].copy_(scale)
        self._updates += 1
        if found is not None:
            skipped = found > 0
            cast(torch.Tensor, self._last_skipped).copy_(skipped)
            cast(torch.Tensor, self._skipped).add_(skipped)
            consecutive = cast(torch.Tensor, self._consecutive)
            consecutive.copy_(torch.where(skipped, consecutive + 1, 0))
            if self._skip_limit is not None and int(consecutive.item()) >= self._skip_limit:
                raise PersistentOverflowError(
                    f"{self._skip_limit} consecutive steps were skipped for inf/NaN gradients (scale now "
                    f"{scale.item():g}). Backing off the scale did not help, so the inf/NaN does not come "
                    "from overflow: look for NaN in the data or the loss (log(0), 0/0, a bad label).",
                    "find the first non-finite layer with mixprec.diagnostics (overflow tracing), or the "
                    "parameters with non-finite gradients; fix the data or the loss.",
                )

    def _update_dynamic(self, scale: torch.Tensor, tracker: torch.Tensor, found: torch.Tensor) -> None:
        if self._hysteresis == 1:
            # torch's fused kernel: exactly torch.amp.GradScaler's rule.
            torch._amp_update_scale_(
                scale, tracker, found, self._growth_factor, self._backoff_factor, self._growth_interval
            )
        else:
            self._update_with_hysteresis(scale, tracker, found)
        if self._min_scale is not None or self._max_scale is not None:
            scale.clamp_(min=self._min_scale, max=self._max_scale)

    def _update_with_hysteresis(
        self, scale: torch.Tensor, tracker: torch.Tensor, found: torch.Tensor
    ) -> None:
        """Like torch's rule, but an overflow only backs off after ``hysteresis`` consecutive overflowing
        iterations. Every overflow still resets the growth tracker. Written as tensor ops: no sync."""
        left = cast(torch.Tensor, self._hysteresis_left)
        overflow = found > 0
        left.copy_(torch.where(overflow, left - 1, self._hysteresis))
        back_off = overflow & (left <= 0)
        left.masked_fill_(back_off, self._hysteresis)
        tracker.copy_(torch.where(overflow, 0, tracker + 1))
        grown = scale * self._growth_factor
        # Grow only if the grown scale is finite, as torch's kernel does.
        grow = (tracker >= self._growth_interval) & torch.isfinite(grown)
        tracker.masked_fill_(tracker >= self._growth_interval, 0)
        scale.copy_(torch.where(back_off, scale * self._backoff_factor, torch.where(grow, grown, scale)))

    # ------------------------------------------------------------------ getters and setters (torch API)
    def _get_scale_async(self) -> torch.Tensor | None:
        return self._scale

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). Syncs with the device."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else cast(float, self._scale.item())

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = new_factor

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = new_factor

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = new_interval

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        if self._growth_tracker is None:
            return self._init_growth_tracker
        return cast(int, self._growth_tracker.item())

    def is_enabled(self) -> bool:
        return self._enabled

    # ------------------------------------------------------------------ observability (extras; these sync)
    @property
    def is_dynamic(self) -> bool:
        return self._enabled and self._dynamic

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last completed iteration skipped its step because of inf/NaN gradients. Syncs."""
        if not self._enabled:
            return False
        t = self._last_skipped
        return self._init_last_skipped if t is None else bool(t.item())

    @property
    def skipped_steps(self) -> int:
        """How many iterations skipped their step since the scaler was made (or loaded). Syncs."""
        if not self._enabled:
            return 0
        return self._init_skipped if self._skipped is None else int(self._skipped.item())

    def stage(self, optimizer: torch.optim.Optimizer) -> OptState:
        """Where ``optimizer`` is in this iteration's protocol (READY before unscale_/step and after
        update()). No sync; asking does not create a record."""
        state = self._per_optimizer_states.get(id(optimizer)) if self._enabled else None
        return OptState.READY if state is None else state["stage"]

    def skipped_async(self) -> torch.Tensor | None:
        """This iteration's skip decision as a 0-dim bool device tensor, without a sync: from the inf
        checks recorded since the last update(), or, right after update(), the flag it recorded. None
        while disabled or before the first iteration."""
        if not self._enabled or self._scale is None:
            return None
        if any(state["found_inf_per_device"] for state in self._per_optimizer_states.values()):
            return self._combined_found_inf(self._scale) > 0
        return self._last_skipped

    def scale_history(self) -> list[float]:
        """The scale each of the last ``history_size`` iterations used, oldest first. Syncs once."""
        if not self._enabled:
            return []
        if self._history is None:
            return list(self._init_history)
        n = min(self._updates, self._history_size)
        order = [(self._updates - n + i) % self._history_size for i in range(n)]
        return cast(list[float], self._history[order].tolist())

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly: torch's five entries plus mixprec's counters. Syncs.

        Call it after ``update()``. Empty when disabled (as torch)."""
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
            "dynamic": self._dynamic,
            "min_scale": self._min_scale,
            "max_scale": self._max_scale,
            "hysteresis": self._hysteresis,
            "_hysteresis_left": self._get_hysteresis_left(),
            "skipped_steps": self.skipped_steps,
            "last_step_skipped": self.last_step_skipped,
            "_updates": self._updates,
            "_consecutive_skips": self._get_int(self._consecutive, self._init_consecutive),
            "scale_history": self.scale_history(),
        }

    def _get_hysteresis_left(self) -> int:
        return self._get_int(self._hysteresis_left, self._init_hysteresis_left)

    @staticmethod
    def _get_int(t: torch.Tensor | None, default: int) -> int:
        return default if t is None else int(t.item())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what ``state_dict`` returned (also accepts torch.amp.GradScaler's five-entry dict)."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise ScalerStateError(
                "The source state dict is empty, possibly because it was saved "
                "from a disabled instance of GradScaler.",
                "save the state of an enabled scaler, or construct this one with enabled=False.",
            )
        self._init_scale = cast(float, state_dict["scale"])
        self._growth_factor = cast(float, state_dict["growth_factor"])
        self._backoff_factor = cast(float, state_dict["backoff_factor"])
        self._growth_interval = cast(int, state_dict["growth_interval"])
        self._init_growth_tracker = cast(int, state_dict["_growth_tracker"])
        self._dynamic = state_dict.get("dynamic", self._dynamic)
        self._min_scale = state_dict.get("min_scale", self._min_scale)
        self._max_scale = state_dict.get("max_scale", self._max_scale)
        self._hysteresis = state_dict.get("hysteresis", self._hysteresis)
        self._init_hysteresis_left = state_dict.get("_hysteresis_left", self._hysteresis)
        self._init_skipped = state_dict.get("skipped_steps", 0)
        self._init_last_skipped = state_dict.get("last_step_skipped", False)
        self._updates = state_dict.get("_updates", 0)
        self._init_consecutive = state_dict.get("_consecutive_skips", 0)
        self._init_history = list(state_dict.get("scale_history", []))
        if self._scale is not None:
            self._lazy_init(self._scale.device)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled:
            if len(self._per_optimizer_states) != 0:
                raise ScalerStateError(
                    "A GradScaler instance may only be pickled at the beginning "
                    "of an iteration, or at the end after scaler.update().",
                    "pickle (or deepcopy) it before scale() or after update().",
                )
            # Tensors are turned into Python values and re-created lazily after unpickling.
            snapshot = self.state_dict()
            state["_init_scale"] = snapshot["scale"]
            state["_init_growth_tracker"] = snapshot["_growth_tracker"]
            state["_init_hysteresis_left"] = snapshot["_hysteresis_left"]
            state["_init_skipped"] = snapshot["skipped_steps"]
            state["_init_last_skipped"] = snapshot["last_step_skipped"]
            state["_init_history"] = snapshot["scale_history"]
            state["_init_consecutive"] = snapshot["_consecutive_skips"]
            for name in _DEVICE_STATE:
                state[name] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # ------------------------------------------------------------------ torch-internal hooks kept for parity
    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        ones = torch.ones((), dtype=torch.float32, device=scale.device)
        found = torch.zeros((), dtype=torch.float32, device=scale.device)
        state = self._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = self._unscale_grads_(optimizer, ones, found, True)
        return state["found_inf_per_device"]

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
