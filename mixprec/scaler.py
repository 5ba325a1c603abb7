"""Loss scaling: ``GradScaler``, a drop-in for ``torch.amp.GradScaler`` with static scaling, hysteresis,
a scale floor, scale bounds, sync-free observability and sync-free restoring of buffers on skipped steps.

Why loss scaling: fp16 flushes magnitudes below 2**-24 to zero, and many gradients live below that.
Multiplying the loss by S multiplies every gradient by S (backward is linear), lifting them into fp16's
range; we divide by S again in fp32 before the optimizer sees them. If S is too large some gradient
overflows to inf: the step is skipped and (dynamic scaling) S is halved. After ``growth_interval`` clean
steps S is doubled again, so S hovers just below the largest value that does not overflow. S never falls
below a floor (1 by default, see ``scale_state.DEFAULT_SCALE_FLOOR``): below it 1/S could turn finite
gradients into inf after the check.

The protocol per optimizer is explicit (``OptState``): READY -> (unscale_) UNSCALED -> (step) STEPPED,
and ``update()`` at the end of the iteration returns every optimizer to READY. The settings live in one
``ScaleConfig``, the changing state in one ``ScaleState`` (``scale_state.py``); the step-or-skip decision
is ``skip_step.step_unless_inf``, shared with apex-style ``scale_loss`` and the Learner.

Host-device syncs: ``scale``, ``unscale_`` and ``update`` never sync (found-inf flags, the scale, the
growth tracker, the hysteresis counter and the skip counters all stay device tensors). ``step`` syncs once
to decide whether to call ``optimizer.step()``, unless the optimizer can skip by itself
(``_step_supports_amp_scaling``, e.g. torch's fused Adam/AdamW/SGD), in which case nothing syncs.
``get_scale``, ``last_step_skipped``, ``skipped_steps`` and ``scale_history`` sync: read them when you log,
not on every step. ``update(new_scale=tensor)`` reads the tensor once to validate it.

Why this module is over ~450 lines: it is one concept, torch.amp.GradScaler's API surface (its methods,
state machine, errors and the private names torch's own tests read), kept whole so it stays a drop-in.
"""

from __future__ import annotations

import copy
import inspect
import math
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, MutableMapping
from typing import Any, Protocol, TypedDict, cast, overload, runtime_checkable

import torch
from torch import nn

from mixprec.distributed import is_sharded
from mixprec.errors import (
    FP32_MIN_MASK,
    FP32_MIN_MASK_FIX,
    ConfigError,
    DeviceMismatchError,
    Fp16GradientError,
    PersistentOverflowError,
    ScalerStateError,
)
from mixprec.func_transforms import inside_transform
from mixprec.hardware import HALF_DTYPES
from mixprec.native import cpu_scalar
from mixprec.non_finite import check_grads_
from mixprec.scale_state import (
    DEFAULT_BACKOFF_FACTOR,
    DEFAULT_GROWTH_FACTOR,
    DEFAULT_GROWTH_INTERVAL,
    DEFAULT_HISTORY_SIZE,
    DEFAULT_INIT_SCALE,
    DEFAULT_SCALE_FLOOR,
    DeviceCounters,
    HysteresisRule,
    ScaleConfig,
    ScaleState,
    check_count,
    check_scale,
    count_clean,
    update_dynamic,
)
from mixprec.skip_step import (
    BufferWatch,
    combined_found_inf,
    device_skip_is_safe,
    remove_watches,
    skips_on_device,
    step_unless_inf,
    step_with_flags,
    supports_amp_scaling,
)
from mixprec.warn_site import user_stacklevel

# A loss this large (in its magnitude) is named as a cause at the scale's floor: its gradients can overflow
# fp16 unscaled (a forecaster's MSE on unnormalized targets: 4e10). Below it, the loss is not the suspect.
LARGE_LOSS = 1.0e4

__all__ = [
    "GradScaler",
    "OptState",
    "HasMasterGrads",
    "BufferWatch",
    "step_unless_inf",
    "combined_found_inf",
    "skips_on_device",
    "device_skip_is_safe",
    "DEFAULT_INIT_SCALE",
    "DEFAULT_GROWTH_FACTOR",
    "DEFAULT_BACKOFF_FACTOR",
    "DEFAULT_GROWTH_INTERVAL",
    "DEFAULT_HISTORY_SIZE",
    "DEFAULT_SCALE_FLOOR",
]

# torch's own enum, not a copy: code written against torch.amp compares stages with `is`.
OptState = torch.amp.grad_scaler.OptState

# Consecutive skipped steps at a scale that cannot back off further before _warn_if_stuck says the run is
# not training: a transient bad batch or two passes quietly, as it always has.
STUCK_AFTER = 5

# The entries torch.amp.GradScaler.state_dict() writes: a dict without them is not a scaler's.
_TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


# step function -> whether it takes grad_scaler: inspect.signature costs ~0.1 ms, and step() asks every
# step. Weak keys: a step function (a wrapper closing over its optimizer) keeps nothing alive from here.
_TAKES_GRAD_SCALER: weakref.WeakKeyDictionary[Callable[..., Any], bool] = weakref.WeakKeyDictionary()


def _takes_grad_scaler(step: Callable[..., Any]) -> bool:
    """Whether an optimizer's ``step`` takes the scaler itself (torch's ``grad_scaler=`` protocol, which
    torch's GradScaler asks the same way). A bound method is asked through its function (a new bound
    method object every access)."""
    function = getattr(step, "__func__", step)
    try:
        known = _TAKES_GRAD_SCALER.get(function)
    except TypeError:  # not weakly referable: ask directly
        return "grad_scaler" in inspect.signature(step).parameters
    if known is None:
        known = _TAKES_GRAD_SCALER[function] = "grad_scaler" in inspect.signature(step).parameters
    return known


