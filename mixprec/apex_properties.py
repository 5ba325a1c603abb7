"""apex.amp's vocabulary for a :class:`~mixprec.recipe.Recipe`: its four opt levels and its property
overrides, with apex's documented rules for which overrides it accepted.

======  ===============  =====================  ===================  ==============  ===========
level   cast_model_type  patch_torch_functions  keep_batchnorm_fp32  master_weights  loss_scale
======  ===============  =====================  ===================  ==============  ===========
O0      float32          False                  None                 False           1.0
O1      None             True                   None                 None            "dynamic"
O2      half             False                  True                 True            "dynamic"
O3      half             False                  False                False           1.0
======  ===============  =====================  ===================  ==============  ===========

apex let any property be overridden at any level and refused (RuntimeError) only four combinations, all
about O1, whose weights stay fp32 while casts are inserted around functions: ``cast_model_type`` other than
None/False/float32, ``keep_batchnorm_fp32`` or ``master_weights`` other than None at O1, and
``patch_torch_functions=True`` at any level but O1. ``keep_batchnorm_fp32`` also took the strings "True" and
"False"; ``loss_scale`` took "dynamic" or anything ``float()`` takes. We follow those rules; where an accepted
combination does nothing useful we say so with a warning.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from mixprec.errors import ApexPropertyError, ConfigError
from mixprec.hardware import HALF_DTYPES
from mixprec.recipe import APEX_MAX_LOSS_SCALE, Recipe, ScaleConfig
from mixprec.recipe import OPT_LEVELS as _RECIPES
from mixprec.scale_state import DEFAULT_INIT_SCALE

__all__ = ["Properties", "OPT_LEVELS", "apply_overrides", "banner", "DYNAMIC"]

DYNAMIC = "dynamic"


def _bn_flag(value: Any) -> bool | None:
    table = {"True": True, "False": False, True: True, False: False, None: None}
    if isinstance(value, str | bool) or value is None:
        if value in table:
            return table[value]
    raise ApexPropertyError(
        f"keep_batchnorm_fp32 must be a boolean, the string 'True' or 'False', or None, got {value!r}.",
        "pass keep_batchnorm_fp32=True (BatchNorm stays fp32) or False.",
    )


def _loss_scale(value: Any) -> float | str:
    if value == DYNAMIC:
        return DYNAMIC
    try:
        scale = float(value)
    except (TypeError, ValueError):
        scale = float("nan")
    if not scale > 0 or scale == float("inf"):
        raise ConfigError(
            f"loss_scale must be 'dynamic' or a positive finite number, got {value!r}.",
            "pass loss_scale='dynamic' or e.g. loss_scale=128.0.",
        )
    return scale


# apex's four refusals (its warn_or_err raised RuntimeError unless hard_override was set): when each
# applies, and why it makes no sense.
_REFUSED: dict[str, tuple[Any, str]] = {
    "cast_model_type": (lambda level, v: level == "O1" and v not in (None, False, torch.float32),
                        "O1 casts per op and keeps the weights fp32; casting the model contradicts it"),
    "keep_batchnorm_fp32": (lambda level, v: level == "O1" and v is not None,
                            "keep_batchnorm_fp32 only applies when the model is cast to half precision"),
    "master_weights": (lambda level, v: level == "O1" and v is not None,
                       "O1's weights stay fp32, so they already are the master weights"),
    "patch_torch_functions": (lambda level, v: level != "O1" and bool(v),
                              "per-op casts (O1) together with a half model contradicts itself"),
}  # fmt: skip


def _check_refused(opt_level: str, name: str, value: Any) -> None:
    refused, reason = _REFUSED.get(name, (lambda level, v: False, ""))
    if refused(opt_level, value):
        fix = (
            "use opt_level='O2' or 'O3' for a half model, or drop the override."
            if opt_level == "O1"
            else "use opt_level='O1' for per-op casts over fp32 weights."
        )
        problem = f"{name}={value!r} at opt_level {opt_level}: {reason} (apex refused it too)."
        raise ApexPropertyError(problem, fix)


def apply_overrides(
    recipe: Recipe,
    *,
    min_loss_scale: float | None = None,
    max_loss_scale: float = APEX_MAX_LOSS_SCALE,
    **overrides: Any,
) -> Recipe:
    """``recipe`` (an opt level's) with apex's property overrides applied; None means "not overridden".
    ``min_loss_scale``/``max_loss_scale`` bound a dynamic scale, as apex's ``initialize`` arguments."""
    unknown = set(overrides) - set(_FIELDS)
    if unknown:
        raise ConfigError(f"unknown apex properties: {sorted(unknown)}.",
                          f"use any of: {', '.join(_FIELDS)}.")  # fmt: skip
    props = Properties.of(recipe).as_dict()
    for name, value in overrides.items():
        if value is not None:
            _check_refused(recipe.name, name, value)
            props[name] = value
    cast = props["cast_model_type"]
    model_dtype = cast if isinstance(cast, torch.dtype) else torch.float32  # None/False: the model stays
    master = bool(props["master_weights"])
    if master and model_dtype not in HALF_DTYPES:
        warnings.warn(f"{recipe.name}: master_weights=True with fp32 weights does nothing: they are the "
                      "masters already.", stacklevel=3)  # fmt: skip
    loss_scale = _loss_scale(props["loss_scale"])
    # apex starts a dynamic scale at min(max_loss_scale, 2**16): a lower ceiling caps the start too
    start = min(max_loss_scale, DEFAULT_INIT_SCALE)
    scale = (ScaleConfig(max_scale=max_loss_scale, min_scale=min_loss_scale, init_scale=start)
             if loss_scale == DYNAMIC
             else ScaleConfig.static(float(loss_scale)))  # fmt: skip
    keep_bn = _bn_flag(props["keep_batchnorm_fp32"])
    return recipe.replace(
        model_dtype=model_dtype,
        keep_batchnorm_fp32=bool(keep_bn) if model_dtype in HALF_DTYPES else True,
        master_weights=master,
        autocast_dtype=(recipe.half_dtype or torch.float16) if props["patch_torch_functions"] else None,
        scale=scale,
    )


_FIELDS = ("cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32", "master_weights", "loss_scale")


@dataclass(frozen=True)
class Properties:
    """A recipe as apex named it: its five properties (``None``: "not applicable at this level"). A view
    of the :class:`~mixprec.recipe.Recipe` it was made from, which stays the one source of truth."""

    opt_level: str
    description: str
    cast_model_type: torch.dtype | None
    patch_torch_functions: bool
    keep_batchnorm_fp32: bool | None
    master_weights: bool | None
    loss_scale: float | str
    recipe: Recipe = field(repr=False, compare=False)
    enabled: bool = True

    @classmethod
    def of(cls, recipe: Recipe) -> Properties:
        half, o0 = recipe.casts_model, recipe.name == "O0"
        scale = recipe.scale
        return cls(
            opt_level=recipe.name,
            description=recipe.description,
            cast_model_type=recipe.model_dtype if half or o0 else None,
            patch_torch_functions=recipe.autocast_dtype is not None,
            keep_batchnorm_fp32=recipe.keep_batchnorm_fp32 if half else None,
            master_weights=recipe.master_weights if half or o0 else None,
            loss_scale=1.0 if scale is None else (DYNAMIC if scale.dynamic else scale.init_scale),
            recipe=recipe,
        )

    @property
    def half_dtype(self) -> torch.dtype:
        return self.recipe.half_dtype or torch.float16

    @property
    def casts_model(self) -> bool:
        return self.recipe.casts_model

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _FIELDS}

    def with_dtype(self, dtype: torch.dtype) -> Properties:
        return Properties.of(self.recipe.with_half_dtype(dtype))

    def overridden(self, **overrides: Any) -> Properties:
        return Properties.of(apply_overrides(self.recipe, **overrides))


