"""Mixed precision as Learner callbacks, each event one short method over the core parts (``GradScaler``,
``MasterWeights``, ``mixprec.autocast``): no numerics live here.

- :class:`LossScaling` -- the scaler's part: scale the loss, unscale (and clip) the gradients, update.
- :class:`MixedPrecision` -- fastai v1's ``to_fp16``: half model (BatchNorm fp32), fp32 master weights,
  loss scaling. apex's O2.
- :class:`AutocastMixedPrecision` -- fp32 weights, forward under a cast policy, loss scaling. apex's O1,
  fastai v2's ``MixedPrecision``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch

from mixprec.amp import DEFAULT_MAX_LOSS_SCALE, DYNAMIC, Properties
from mixprec.autocast import autocast, half_compute
from mixprec.callbacks.clip import check_max_norm, clip_master_grads
from mixprec.callbacks.core import Callback, positive_finite, positive_int, scaler_saw_step
from mixprec.errors import ConfigError
from mixprec.master import HALF_DTYPES, Converted, MasterWeights, fp32_originals, model_to_half
from mixprec.scaler import DEFAULT_GROWTH_INTERVAL, DEFAULT_INIT_SCALE, GradScaler, HasMasterGrads

__all__ = [
    "LossScaling",
    "MixedPrecision",
    "AutocastMixedPrecision",
    "DEFAULT_MAX_SCALE",
    "DEFAULT_MAX_NOSKIP",
    "mixprec_callback_for",
    "model_to_half",
    "model_to_float",
]

# fastai v1's to_fp16 defaults, with their reasons:
DEFAULT_MAX_NOSKIP = 1000  # clean steps before a dynamic scale doubles: overflow is rare once tuned
DEFAULT_MAX_SCALE = DEFAULT_MAX_LOSS_SCALE  # apex's ceiling too: beyond it a scaled 2**-24 would already be 1


# The scaling arguments in the user's words (to_fp16's names, not GradScaler's): checked when the callback
# is built, so a mistake is reported at the call that made it, not at the first batch. None always passes
# (it switches the feature off). name -> (check, what it must be, the fix)
_ARGUMENT_CHECKS: dict[str, tuple[Callable[[Any], bool], str, str]] = {
    "loss_scale": (positive_finite, "a positive, finite number", "e.g. loss_scale=512.0; None: no scaling"),
    "max_noskip": (positive_int, "an int >= 1", "e.g. max_noskip=1000 clean steps before growing"),
    "max_scale": (positive_finite, "a positive, finite number", "e.g. max_scale=2.**24; None: unbounded"),
    "min_scale": (positive_finite, "a positive, finite number", "e.g. min_scale=1.0; None: no floor"),
    "skip_limit": (positive_int, "an int >= 1", "e.g. skip_limit=50 skipped steps in a row"),
}


def check_scaling_arguments(**values: Any) -> None:
    """Raise :class:`~mixprec.errors.ConfigError` naming the first argument (by the caller's name) that is
    out of range."""
    for name, (check, expected, fix) in _ARGUMENT_CHECKS.items():
        value = values.get(name)
        if value is not None and not check(value):
            raise ConfigError(f"{name} must be {expected}, got {value!r}.", fix)
    check_max_norm("clip", values.get("clip"))
    low, high = values.get("min_scale"), values.get("max_scale")
    if low is not None and high is not None and low > high:
        raise ConfigError(f"min_scale={low!r} is larger than max_scale={high!r}.", "swap them, or drop one.")


class LossScaling(Callback):
    """Loss scaling with a :class:`~mixprec.scaler.GradScaler`: make the scaler (``learn.scaler``, which the
    learner's step goes through: it skips on inf/NaN), scale the loss, unscale the gradients (into the fp32
    masters), clip them when ``clip`` is set, update the scale.

    ``loss_scale=None`` turns scaling off (``GradScaler(enabled=False)``: every call a pass-through).
    """

    # Late: the loss is scaled after other callbacks changed it; callbacks ordered after this one see the
    # gradients unscaled (in the fp32 masters), those before it see them scaled, as backward left them.
    order = 100

    def __init__(
        self,
        loss_scale: float | None,
        dynamic: bool = True,
        max_noskip: int = DEFAULT_MAX_NOSKIP,
        max_scale: float | None = DEFAULT_MAX_SCALE,
        clip: float | None = None,
        allow_fp16_grads: bool = False,
        *,
        min_scale: float | None = None,
        skip_limit: int | None = None,
    ) -> None:
        check_scaling_arguments(loss_scale=loss_scale, max_noskip=max_noskip, max_scale=max_scale,
                                min_scale=min_scale, clip=clip, skip_limit=skip_limit)
        self.loss_scale, self.dynamic, self.max_noskip = loss_scale, dynamic, max_noskip
        self.max_scale, self.min_scale, self.skip_limit = max_scale, min_scale, skip_limit
        self.clip, self.allow_fp16_grads = clip, allow_fp16_grads
        self.scaler: GradScaler | None = None

    def _make_scaler(self) -> GradScaler:
        device = next(self.learn.model.parameters()).device.type
        return GradScaler(
            device,
            init_scale=self.loss_scale if self.loss_scale is not None else 1.0,
            growth_interval=self.max_noskip,
            enabled=self.loss_scale is not None,
            dynamic=self.dynamic,
            max_scale=self.max_scale if self.dynamic else None,
            min_scale=self.min_scale if self.dynamic else None,
            skip_limit=self.skip_limit,
            allow_fp16_grads=self.allow_fp16_grads,
            # the Recorder reads an epoch's scales from this ring buffer once per epoch: it must hold them all
            history_size=max(1, len(self.data.train)),
        )

    def _start_scaling(self) -> None:
        self.learn.scaler = self.scaler = self._make_scaler()

    def on_backward_begin(self) -> None:
        self.learn.loss_grad = self.scaler.scale(self.loss_grad)

    def on_backward_end(self) -> None:
        # Unscale here, not inside the learner's scaler.step(opt): callbacks after this one (and clipping)
        # see the true fp32 gradients where the optimizer reads them. unscale_ copies the half gradients to
        # the fp32 masters, divides by the scale and records inf/NaN on the device: no sync. The step then
        # skips on that record (on the device for a fused optimizer).
        if self.scaler.is_enabled():
            self.scaler.unscale_(self.opt)
        elif isinstance(self.opt, HasMasterGrads):
            self.opt.copy_grads_to_master()  # no scaler to do it (bf16): same contract for later callbacks
        if self.clip is not None:
            clip_master_grads(self.opt, self.clip)

    def on_step_end(self) -> None:
        # An earlier callback may have cancelled the step before the scaler saw it: nothing to update.
        if scaler_saw_step(self.scaler, self.opt):
            self.scaler.update()  # back off after an overflow, grow after max_noskip clean steps


def model_to_float(converted: list[Converted], masters: MasterWeights | None) -> None:
    """Undo :func:`model_to_half`; parameters with an fp32 master take the master's value, not the
    rounded half value (so leaving mixed precision loses nothing the optimizer accumulated)."""
    values = {}
    if masters is not None:
        values = {id(p): m for p, m in zip(masters.model_params(), masters.master_views(), strict=True)}
    with torch.no_grad():
        for c in converted:
            tensor = getattr(c.module, c.name)
            if c.is_param:
                master = values.get(id(tensor), tensor)
                tensor.data = master.detach().to(c.dtype, copy=True)
                tensor.grad = None
            else:
                setattr(c.module, c.name, tensor.to(c.dtype))


class MixedPrecision(LossScaling):
    """fastai v1's mixed precision training: a half model, fp32 master weights, loss scaling (apex O2).

    Events: on_train_begin -- model to ``dtype`` with BatchNorm kept fp32, fp32 masters of the half
    parameters (from the fp32 values, not their rounding); on_batch_begin -- inputs to ``dtype``;
    forward under ``mixprec.autocast.half_compute`` (fp16 GEMMs as a tensor core computes them, on a CPU
    too); on_loss_begin -- output to fp32, so the loss and its reductions run
    in fp32; on_backward_begin -- scale the loss; on_backward_end -- gradients to the masters, unscaled and
    checked (no sync), clipped with ``clip``; the learner's step is ``scaler.step(masters)``: skipped on
    inf/NaN, else the masters updated and copied back into the model
    (``MasterWeights.step``); the loop zeroes both gradients; on_step_end -- update
    the scale; on_train_end -- the model back to fp32, holding the masters' values.

    Args:
        dtype: torch.float16 or torch.bfloat16.
        loss_scale: the initial (dynamic) or fixed (static) loss scale; None: no loss scaling (bf16 has
            fp32's range and needs none).
        flat_master: one contiguous fp32 master buffer per param group (one long optimizer kernel).
        dynamic: adjust the scale: halve it on overflow, double it after ``max_noskip`` clean steps.
        max_noskip: clean steps before the scale doubles.
        clip: clip the masters' gradient norm to this, after unscaling.
        max_scale: the dynamic scale never grows beyond this.
        loss_fp32: compute the loss from an fp32 copy of the output.
        master_weights: False lets the optimizer update the half parameters themselves (apex O3; the
            "naive fp16" rung of ``mixprec compare``): updates below half an ulp of a weight are lost.
        keep_bn_fp32: keep BatchNorm parameters and statistics in fp32.
        min_scale: the dynamic scale never falls below this.
        skip_limit: stop with ``PersistentOverflowError`` after this many consecutive skipped steps.
    """

    def __init__(
        self,
        dtype: torch.dtype = torch.float16,
        loss_scale: float | None = 512.0,
        flat_master: bool = False,
        dynamic: bool = True,
        max_noskip: int = DEFAULT_MAX_NOSKIP,
        clip: float | None = None,
        max_scale: float | None = DEFAULT_MAX_SCALE,
        loss_fp32: bool = True,
        master_weights: bool = True,
        keep_bn_fp32: bool = True,
        *,
        min_scale: float | None = None,
        skip_limit: int | None = None,
    ) -> None:
        if dtype not in HALF_DTYPES:
            raise ConfigError(
                f"MixedPrecision trains in half precision; dtype={dtype} is not one.",
                "use dtype=torch.float16 or torch.bfloat16 (for fp32, remove the callback: learn.to_fp32()).",
            )
        fp16_grads = not master_weights  # without masters the scaler unscales the half gradients in place
        super().__init__(loss_scale, dynamic, max_noskip, max_scale, clip, allow_fp16_grads=fp16_grads,
                         min_scale=min_scale, skip_limit=skip_limit)
        self.dtype, self.flat_master, self.loss_fp32 = dtype, flat_master, loss_fp32
        self.master_weights, self.keep_bn_fp32 = master_weights, keep_bn_fp32
        self.converted: list[Converted] = []
        self.masters: MasterWeights | None = None
        self.forward = ExitStack()

    def on_train_begin(self) -> None:
        self.converted = model_to_half(self.learn.model, self.dtype, self.keep_bn_fp32)
        if self.master_weights:
            self.learn.opt = self.masters = MasterWeights(
                self.learn.opt, flat=self.flat_master, model=self.learn.model,
                initial=fp32_originals(self.converted),  # the fp32 values, not their rounding
            )
        self._start_scaling()

    def on_batch_begin(self) -> None:
        if self.xb.is_floating_point():
            self.learn.xb = self.xb.to(self.dtype)
        self.forward.enter_context(half_compute(self.xb.device.type, self.dtype))

    def on_loss_begin(self) -> None:
        self.forward.close()
        if self.loss_fp32:
            self.learn.pred = self.pred.float()  # reductions (log-softmax, mean) in fp32

    def on_train_end(self) -> None:
        self.forward.close()
        model_to_float(self.converted, self.masters)
        self.converted, self.masters = [], None

    def __repr__(self) -> str:
        scaling = "off" if self.loss_scale is None else f"{'dynamic' if self.dynamic else 'static'} "
        scaling += "" if self.loss_scale is None else f"{self.loss_scale:g}"
        return (
            f"MixedPrecision({self.dtype}, loss scale {scaling}, master_weights={self.master_weights}, "
            f"flat_master={self.flat_master})"
        )


class AutocastMixedPrecision(LossScaling):
    """fp32 weights; the forward runs under ``mixprec.autocast`` (a per-op cast policy); loss scaling
    (apex O1; fastai v2's MixedPrecision). No master copies: the weights are fp32 already.

    Args: ``dtype`` and ``policy`` as ``mixprec.autocast``; ``loss_scale`` (None: off) and the rest as
    :class:`MixedPrecision`. The default starts dynamic scaling at 2**16, as torch.amp and apex do.
    """

    def __init__(
        self,
        dtype: torch.dtype = torch.float16,
        loss_scale: float | None = DEFAULT_INIT_SCALE,
        dynamic: bool = True,
        max_noskip: int = DEFAULT_GROWTH_INTERVAL,
        clip: float | None = None,
        policy: Any = None,
    ) -> None:
        super().__init__(loss_scale, dynamic, max_noskip, None, clip)
        self.dtype, self.policy = dtype, policy
        self.forward = ExitStack()

    def on_train_begin(self) -> None:
        self._start_scaling()

    def on_batch_begin(self) -> None:
        self.forward.enter_context(autocast(self.xb.device.type, self.dtype, policy=self.policy))

    def on_loss_begin(self) -> None:
        self.forward.close()
        self.learn.pred = self.pred.float()  # the loss outside the region, in fp32

    def on_train_end(self) -> None:
        self.forward.close()


def mixprec_callback_for(props: Properties, flat_master: bool = False) -> LossScaling | None:
    """The learner callback that trains as an apex opt level does (``mixprec.amp.OPT_LEVELS[level]``, or
    ``initialize``'s resolved properties): None for fp32 (O0), :class:`AutocastMixedPrecision` for a cast
    policy over fp32 weights (O1), :class:`MixedPrecision` for a half model, with or without fp32 masters
    and BatchNorm in fp32 as the properties say (O2, O3). Dynamic scaling as ``mixprec.initialize``:
    start at 2**16, grow after 2000 clean steps, at most 2**24.

    ``flat_master``: one flat fp32 master buffer; only for properties with master weights."""
    if flat_master and not props.master_weights:
        raise ConfigError(
            f"flat_master=True, but opt level {props.opt_level} keeps no fp32 master weights.",
            "use opt level O2 (fp32 masters), or drop flat_master.",
        )
    dynamic = props.loss_scale == DYNAMIC
    scale = DEFAULT_INIT_SCALE if dynamic else float(props.loss_scale)
    if props.patch_torch_functions:
        return AutocastMixedPrecision(props.half_dtype, scale, dynamic, DEFAULT_GROWTH_INTERVAL)
    if not props.enabled or props.cast_model_type not in HALF_DTYPES:
        return None
    return MixedPrecision(
        props.cast_model_type, scale, flat_master, dynamic, DEFAULT_GROWTH_INTERVAL,
        max_scale=DEFAULT_MAX_LOSS_SCALE, master_weights=bool(props.master_weights),
        keep_bn_fp32=bool(props.keep_batchnorm_fp32),
    )