@runtime_checkable
class HasMasterGrads(Protocol):
    """An optimizer that keeps fp32 master copies (``mixprec.MasterWeights``): the scaler asks it to copy
    the model's half-precision gradients into the master gradients before it unscales them. Optional:
    ``scaled_grad_params()`` names the tensors whose ``.grad`` the scaler checks and unscales (default: the
    param groups' parameters); ``grads_unscaled()`` is called after a user's ``unscale_``."""

    def copy_grads_to_master(self) -> None: ...


class _PerOptimizer(TypedDict):
    """torch's per-optimizer record, same keys: code reading ``_per_optimizer_states[id(opt)]["stage"]``
    (and torch's own tests) keeps working."""

    stage: OptState
    # one float32 flag per device: > 0 when any gradient on that device was inf/NaN
    found_inf_per_device: dict[torch.device, torch.Tensor]


def _refresh_per_optimizer_state() -> _PerOptimizer:
    # Module-level (not a lambda) so that the defaultdict holding these records can be pickled.
    return {"stage": OptState.READY, "found_inf_per_device": {}}


def _is_namedtuple(value: object) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


# Where torch's fused unscale-and-check op has no kernel: its CUDA loop covers fp16, fp32 and fp64 only
# (torch 2.4 to 2.13), so bf16 gradients there (a GradScaler over a bf16 model, O2 bf16 without fp32 master
# gradients) raised NotImplementedError.
NO_FUSED_UNSCALE: frozenset[tuple[str, torch.dtype]] = frozenset({("cuda", torch.bfloat16)})


def unscale_and_check_(grads: list[torch.Tensor], found: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """Multiply ``grads`` (one device, one dtype) by ``inv_scale`` in place and set ``found`` (0-d fp32) to
    1.0 if any holds an inf or NaN: torch's fused op, or where it has no kernel two foreach passes to the
    same effect."""
    if (grads[0].device.type, grads[0].dtype) not in NO_FUSED_UNSCALE:
        # One fused kernel per (device, dtype): multiplies by 1/scale and sets `found` on inf/NaN.
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale)
        return
    # A sharded (DTensor) gradient is checked and scaled through its local shard, which may be empty (a
    # dimension smaller than the number of ranks); the ranks' flags then meet in one all-reduce.
    local = [g.to_local() if is_sharded(g) else g for g in grads]
    # max |g| of each tensor: an inf stays inf and a NaN propagates through the max, so one stack of
    # per-tensor peaks holds a non-finite value exactly when some gradient does (no model-sized temporary).
    # Empty tensors hold nothing to check (and have no inf-norm).
    nonempty = [t for t in local if t.numel()]
    bad = torch.zeros((), dtype=found.dtype, device=found.device)
    if nonempty:
        peaks = torch._foreach_norm(nonempty, ord=math.inf)
        bad = (~torch.isfinite(torch.stack(peaks))).any().to(found.dtype)
    for mesh in {id(g.device_mesh): g.device_mesh for g in grads if is_sharded(g)}.values():
        for group in mesh.get_all_groups():  # every rank of every mesh dimension: the same flag everywhere
            torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX, group=group)
    found.copy_(torch.maximum(found, bad))  # 1.0 once any is inf/NaN, never more
    # Computed in fp32 (opmath) and rounded once to the gradient's dtype, as torch's fused op does; but on
    # CUDA the kernel reads the fp32 inv_scale as a bf16 value first. That is exact for the power-of-two
    # scales of dynamic scaling (2**16 at start, x2 and x0.5 steps): the same bits as the fused op. A scale
    # that is no power of two (a user's init_scale=1000) is off by up to one bf16 rounding of 1/scale,
    # 2**-9 relative, less than the rounding the bf16 gradient already carries. (Exact would need the
    # scale on the host: a sync every step.) On CUDA, bf16, inv_scale is passed as bf16: the same bits (the
    # kernel reads it as bf16 anyway), and torch's multi-tensor kernel takes only a scalar of the list's
    # dtype; an fp32 one sends it to one kernel per tensor (52 instead of 1 for the benchmark's GPT, H200).
    # Elsewhere it stays fp32: the CPU reads it exactly (torch's fused op's bits), and an fp16 1/scale
    # would underflow to 0 at scales from 2**25.
    if nonempty:
        cuda_bf16 = nonempty[0].is_cuda and nonempty[0].dtype == torch.bfloat16
        # the shards' own memory: the DTensors see the result
        torch._foreach_mul_(nonempty, inv_scale.to(torch.bfloat16) if cuda_bf16 else inv_scale)


def _read_only_check(grads: list[torch.Tensor], found: torch.Tensor, inv_scale: torch.Tensor,
                     checker: Callable[[list[torch.Tensor], torch.Tensor], None] | None) -> bool:
    """At an inverse scale of exactly 1 (bf16's static scale) unscaling leaves gradients as they are and
    only the inf/NaN check is left: the native one on the CPU (non_finite.py: ~3x faster than torch's op
    on half gradients; it reads the scale itself and declines any other value), else the optimizer's
    ``checker`` (half gradients; given only where the scale is known to be 1). Whether either ran; if
    not, the caller runs torch's op."""
    if check_grads_(grads, found, inv_scale):
        return True
    # plain tensors only: torch's op also all-reduces the flag of sharded (DTensor) grads
    if checker is None or not all(type(g) is torch.Tensor for g in grads):
        return False
    checker(grads, found)
    return True