def banner(recipe: Recipe, verbosity: int) -> list[str]:
    """What ``initialize`` prints: at verbosity 1 one line (apex's heading and its five properties), at 2
    apex's property list line by line, at 0 nothing."""
    if verbosity <= 0:
        return []
    props = Properties.of(recipe).as_dict()
    heading = f"Selected optimization level {recipe.name}: {recipe.description}"
    if recipe.half_dtype == torch.bfloat16 and "BF16" not in heading:  # O1's text names no dtype (apex: fp16)
        heading += " Casts to bf16."
    # mixprec's own master-step options, said only when set: an apex user's output stays apex's
    extras = [f"{k}={getattr(recipe, k)}" for k in ("master_grads", "compile_step", "split_masters")
              if getattr(recipe, k) != _DEFAULTS[k]]
    # split masters are still fp32 masters (apex's master_weights=True above), held in two halves: say so,
    # a user trial read "FP32 master weights" and "split_masters=True" as a contradiction
    held = " (the fp32 masters held as the bf16 weights + int16 low halves)" if recipe.split_masters else ""
    tail = ["mixprec master step: " + ", ".join(extras) + held] if extras else []
    if verbosity == 1:
        return [heading + " (" + ", ".join(f"{k}={v}" for k, v in props.items()) + ")", *tail]
    return [heading, *(f"{k:<22} : {v}" for k, v in props.items()), *tail]


_DEFAULTS = {f.name: f.default for f in fields(Recipe)}  # what banner() leaves unsaid


# apex's table, level by level (fp16): the recipes of mixprec.recipe.OPT_LEVELS in apex's names.
OPT_LEVELS: dict[str, Properties] = {level: Properties.of(recipe) for level, recipe in _RECIPES.items()}
