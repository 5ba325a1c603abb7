"""Mixed precision as a Learner callback: a :class:`~mixprec.recipe.Recipe` says which dtype each part of
the step uses; :func:`mixprec.half_model.prepare` casts the model and hooks its forward (inputs to half,
the forward in the recipe's precision region, outputs to fp32); the recipe's ``GradScaler`` scales the
loss; ``MasterWeights`` holds the fp32 masters. One short method per event; no numerics live here.

- :class:`MixedPrecision` -- any half recipe. Its arguments are fastai v1's ``to_fp16``: half model
  (BatchNorm fp32), fp32 master weights, loss scaling (apex O2); ``recipe=`` takes any other, e.g.
  ``Recipe.from_opt_level("O3")``.
- :class:`AutocastMixedPrecision` -- fp32 weights, the forward under a cast policy, loss scaling (apex O1,
  fastai v2's ``MixedPrecision``): the same callback over an O1 recipe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from mixprec.amp import check_split_params, split_master_values, split_masters_of
from mixprec.apex_properties import Properties
from mixprec.callbacks.clip import check_max_norm, clip_master_grads
from mixprec.callbacks.core import Callback, positive_finite, positive_int, scaler_saw_step
from mixprec.errors import ConfigError
from mixprec.half_model import HalfModel, model_to_float, model_to_half, prepare, warn_if_inputs_lost
from mixprec.hardware import HALF_DTYPES
from mixprec.low_precision import LowPrecisionOptimizer
from mixprec.master import MasterWeights
from mixprec.recipe import APEX_MAX_LOSS_SCALE, FASTAI_MAX_NOSKIP, Recipe, ScaleConfig
from mixprec.scaler import DEFAULT_GROWTH_INTERVAL, DEFAULT_INIT_SCALE, GradScaler, HasMasterGrads
from mixprec.skip_step import BufferWatch
from mixprec.split_state_dict import hook_split_state_dict
from mixprec.tree import cast_floating

__all__ = [
    "MixedPrecision",
    "AutocastMixedPrecision",
    "LossScaling",
    "callback_for",
    "mixprec_callback_for",
    "fastai_recipe",
    "check_scaling_arguments",
    "DEFAULT_MAX_SCALE",
    "DEFAULT_MAX_NOSKIP",
    "model_to_half",
    "model_to_float",
]

# Old names of the fastai defaults, kept for code that imported them from here (the values and their
# reasons live in mixprec.recipe).
DEFAULT_MAX_NOSKIP = FASTAI_MAX_NOSKIP
DEFAULT_MAX_SCALE = APEX_MAX_LOSS_SCALE

# The scaling arguments in the user's words (to_fp16's names; the Recipe's ScaleConfig would name
# GradScaler's): checked when the callback is built, so a mistake is reported at the call that made it.
# None always passes (loss_scale: fastai's start; the others: the feature off, or min_scale's default floor
# of 1). name -> (check, what it must be, the fix)
_ARGUMENT_CHECKS: dict[str, tuple[Callable[[Any], bool], str, str]] = {
    "loss_scale": (positive_finite, "a positive, finite number",
                   "e.g. loss_scale=512.0: where the dynamic scale starts, or the static scale with "
                   "dynamic=False (apex's loss_scale='dynamic' is dynamic=True here, the default)"),
    "max_noskip": (positive_int, "an int >= 1", "e.g. max_noskip=1000 clean steps before growing"),
    "max_scale": (positive_finite, "a positive, finite number", "e.g. max_scale=2.**24; None: unbounded"),
    "min_scale": (positive_finite, "a positive, finite number", "e.g. min_scale=2.**-4; None: the floor 1.0"),
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


class MixedPrecision(Callback):
    """Train with a half-precision :class:`~mixprec.recipe.Recipe` (by default fastai v1's ``to_fp16``).

    Events: on_train_begin -- :func:`~mixprec.half_model.prepare` the model (cast with BatchNorm fp32,
    forward hooked: inputs to half, the forward under ``half_compute`` or ``autocast``, outputs to fp32),
    fp32 masters seeded from the fp32 values (not their rounding), the recipe's scaler as ``learn.scaler``
    (the learner's step goes through it: skipped on inf/NaN); on_batch_begin -- ``xb`` to the model's
    dtype, so callbacks see what the model computes on; on_backward_begin -- scale the loss;
    on_backward_end -- gradients unscaled into the masters and checked (no sync), clipped with ``clip``;
    on_step_end -- update the scale (a skipped step's BatchNorm statistics put back, no sync);
    on_train_end -- the model back to fp32, holding the masters' values.

    Args (fastai v1's ``MixedPrecision``, in its order, ``dtype`` where fastai has ``learn``; mixprec's
    ``master_weights`` and ``keep_bn_fp32`` follow; ignored when ``recipe`` is given):
        dtype: torch.float16 or torch.bfloat16.
        loss_scale: the initial (dynamic) or fixed (static) loss scale (fp16 only: bf16 has fp32's range
            and needs none); None: fastai's rule, 2**16 dynamic, 512 static. For fp16 without loss scaling
            pass a ``recipe`` whose ``scale`` is None.
        max_noskip: clean steps before a dynamic scale doubles.
        dynamic: halve the scale on overflow, double it after ``max_noskip`` clean steps.
        clip: clip the masters' gradient norm to this, after unscaling (also with ``recipe``): one norm
            over all of them, as torch and apex clip (fastai v1 clipped each parameter group on its own).
        flat_master: one contiguous fp32 master buffer per param group (one long optimizer kernel).
        max_scale, min_scale: the dynamic scale's bounds.
        loss_fp32: compute the loss from an fp32 copy of the output.
        master_weights: False lets the optimizer update the half parameters themselves (apex O3): updates
            below half an ulp of a weight are lost.
        keep_bn_fp32: keep BatchNorm parameters and statistics in fp32.
        skip_limit: stop with ``PersistentOverflowError`` after this many consecutive skipped steps.
        recipe: train with this recipe instead (any with a half dtype).
    """

    # Late: the loss is scaled after other callbacks changed it; callbacks ordered after this one see the
    # gradients unscaled (in the fp32 masters), those before it see them scaled, as backward left them.
    order = 100

    def __init__(
        self,
        dtype: torch.dtype = torch.float16,
        loss_scale: float | None = None,
        max_noskip: int = FASTAI_MAX_NOSKIP,
        dynamic: bool = True,
        clip: float | None = None,
        flat_master: bool = False,
        max_scale: float | None = APEX_MAX_LOSS_SCALE,
        loss_fp32: bool = True,
        master_weights: bool = True,
        keep_bn_fp32: bool = True,
        *,
        min_scale: float | None = None,
        skip_limit: int | None = None,
        recipe: Recipe | None = None,
    ) -> None:
        check_max_norm("clip", clip)
        if hasattr(dtype, "fit"):  # fastai v1's MixedPrecision(learn, ...): the Learner came first there
            raise ConfigError(
                "MixedPrecision got a Learner as its first argument (fastai v1's order: "
                "MixedPrecision(learn, ...)); mixprec's callback takes the dtype first and is given to a "
                "Learner.",
                "call learn.to_fp16() (or learn.to_bf16()), or learn.add_cb(MixedPrecision(torch.float16)).",
            )
        if recipe is None:
            recipe = fastai_recipe(dtype, loss_scale, max_noskip, dynamic, flat_master, max_scale, loss_fp32,
                                   min_scale=min_scale, skip_limit=skip_limit)
            recipe = recipe.replace(master_weights=master_weights, keep_batchnorm_fp32=keep_bn_fp32)
        if recipe.is_fp32:
            raise ConfigError(
                f"MixedPrecision trains in half precision; recipe {recipe.name!r} is fp32.",
                "use a half recipe (e.g. Recipe.from_opt_level('O2')), or no callback: learn.to_fp32().",
            )
        self.recipe, self.clip = recipe, clip
        self.half: HalfModel | None = None
        self.masters: MasterWeights | None = None
        self.split: LowPrecisionOptimizer | None = None  # the recipe's split_masters, instead of masters
        self.scaler: GradScaler | None = None
        self.watch: BufferWatch | None = None
        self.inputs_checked = False  # the fit's first batch was looked at (warn_if_inputs_lost)

    # ---- the recipe's settings under their old attribute names
    dtype = property(lambda self: self.recipe.half_dtype)
    flat_master = property(lambda self: self.recipe.flat_master)
    master_weights = property(lambda self: self.recipe.uses_masters)
    keep_bn_fp32 = property(lambda self: self.recipe.keep_batchnorm_fp32)
    loss_fp32 = property(lambda self: self.recipe.loss_fp32)
    loss_scale = property(lambda self: getattr(self.recipe.scale, "init_scale", None))
    dynamic = property(lambda self: self.recipe.scale is not None and self.recipe.scale.dynamic)
    max_noskip = property(lambda self: getattr(self.recipe.scale, "growth_interval", None))

    def on_train_begin(self) -> None:
        device = self.learn.device.type
        self.split = None
        self.inputs_checked = False
        if self.recipe.split_masters:
            check_split_params([self.learn.model], [self.learn.opt], self.recipe)  # before the cast
        # What the fit's end can give back exactly without a kept fp32 original: parameters with a master
        # (every one the optimizer holds, when the recipe keeps masters), and without masters those it
        # trains (the others, frozen, would otherwise come back rounded). The rest's originals are kept.
        held = [p for g in self.learn.opt.param_groups for p in g["params"]]
        trained = held if self.recipe.uses_masters else [p for p in held if p.requires_grad]  # split: O2's
        self.half = prepare(self.learn.model, self.recipe, device)
        if self.recipe.split_masters:
            self.learn.opt = self.split = split_masters_of(self.learn.opt, self.half.fp32_originals())
            # as initialize: mid-fit, model.state_dict() holds the exact masters and a load sets both
            # halves (a best epoch's weights saved and loaded back by a callback); removed by restore
            self.half.handles += hook_split_state_dict(self.learn.model, self.split)
        elif self.recipe.uses_masters:
            self.learn.opt = self.masters = MasterWeights(
                self.learn.opt, flat=self.recipe.flat_master, model=self.learn.model,
                initial=self.half.fp32_originals(),  # the fp32 values, not their rounding
                mirror_grads=False,  # `clip` clips the fp32 masters; model grads stay as backward left them
                master_grads=self.recipe.master_grads, compile_step=self.recipe.compile_step,
            )
        self.half.release_originals(keep_untrained=trained)
        # history_size: the Recorder reads an epoch's scales from this ring buffer once per epoch
        history = max(1, len(self.data.train))
        self.learn.scaler = self.scaler = self.recipe.make_scaler(device, history_size=history)
        # A skipped step leaves BatchNorm's running statistics as they were too (restored in update(), on
        # the device: no sync); without it one NaN batch poisons them for the rest of the run.
        self.watch = self.scaler.watch(self.learn.model) if self.scaler.is_enabled() else None

    def on_batch_begin(self) -> None:
        if self.recipe.casts_model and self.recipe.cast_inputs:  # as the forward hook would: no double cast
            cast = cast_floating(self.xb, self.recipe.model_dtype)
            if not self.inputs_checked:  # the first batch, as the hook checks its first call's inputs
                self.inputs_checked = True
                warn_if_inputs_lost(tree_leaves(self.xb), tree_leaves(cast), self.recipe.model_dtype)
            self.learn.xb = cast

    def on_backward_begin(self) -> None:
        self.learn.loss_grad = self.scaler.scale(self.loss_grad)

    def on_backward_end(self) -> None:
        # Unscale here, not inside the learner's scaler.step(opt): callbacks after this one (and clipping)
        # see the true fp32 gradients where the optimizer reads them. unscale_ copies the half gradients to
        # the fp32 masters, divides by the scale and records inf/NaN on the device: no sync.
        if self.scaler.is_enabled():
            self.scaler.unscale_(self.opt)
        elif isinstance(self.opt, HasMasterGrads):
            self.opt.copy_grads_to_master()  # no scaler to do it (bf16): same contract for later callbacks
        if self.clip is not None:
            clip_master_grads(self.opt, self.clip)

    def on_step_end(self) -> None:
        if scaler_saw_step(self.scaler, self.opt):  # not when an earlier callback cancelled the step
            self.scaler.update()
        elif self.watch is not None:
            self.watch.arm()  # no update to re-arm it: snapshot again at the next iteration

    def on_train_end(self) -> None:
        if self.watch is not None:
            self.watch.remove()
        if self.half is not None:  # None: an earlier callback's on_train_begin failed before ours ran
            mine = set(self.learn.model.parameters())
            split = {} if self.split is None else split_master_values(self.split, mine)
            self.half.restore(self.masters, values=split)
        # all of this fit's: a later fit refused before it wraps anew must not restore through them
        self.half = self.masters = self.split = self.watch = None

    def __repr__(self) -> str:
        # the description is the preset's words; a recipe replace()d from it says what it changed here
        extras = [words for field, words in _LAYOUT_WORDS if getattr(self.recipe, field)]
        shown = " ".join([self.recipe.description, *extras])
        return f"{type(self).__name__}({self.recipe.name}: {shown})"


# Recipe switches that change where the masters live, and how MixedPrecision's repr names them.
_LAYOUT_WORDS: tuple[tuple[str, str], ...] = (
    ("split_masters", "Masters split: each fp32 master held as its bf16 weight plus an int16 low half."),
    ("flat_master", "Masters flat: one fp32 buffer per param group."),
    ("compile_step", "Master step compiled into one pass."),
)


LossScaling = MixedPrecision  # the old base class's name: isinstance checks keep working


class AutocastMixedPrecision(MixedPrecision):
    """fp32 weights; the forward runs under ``mixprec.autocast`` (a per-op cast policy); loss scaling
    (apex O1; fastai v2's MixedPrecision): :class:`MixedPrecision` over ``Recipe.from_opt_level("O1")``.
    No master copies: the weights are fp32 already. The default starts dynamic scaling at 2**16, as
    torch.amp and apex do."""

    def __init__(
        self,
        dtype: torch.dtype = torch.float16,
        loss_scale: float | None = DEFAULT_INIT_SCALE,
        dynamic: bool = True,
        max_noskip: int = DEFAULT_GROWTH_INTERVAL,
        clip: float | None = None,
        policy: Any = None,
        *,
        recipe: Recipe | None = None,
    ) -> None:
        if recipe is None:
            check_scaling_arguments(loss_scale=loss_scale, max_noskip=max_noskip)
            scale = (None if loss_scale is None
                     else ScaleConfig(init_scale=loss_scale, dynamic=dynamic, growth_interval=max_noskip))
            recipe = Recipe.from_opt_level("O1", dtype).replace(policy=policy, scale=scale)
        super().__init__(clip=clip, recipe=recipe)


def fastai_recipe(
    dtype: torch.dtype = torch.float16,
    loss_scale: float | None = None,
    max_noskip: int = FASTAI_MAX_NOSKIP,
    dynamic: bool = True,
    flat_master: bool = False,
    max_scale: float | None = APEX_MAX_LOSS_SCALE,
    loss_fp32: bool = True,
    *,
    min_scale: float | None = None,
    skip_limit: int | None = None,
) -> Recipe:
    """:meth:`Recipe.fastai <mixprec.recipe.Recipe.fastai>` (its arguments in fastai v1's order, without
    ``clip``, a callback setting), with every argument checked first and named as the caller passed it (the
    Recipe would name GradScaler's)."""
    flags = {"dynamic": dynamic, "flat_master": flat_master, "loss_fp32": loss_fp32}
    for name, value in flags.items():
        if not isinstance(value, bool):  # a number here is an argument one place off
            raise ConfigError(f"{name} must be True or False, got {value!r}.",
                              f"pass {name}= by keyword (fastai v1's order: loss_scale, max_noskip, dynamic, "
                              "clip, flat_master, max_scale, loss_fp32).")  # fmt: skip
    if dtype not in HALF_DTYPES:
        raise ConfigError(
            f"MixedPrecision trains in half precision; dtype={dtype} is not one.",
            "use dtype=torch.float16 or torch.bfloat16 (for fp32, remove the callback: learn.to_fp32()).",
        )
    check_scaling_arguments(loss_scale=loss_scale, max_noskip=max_noskip, max_scale=max_scale,
                            min_scale=min_scale, skip_limit=skip_limit)  # fmt: skip
    extras = {k: v for k, v in (("min_scale", min_scale), ("skip_limit", skip_limit)) if v is not None}
    # None: fastai v1's rule, its default (Recipe.fastai). None meant "no scaling" here once: an explicit None
    # from fastai code then trained fp16 unscaled, with no inf/NaN check.
    return Recipe.fastai(dtype, loss_scale, max_noskip, dynamic, flat_master, max_scale, loss_fp32, **extras)


def callback_for(recipe: Recipe, clip: float | None = None) -> MixedPrecision | None:
    """The learner callback that trains as ``recipe`` does: None for an fp32 recipe,
    :class:`AutocastMixedPrecision` for a cast policy over fp32 weights, else :class:`MixedPrecision`."""
    if recipe.is_fp32:
        return None
    kind = AutocastMixedPrecision if recipe.autocast_dtype is not None else MixedPrecision
    return kind(clip=clip, recipe=recipe)


def mixprec_callback_for(props: Properties | Recipe, flat_master: bool = False) -> MixedPrecision | None:
    """:func:`callback_for` an apex opt level's properties (``mixprec.amp.OPT_LEVELS[level]``), kept under
    its old name; ``flat_master``: one flat fp32 master buffer (only for recipes with masters)."""
    recipe = props.recipe if isinstance(props, Properties) else props
    if flat_master:
        recipe = recipe.replace(flat_master=True)  # the Recipe refuses it without masters
    return callback_for(recipe)