class GradScaler:
    """Loss scaler with the constructor, methods, state machine, errors and pickling of
    ``torch.amp.GradScaler``; extras are keyword-only and default to torch's behaviour (but for the
    scale's floor, below).

    Where it differs from torch.amp.GradScaler, on purpose (tests/test_scaler.py compares the rest):
        * the scale never falls below ``min_scale`` (1.0 by default; torch backs off without end), and a
          scale below it (``init_scale``, ``update(new_scale)``, a loaded state) raises ``ConfigError``;
        * other settings torch takes without a check (a zero, negative or infinite scale or factor, a
          growth interval below 1, a backoff factor outside (0, 1)) raise ``ConfigError`` naming the fix;
        * a skipped step marks the optimizer as stepped, so an LR scheduler does not warn after a skipped
          first step (torch's does; pytorch#44511) and the schedule advances with the iteration;
        * optimizers whose skipped first step would leave a momentum buffer uninitialized (fused SGD with
          momentum) are stepped only if clean, decided on the host (one sync): torch's kernel would skip
          on the device and leave the buffer garbage; a clean step is torch's (its kernel unscales);
        * ``state_dict()`` holds more keys (hysteresis, skip counts, history); either class loads the
          other's; the class is not a subclass of torch's (``isinstance`` checks against it fail).

    Args (as torch):
        device: device type of the scaled tensors ("cuda", "cpu", ...). As in torch, "cuda" without CUDA
            warns and disables the scaler, so the same script runs unscaled on a CPU-only machine.
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as torch.amp.GradScaler
            (numpy and 1-element tensor numbers are accepted, as torch does).
    Extras (keyword-only):
        dynamic: False gives static loss scaling: ``init_scale`` never changes (steps with inf/NaN
            gradients are still skipped). fastai's default static scale is 512; the fp16-from-scratch
            recipe uses 8192.
        min_scale: the floor of the dynamic scale; None means 1.0 (``DEFAULT_SCALE_FLOOR``: why there).
            Every scale that enters (``init_scale``, ``update(new_scale)``, a loaded state) must be >= it.
        max_scale: the ceiling of the dynamic scale (None: unbounded, as torch).
        hysteresis: how many overflows the scale tolerates before it backs off (DeepSpeed's
            ``hysteresis``/``delayed_shift``). 1 backs off on every overflow (torch).
        hysteresis_rule: "deepspeed" (default; DeepSpeed's DynamicLossScaler and Megatron-LM): once the
            allowance is spent, every further overflow backs off, and only a growth restores it.
            "consecutive" (mixprec 0.x): back off once per ``hysteresis`` consecutive overflowing
            iterations; any clean iteration restores the allowance.
        history_size: how many per-iteration scales ``scale_history()`` keeps (a device ring buffer).
        allow_fp16_grads: unscale fp16 gradients in place (pure-fp16 training, apex O3). By default fp16
            gradients raise ``Fp16GradientError``: the fix is fp32 master weights.
        sync_found_inf: all-reduce the inf/NaN flags over the default ``torch.distributed`` process group
            (or ``process_group``) before deciding to skip, so every rank skips together. Needed when
            gradients are not already all-reduced (sharded or ``no_sync`` gradients, model parallelism);
            with DDP's all-reduced gradients every rank sees the same flags anyway. Costs one collective
            per optimizer and device; a rank without gradients in a step joins it with a zero flag.
        skip_limit: raise ``PersistentOverflowError`` once this many consecutive iterations were skipped.
            Overflow from too large a scale stops after a few back-offs; a run that keeps skipping has
            inf/NaN for another reason (bad data, log(0)) and would otherwise skip forever. Checking it
            reads one counter per ``update()`` (a sync), so it is off (None) by default. The error leaves
            the scaler ready for the next iteration, its count of consecutive skips reset.
    """

    def __init__(
        self,
        device: str | torch.device = "cuda",
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
        hysteresis_rule: HysteresisRule = "deepspeed",
        history_size: int = DEFAULT_HISTORY_SIZE,
        allow_fp16_grads: bool = False,
        sync_found_inf: bool = False,
        process_group: Any = None,
        skip_limit: int | None = None,
    ) -> None:
        # torch takes "cuda", "cuda:0" or torch.device("cuda") alike; the scale and flags live on the device
        # of the first scaled tensor, so only the type is kept and checked.
        self._device = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
        self._enabled = enabled
        if self._device == "cuda" and enabled and not torch.cuda.is_available():
            warnings.warn(
                "mixprec.GradScaler is enabled with device='cuda', but CUDA is not available. Disabling "
                "(pass device='cpu' to scale on the CPU).",
                stacklevel=2,
            )
            self._enabled = False
        self._config = ScaleConfig()
        self._state = ScaleState(scale=1.0)
        self._watches: list[BufferWatch] = []
        self._warned_stuck = False  # _warn_if_stuck said it once
        self._last_loss: torch.Tensor | None = None  # the last one-element tensor scale() multiplied
        self._per_optimizer_states: defaultdict[int, _PerOptimizer] = defaultdict(
            _refresh_per_optimizer_state
        )
        # a disabled scaler's getters return what was passed or set, unchecked (torch's raise AttributeError)
        self._unchecked = {"growth_factor": growth_factor, "backoff_factor": backoff_factor,
                           "growth_interval": growth_interval}
        if not self._enabled:
            return  # as torch: a disabled scaler validates nothing, every call is a pass-through
        self._config = ScaleConfig(
            growth_factor, backoff_factor, growth_interval, dynamic, min_scale, max_scale, hysteresis,
            hysteresis_rule, init_scale, skip_limit,
        )  # fmt: skip
        self._state = ScaleState(
            scale=self._config.init_scale,
            hysteresis_left=self._config.hysteresis,
            history_size=cast(int, check_count("history_size", history_size)),
        )
        self._allow_fp16_grads = allow_fp16_grads
        self._sync_found_inf = sync_found_inf
        self._process_group = process_group

    @classmethod
    def from_config(cls, device: str, config: ScaleConfig, **extras: Any) -> GradScaler:
        """A scaler with ``config``'s settings (a :class:`~mixprec.recipe.Recipe`'s ``scale``); ``extras``
        are the other keyword arguments (``allow_fp16_grads``, ``history_size``, ...)."""
        fields = {name: getattr(config, name) for name in (
            "init_scale", "growth_factor", "backoff_factor", "growth_interval", "dynamic", "min_scale",
            "max_scale", "hysteresis", "hysteresis_rule", "skip_limit")}  # fmt: skip
        return cls(device, **fields, **extras)

    @property
    def _skip_limit(self) -> int | None:
        return self._config.skip_limit

    # ------------------------------------------------------------------ torch's private names, kept readable
    @property
    def _scale(self) -> torch.Tensor | None:
        return None if self._state.device is None else self._state.device.scale

    @property
    def _growth_tracker(self) -> torch.Tensor | None:
        return None if self._state.device is None else self._state.device.growth_tracker

    @property
    def _init_scale(self) -> float:
        return self._state.scale

    @property
    def _init_growth_tracker(self) -> int:
        return self._state.growth_tracker

    def _setting(self, name: str) -> Any:
        return getattr(self._config, name) if self._enabled else self._unchecked[name]

    def _set_setting(self, name: str, value: Any) -> None:
        if self._enabled:
            self._config = self._config.replace(**{name: value})  # checked
        else:
            self._unchecked[name] = value

    _growth_factor = property(lambda self: self._setting("growth_factor"))
    _backoff_factor = property(lambda self: self._setting("backoff_factor"))
    _growth_interval = property(lambda self: self._setting("growth_interval"))

    # ------------------------------------------------------------------ lazy device state
    def _lazy_init(self, dev: torch.device) -> DeviceCounters:
        if dev.type != self._device:
            raise DeviceMismatchError(
                f"This GradScaler was made for device '{self._device}' but is scaling a tensor on '{dev}'.",
                f"create it with mixprec.GradScaler('{dev.type}', ...), one scaler per device type.",
            )
        return self._state.to_device(dev)

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:  # torch's name for _lazy_init
        self._lazy_init(dev)

    def _check_scale_growth_tracker(self, funcname: str) -> DeviceCounters:
        if self._state.device is None:
            raise ScalerStateError(
                f"Attempted {funcname} but _scale is None.",
                "call scaler.scale(loss) (and backward on it) earlier in the iteration.",
            )
        return self._state.device

    # ------------------------------------------------------------------ scale
    @overload
    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...
    @overload
    def scale(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]: ...
    @overload
    def scale(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]: ...
    @overload
    def scale(self, outputs: Mapping[Any, torch.Tensor]) -> Mapping[Any, torch.Tensor]: ...
    @overload
    def scale(self, outputs: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]: ...

    def scale(self, outputs: Any) -> Any:
        """Multiply a tensor, or every tensor in a nested structure, by the scale. No sync.

        Lists, tuples (namedtuples too) and mappings come back as the same type, as torch returns lists
        and tuples (torch breaks on namedtuples and returns a lazy ``map`` over a dict's keys); any
        other iterable comes back as a lazy ``map``, as in torch."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            dev = self._state.device
            if dev is None or outputs.device.type != self._device:
                dev = self._lazy_init(outputs.device)  # raises DeviceMismatchError on a foreign device type
            # a loss: kept (no copy, no read) for _why_stuck to look at; not one made inside a torch.func
            # transform (a per-sample loss), whose wrapped tensor cannot be read outside it
            if outputs.numel() == 1 and not inside_transform():
                self._last_loss = outputs.detach()
            return outputs * dev.scale.to(device=outputs.device, non_blocking=True)
        if isinstance(outputs, Mapping):
            scaled = copy.copy(outputs) if isinstance(outputs, MutableMapping) else dict(outputs)
            for key, value in outputs.items():
                scaled[key] = self.scale(value)
            return scaled
        if _is_namedtuple(outputs):
            return type(outputs)(*map(self.scale, outputs))
        if isinstance(outputs, list | tuple):
            return type(outputs)(map(self.scale, outputs))
        if isinstance(outputs, Iterable) and not isinstance(outputs, str | bytes):
            return map(self.scale, outputs)
        raise ValueError("outputs must be a Tensor or an iterable of Tensors")

    # ------------------------------------------------------------------ unscale
    def _grads_by_device_and_dtype(
        self, optimizer: torch.optim.Optimizer, allow_fp16: bool, done: Collection[int] = ()
    ) -> dict[torch.device, dict[torch.dtype, list[torch.Tensor]]]:
        """The gradients to unscale, by device and dtype; ``done``: ids of parameters whose gradients were
        unscaled already (O2's master gradients, in the copy from the model's)."""
        buckets: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(
            lambda: defaultdict(list)
        )
        named = getattr(optimizer, "scaled_grad_params", None)
        params = named() if callable(named) else [p for g in optimizer.param_groups for p in g["params"]]
        for param in params:
            if param.grad is None or id(param) in done:
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
            if grad.is_complex():
                # torch's unscale-and-check op has no complex kernel (pytorch#58228; an FNO's complex
                # weights failed under torch.amp's scaler and here): the same numbers as real pairs, a view.
                # A conjugate view (w.conj() in the forward) has no real view: resolved into .grad first.
                if grad.is_conj():
                    param.grad = grad = grad.resolve_conj()
                grad = torch.view_as_real(grad)
            buckets[grad.device][grad.dtype].append(grad)
        return buckets

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
        check_only: bool = False,
    ) -> dict[torch.device, torch.Tensor]:
        return self._unscale_grads_reporting(optimizer, inv_scale, found_inf, allow_fp16, check_only)[0]

    def _unscale_grads_reporting(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                                 found_inf: torch.Tensor, allow_fp16: bool, check_only: bool = False
                                 ) -> tuple[dict[torch.device, torch.Tensor], bool]:
        """``_unscale_grads_`` (torch's name and result), and whether every gradient was only read: the
        native check ran on each, so the inverse scale was exactly 1 and no value changed."""
        done, read_only, fused_found = self._copy_to_masters(optimizer, inv_scale, found_inf, check_only)
        # check_only (inv_scale is 1: the step unscales): an optimizer may bring a read-only check of its
        # half gradients (MasterWeights with compile_step=True: a compiled one, for where the native
        # check does not run, a GPU)
        checker = getattr(optimizer, "non_finite_check", None) if check_only else None
        per_device_found: dict[torch.device, torch.Tensor] = {}
        if fused_found is not None:
            per_device_found[found_inf.device] = fused_found
        with torch.no_grad():
            for device, per_dtype in self._grads_by_device_and_dtype(optimizer, allow_fp16, done).items():
                found = per_device_found.setdefault(device, found_inf.to(device, copy=True))
                dev_inv_scale = inv_scale.to(device)
                for dtype, grads in per_dtype.items():
                    half_checker = checker if dtype in HALF_DTYPES else None
                    if _read_only_check(grads, found, dev_inv_scale, half_checker):
                        continue
                    unscale_and_check_(grads, found, dev_inv_scale)
                    read_only = False
        if self._sync_found_inf and torch.distributed.is_available() and torch.distributed.is_initialized():
            if not per_device_found:  # no gradients here this step: still join the other ranks' all-reduce
                per_device_found[found_inf.device] = torch.zeros_like(found_inf)
            for found in per_device_found.values():
                # MAX, not SUM: the flag stays exactly 1.0 when any rank saw inf, as fused optimizers need
                torch.distributed.all_reduce(
                    found, op=torch.distributed.ReduceOp.MAX, group=self._process_group
                )
        return per_device_found, read_only

    @staticmethod
    def _copy_to_masters(optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                         check_only: bool) -> tuple[set[int], bool, torch.Tensor | None]:
        """An optimizer with fp32 master gradients (O2) copies the model's half gradients into them first,
        on the CPU unscaling and checking them in the same pass: the ids of the parameters whose gradients
        it did, whether all of those were unscaled by exactly 1, and their inf/NaN flag (a copy of
        ``found_inf``; None where it did none). ``check_only`` (an optimizer that unscales in its own
        step) passes an inverse scale of exactly 1: the same pass is then an exact copy and the check, and
        the master gradients are not read again to check them."""
        fused = getattr(optimizer, "copy_grads_to_master_unscaled", None)
        if callable(fused) and inv_scale.device.type == "cpu":
            found = found_inf.clone()
            done, exact = fused(found, inv_scale)
            return done, exact, (found if done else None)
        copy = getattr(optimizer, "copy_grads_to_master", None)  # HasMasterGrads, without isinstance's
        if callable(copy):  # ~15 us protocol check per step
            copy()
        return set(), True, None

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale, in place, and record whether any is inf/NaN.

        Call it before clipping or inspecting gradients; ``step`` calls it for you otherwise. No sync.
        """
        if not self._enabled:
            return
        by_one = self._unscale(optimizer)
        mirror = getattr(optimizer, "grads_unscaled", None)
        if callable(mirror):
            # MasterWeights: the model's .grad show the unscaled values (torch.amp's clip recipe)
            mirror(exact_upcasts=by_one)

    def _unscale(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale ``optimizer``'s gradients; whether they were only read (the native check at an inverse
        scale of exactly 1, on the CPU): then master gradients still hold the exact upcasts of the model's
        half gradients, which a mirror back into the model need not write again. No host read."""
        dev = self._check_scale_growth_tracker("unscale_")
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
        # FP32 division can be imprecise under some compile options, so take the reciprocal in FP64.
        inv_scale = dev.scale.double().reciprocal().float()
        found_inf = torch.zeros((), dtype=torch.float32, device=dev.scale.device)
        state["found_inf_per_device"], read_only = self._unscale_grads_reporting(
            optimizer, inv_scale, found_inf, self._allow_fp16_grads
        )
        state["stage"] = OptState.UNSCALED
        return read_only

    # ------------------------------------------------------------------ step
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (if not done yet), then ``optimizer.step(*args, **kwargs)`` unless a gradient was inf/NaN.

        The decision is ``step_unless_inf``: one sync, unless the optimizer skips by itself (fused
        optimizers), then none. Returns what ``optimizer.step`` returned, or None when the step was skipped.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs or any(callable(a) for a in args):  # LBFGS's step(closure), either way
            # torch refuses the keyword only; a positional closure then failed at the inf check ("No inf
            # checks were recorded for this optimizer"), which says nothing of the closure
            raise ScalerStateError(
                "Closure use is not currently supported if GradScaler is enabled: the closure (LBFGS's) "
                "runs its backward inside step(), after the scaler unscaled and checked the gradients.",
                "run such an optimizer in fp32 (GradScaler(enabled=False); after initialize, "
                "mixprec.amp.restore(model) first), e.g. Adam in mixed precision, then LBFGS in fp32.",
            )
        dev = self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise ScalerStateError(
                "step() has already been called since the last update().",
                "call scaler.update() once at the end of each iteration, after stepping every optimizer.",
            )
        if getattr(optimizer, "_step_supports_amp_scaling", False) and _takes_grad_scaler(optimizer.step):
            return self._step_passing_self(optimizer, state, *args, **kwargs)
        fused = supports_amp_scaling(optimizer)  # unscales in its own kernel: torch's fused optimizers
        # unscaled already (unscale_): the kernel divides only by a scale the user put on the optimizer
        grad_scale = getattr(optimizer, "grad_scale", None) if fused else None
        if state["stage"] is OptState.READY and fused:
            self._check_inf_per_device(optimizer)  # the fused kernel unscales: only look for inf/NaN here
            grad_scale = dev.scale * getattr(optimizer, "grad_scale", 1)  # torch: product with the user's
        elif state["stage"] is OptState.READY:
            self._unscale(optimizer)  # not unscale_: nobody reads the model's gradients before this step
        if not state["found_inf_per_device"] and fused:
            # no parameter has a gradient, so there is nothing to check or skip: torch calls a fused
            # optimizer's step all the same (a no-op for parameters without gradients), flags set, so we do
            clean = torch.zeros((), dtype=torch.float32, device=dev.scale.device)
            retval = step_with_flags(optimizer, clean, grad_scale, optimizer.step, *args, **kwargs)
            state["stage"] = OptState.STEPPED
            return retval
        if not state["found_inf_per_device"]:
            raise ScalerStateError(
                "No inf checks were recorded for this optimizer.",
                "none of its parameters has a gradient: call backward on the scaled loss before step().",
            )
        found = combined_found_inf(state["found_inf_per_device"].values(), dev.scale.device)
        retval = step_unless_inf(optimizer, found, optimizer.step, *args, grad_scale=grad_scale, **kwargs)
        state["stage"] = OptState.STEPPED
        return retval

    def _step_passing_self(
        self, optimizer: torch.optim.Optimizer, state: _PerOptimizer, *args: Any, **kwargs: Any
    ) -> Any:
        """The older protocol of custom optimizers, ``step(grad_scaler=...)``: the optimizer asks the scaler
        itself. torch deprecates it with this FutureWarning."""
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

    # ------------------------------------------------------------------ update
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Update the scale for the next iteration (back off on overflow, grow after ``growth_interval``
        clean iterations), or set it to ``new_scale``; on a skipped iteration put the watched modules'
        buffers back. Call once per iteration after all steps. No sync (``new_scale`` as a tensor: one)."""
        if not self._enabled:
            return
        dev = self._check_scale_growth_tracker("update")
        recorded = any(s["found_inf_per_device"] for s in self._per_optimizer_states.values())
        if new_scale is None and not recorded:
            raise ScalerStateError(
                "No inf checks were recorded prior to update.",
                "call scaler.step(optimizer) (or unscale_) for at least one optimizer before update().",
            )
        if new_scale is not None:  # validated before anything changes
            new_scale = check_scale("new_scale", self._checked_new_scale(new_scale), self._config.floor)
        found = self.found_inf_async() if recorded else None
        self._state.record(found)
        if found is not None:
            for watch in self._watches:
                watch.restore_if(found)
        if new_scale is not None:
            dev.scale.fill_(new_scale)
        elif self._config.dynamic:
            update_dynamic(self._config, dev, cast(torch.Tensor, found))
        elif found is not None:
            count_clean(dev, found)
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        self._check_skip_limit()
        self._warn_if_stuck()

    def _checked_new_scale(self, new_scale: Any) -> Any:
        """torch accepts a float or a 1-element float tensor on the scaler's device; so do we (numpy floats
        too), and say so in the user's words for anything else (torch: an AttributeError)."""
        if isinstance(new_scale, torch.Tensor):
            if new_scale.device.type != self._device or new_scale.numel() != 1 or new_scale.requires_grad:
                raise ConfigError(
                    "new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                    "torch.FloatTensor with requires_grad=False; got a tensor of shape "
                    f"{tuple(new_scale.shape)} on '{new_scale.device}' "
                    f"(requires_grad={new_scale.requires_grad}).",
                    "pass a Python float, e.g. scaler.update(1024.0), or a one-element tensor on "
                    f"'{self._device}'.",
                )
            return new_scale
        if isinstance(new_scale, float):  # numpy's float64 is a float; float32 is accepted below
            return new_scale
        if hasattr(new_scale, "dtype") and getattr(new_scale.dtype, "kind", "") == "f":
            return float(new_scale)
        raise ConfigError(
            f"scaler.update(new_scale) takes the new scale as a float, got {new_scale!r} "
            f"({type(new_scale).__name__}), as torch.amp does.",
            f"write scaler.update({float(new_scale) if isinstance(new_scale, int) else 1024.0!r}).",
        )

    def found_inf_async(self, *optimizers: torch.optim.Optimizer) -> torch.Tensor:
        """This iteration's inf/NaN flag over ``optimizers`` (all with a recorded inf check when none are
        named): a 0-dim float32 device tensor, > 0 when any of their gradients was inf/NaN. No sync.

        apex's rule that one overflowing loss skips every optimizer it touched: pass this flag, over all
        of them, to ``step_unless_inf`` for each."""
        if not self._enabled:
            raise ScalerStateError("found_inf_async() on a disabled GradScaler.", "check is_enabled() first.")
        dev = self._check_scale_growth_tracker("found_inf_async")
        records = self._per_optimizer_states
        states = [records.get(id(opt)) for opt in optimizers] if optimizers else list(records.values())
        flags = [
            flag for state in states if state is not None for flag in state["found_inf_per_device"].values()
        ]
        if not flags:
            raise ScalerStateError(
                "No inf checks were recorded prior to update.",
                "call scaler.step(optimizer) (or unscale_) for at least one optimizer before update().",
            )
        return combined_found_inf(flags, dev.scale.device)

    def _warn_if_stuck(self) -> None:
        """Once per scaler, on the CPU (where reading the counters costs nothing; elsewhere skip_limit is
        the check): every step skipped at a scale that will not back off further, so nothing trains, and
        without skip_limit nothing else would say so (a user trial: 67 of 69 steps skipped, silently)."""
        if self._warned_stuck or self._skip_limit is not None or self._device != "cpu":
            return
        dev = cast(DeviceCounters, self._state.device)
        if cpu_scalar(dev.consecutive) < STUCK_AFTER:  # read in place: update() stays sync-free
            return
        backing_off, cause, fix = self._why_stuck(float(cpu_scalar(dev.scale)))
        if backing_off:
            return  # overflow may yet clear
        self._warned_stuck = True
        warnings.warn(
            f"GradScaler: the last {STUCK_AFTER} steps were all skipped for inf/NaN gradients: nothing is "
            f"training. {cause} Fix: {fix}; pass skip_limit=N to stop with an error instead of skipping on.",
            RuntimeWarning,
            stacklevel=user_stacklevel(),  # the user's update() or `with scale_loss(...)` line
        )

    def _why_stuck(self, scale: float) -> tuple[bool, str, str]:
        """(whether the scale is still backing off, what it says about steps skipped in a row, the fix) at
        ``scale``."""
        # what makes the forward or the loss non-finite, whatever the scale
        forward = ("NaN in the data or the loss (log(0), 0/0, a bad label); an fp16 overflow in the forward "
                   "(an activation or logit above 65504, e.g. logits scaled up or a sum over a large batch: "
                   f"the loss is inf whatever the scale); {FP32_MIN_MASK} ({FP32_MIN_MASK_FIX})")
        others = f"Other causes: {forward}; a learning rate that makes the weights diverge."
        last = getattr(self, "_last_loss", None)  # a scaler pickled before it existed has none
        last_finite = last is None or bool(torch.isfinite(last).all())  # read once, here: no per-step sync
        find = ("find the first non-finite layer with mixprec.diagnostics.trace_nonfinite, or the parameters "
                "with non-finite gradients; fix the data, the loss or the learning rate")
        floor = float(torch.tensor(self.scale_floor, dtype=torch.float32))  # the scale: fp32, clamped there
        if not last_finite:
            # Made before this backward: the forward, or a loss built from scaled gradients (a gradient
            # penalty's autograd.grad), which a lower scale does help: wait for the floor as for gradients.
            penalty = ("" if scale <= 1 else f" If the loss is built from gradients of a scaled loss (a "
                       f"gradient penalty's autograd.grad), those may overflow at a scale of {scale:g}: a "
                       "lower one helps" + ("." if self._config.dynamic else " (loss_scale=, init_scale=, "
                                            "or a dynamic scale)."))
            return (scale > floor and self._config.dynamic,
                    f"The last loss scaled was {last.item()}: the inf/NaN is made in the forward or the "
                    "loss, before backward. Likely: a loss or softmax written by hand (exp, sum, log) "
                    "computed in half (on the CPU torch's autocast tables, which mixprec.autocast keeps, "
                    f"leave those ops in their input's dtype; CUDA's compute them in fp32); {forward}."
                    f"{penalty}",
                    "compute a hand-written loss from .float() tensors (or use torch's own: F.cross_entropy, "
                    f"torch.logsumexp), or keep the module it names in fp32 (mixprec.keep_fp32); {find}")
        if scale > floor and self._config.dynamic:
            return (True, f"The scale was still backing off (now {scale:g}, floor {self.scale_floor:g}): the "
                    f"gradients may just overflow at the scales tried so far. {others}",
                    f"raise skip_limit (now {self._skip_limit}) or start lower (init_scale=); or {find}")
        if scale > floor:
            return (False, f"A static scale of {scale:g} may itself overflow the gradients. {others}",
                    f"lower the static scale (loss_scale=, init_scale=) or use a dynamic one; or {find}")
        at = "its floor" if self._config.dynamic else "a static scale"
        # At a scale of 1 a gradient can still overflow: an op's backward whose intermediate exceeds the half
        # range whatever the loss was multiplied by (a hand-written RMSNorm's 0.5 * rsqrt(v)**3 in fp16), or
        # the loss itself is so large that its gradients do (an MSE on unnormalized targets of ~1e5: a loss
        # of 4e10 in a trial, which torch.amp's scaler, with no floor, trained at a scale of 5e-7).
        large = ""
        if last is not None and last_finite:
            size = float(last.detach().float().abs().max())
            if size >= LARGE_LOSS:
                large = (f", or a loss so large that its gradients overflow even unscaled (the last loss was "
                         f"{size:g}: an MSE on unnormalized targets)")
        return (False, f"At {at} ({scale:g}) a lower scale cannot help unless the loss itself is too large: "
                f"the inf/NaN comes from the data, the forward, a backward that overflows the half dtype at "
                f"any scale (an op computed in half whose gradient is huge: a norm or a scan written by "
                f"hand){large}. {others}",
                f"{find}; keep the part it names in fp32 (mixprec.keep_fp32(module) before initialize or "
                "to_fp16(), or compute it from .float() tensors); for a large loss, normalize the loss or "
                "its targets, or let the scale go below 1: GradScaler(min_scale=...), initialize(..., "
                "min_loss_scale=...)")

    def _check_skip_limit(self) -> None:
        dev = cast(DeviceCounters, self._state.device)
        if self._skip_limit is None or int(dev.consecutive.item()) < self._skip_limit:
            return
        dev.consecutive.zero_()  # the scaler stays usable: fix the data, then train on with it
        _, cause, fix = self._why_stuck(float(dev.scale.item()))
        raise PersistentOverflowError(
            f"{self._skip_limit} consecutive steps were skipped for inf/NaN gradients. {cause}",
            f"{fix}. The scaler is ready for the next iteration (update(new_scale=...) resets the scale).",
        )

    # ------------------------------------------------------------------ buffers on skipped steps
    def watch(self, module: nn.Module, *, all_buffers: bool = False) -> BufferWatch:
        """Keep ``module``'s running statistics (its BatchNorm layers' running mean/var) as they were when a
        step is skipped; ``all_buffers=True``: every buffer (not one the forward reads: put back, the same
        forward would overflow again, and every step be skipped).

        A forward pre-hook snapshots them at the first training forward of each iteration; ``update()``
        puts them back where the iteration skipped, with ``torch.where`` on the device flag (no sync).
        Returns the ``BufferWatch``; ``.remove()`` stops it. Watches are not pickled with the scaler."""
        watch = BufferWatch(module, all_buffers=all_buffers)
        self._watches.append(watch)
        return watch

    def unwatch(self, module: nn.Module) -> None:
        """Stop the watches :meth:`watch` put on ``module``."""
        remove_watches(self._watches, module)

    # ------------------------------------------------------------------ getters and setters (torch API)
    def _get_scale_async(self) -> torch.Tensor | None:
        return self._scale

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). Syncs with the device."""
        return float(self._state.read("scale")) if self._enabled else 1.0

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._set_setting("growth_factor", new_factor)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._set_setting("backoff_factor", new_factor)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._set_setting("growth_interval", new_interval)

    def _get_growth_tracker(self) -> int:
        return int(self._state.read("growth_tracker")) if self._enabled else 0

    def is_enabled(self) -> bool:
        return self._enabled

    # ------------------------------------------------------------------ observability (extras; these sync)
    @property
    def is_dynamic(self) -> bool:
        return self._enabled and self._config.dynamic

    @property
    def scale_floor(self) -> float:
        """The lowest scale this scaler accepts or backs off to (``min_scale``, or 1.0)."""
        return self._config.floor

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last completed iteration skipped its step because of inf/NaN gradients. Syncs."""
        return bool(self._state.read("last_skipped")) if self._enabled else False

    @property
    def skipped_steps(self) -> int:
        """How many iterations skipped their step since the scaler was made (or loaded). Syncs."""
        return int(self._state.read("skipped")) if self._enabled else 0

    def stage(self, optimizer: torch.optim.Optimizer) -> OptState:
        """Where ``optimizer`` is in this iteration's protocol (READY before unscale_/step and after
        update()). No sync; asking does not create a record."""
        state = self._per_optimizer_states.get(id(optimizer)) if self._enabled else None
        return OptState.READY if state is None else state["stage"]

    def skipped_async(self) -> torch.Tensor | None:
        """This iteration's skip decision as a 0-dim bool device tensor, without a sync: from the inf
        checks recorded since the last update(), or, right after update(), the flag it recorded. None
        while disabled or before the first iteration."""
        dev = self._state.device if self._enabled else None
        if dev is None:
            return None
        if any(state["found_inf_per_device"] for state in self._per_optimizer_states.values()):
            return self.found_inf_async() > 0
        return dev.last_skipped

    def scale_history(self) -> list[float]:
        """The scale each of the last ``history_size`` iterations used, oldest first. Syncs once."""
        return list(self._state.to_python().history) if self._enabled else []

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly: torch's five entries plus mixprec's settings and counters.
        Syncs once. Call it after ``update()``. Empty when disabled (as torch)."""
        return {**self._config.as_dict(), **self._state.as_dict()} if self._enabled else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what ``state_dict`` returned (also accepts torch.amp.GradScaler's five-entry dict). Every
        value is validated before anything changes."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise ScalerStateError(
                "The source state dict is empty, possibly because it was saved "
                "from a disabled instance of GradScaler.",
                "save the state of an enabled scaler, or construct this one with enabled=False.",
            )
        missing = [key for key in _TORCH_KEYS if key not in state_dict]
        if missing:
            raise ScalerStateError(
                f"The state dict lacks {', '.join(missing)}: it is not what a GradScaler's state_dict() "
                "returned.",
                "pass scaler.state_dict() (or torch.amp.GradScaler's) exactly as it was saved.",
            )
        config = self._config.from_dict(state_dict)
        check_scale("the loaded scale", state_dict["scale"], config.floor)
        check_count("_growth_tracker", state_dict["_growth_tracker"], 0)
        self._config = config
        self._state.load(state_dict, config.hysteresis)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_watches"] = []  # hooks on someone's modules are not the scaler's state
        state["_last_loss"] = None  # a diagnostic of the running process, not state
        if self._enabled:
            if len(self._per_optimizer_states) != 0:
                raise ScalerStateError(
                    "A GradScaler instance may only be pickled at the beginning "
                    "of an iteration, or at the end after scaler.update().",
                    "pickle (or deepcopy) it before scale() or after update().",
                )
            # Tensors are turned into Python values and re-created lazily after unpickling.
            state["_state"] = self._state.host_copy()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("_warned_stuck", False)  # pickled by a mixprec without it
        self.__dict__.update(state)

    # ------------------------------------------------------------------ torch-internal hooks kept for parity
    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        dev = self._check_scale_growth_tracker("_check_inf_per_device")
        ones = torch.ones((), dtype=torch.float32, device=dev.scale.device)
        found = torch.zeros((), dtype=torch.float32, device=dev.scale.device)
        state = self._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = self._unscale_grads_(optimizer, ones, found, True, check_only=True)
        return state["found_inf_per_device"]

    def _record_clean(self, optimizer: torch.optim.Optimizer) -> None:
        """Record ``optimizer``'s check of this iteration as clean though it had no gradient to check (apex
        counts a loss that reaches no parameter as a clean iteration: the scale's growth goes on). For
        ``scale_loss`` only, before its ``update()``: the optimizer's stage is left as it is."""
        dev = self._check_scale_growth_tracker("unscale_")
        clean = torch.zeros((), dtype=torch.float32, device=dev.scale.device)
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = {dev.scale.device: clean}

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
