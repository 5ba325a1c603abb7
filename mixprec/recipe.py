"""A precision recipe: which dtype each part of a training step uses, and how the loss is scaled.

One frozen :class:`Recipe` describes a mixed precision set-up completely; every interface and tool builds
from it: apex's opt levels (:meth:`Recipe.from_opt_level`), fastai's ``to_fp16`` (:meth:`Recipe.fastai`),
the ladder's rungs, the memory estimate and the report. :data:`RECIPES` names the presets, and those names
are the vocabulary of the command line.

======================  ===========  ==========  ===========  ========  =============================
preset                  weights      BatchNorm   fp32 master  autocast  loss scale
======================  ===========  ==========  ===========  ========  =============================
fp32 / O0               fp32         fp32        (are fp32)   -         none
pure-fp16 / pure-bf16   half         half        no           -         none
fp16-master             fp16         fp32        yes          -         none
fp16-static             fp16         fp32        yes          -         static 512
fp16-dynamic            fp16         fp32        yes          -         dynamic from 512
fp16                    fp16         fp32        yes          -         dynamic from 2**16 (fastai v1)
O1                      fp32         fp32        (are fp32)   fp16      dynamic from 2**16 (apex)
O2                      fp16         fp32        yes          -         dynamic from 2**16 (apex)
O3                      fp16         fp16        no           -         static 1 (apex)
bf16                    bf16         fp32        yes          -         none (fp32's exponent range)
======================  ===========  ==========  ===========  ========  =============================

Starting scales: apex, torch.amp and fastai (v1's ``to_fp16``, v2's ``MixedPrecision``) start a dynamic
scale at 2**16 and let the first few overflowing steps find the level (each costs a skipped step). The
ladder's ``fp16-dynamic`` rung starts at 512, fastai v1's static scale, which moves fp16's underflow
threshold from 2**-24 to 2**-33 and rarely overflows; but it grows only once per 1000 clean steps, so a
model whose gradients need more (a layer scale of 1e-6: 98% of a ConvNeXt block's first gradients were
zeros at 512, none at 2**16) waits thousands of steps for it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.errors import ApexPropertyError, ConfigError
from mixprec.hardware import HALF_DTYPES
from mixprec.scale_state import DEFAULT_INIT_SCALE, ScaleConfig  # the scaler's own record: one definition
from mixprec.scaler import GradScaler

__all__ = [
    "ScaleConfig",
    "Recipe",
    "RECIPES",
    "OPT_LEVELS",
    "get_recipe",
    "FASTAI_LOSS_SCALE",
    "FASTAI_MAX_NOSKIP",
    "APEX_MAX_LOSS_SCALE",
]

# fastai v1's static loss scale (its dynamic one starts at 2**16 unless given): moves fp16's underflow
# threshold from 2**-24 to 2**-33, while a logit gradient (at most 1 per sample, divided by the batch
# size) times 512 stays far below fp16's max 65504.
FASTAI_LOSS_SCALE = 512.0
# fastai v1's clean steps before a dynamic scale doubles: overflow is rare once the scale is tuned.
FASTAI_MAX_NOSKIP = 1000
# apex's (and fastai's) ceiling on a dynamic scale: past it a scaled 2**-24 would already be 1, so larger
# scales only buy overflows.
APEX_MAX_LOSS_SCALE = 2.0**24


@dataclass(frozen=True)
class Recipe:
    """Which dtype each part of a training step uses.

    ``model_dtype`` is the dtype of the model's parameters (and its floating inputs): half for apex's
    O2/O3 and fastai's ``to_fp16``, fp32 otherwise. ``autocast_dtype`` runs the forward under a per-op cast
    policy over fp32 weights (apex O1, torch.amp). Gradients take their parameter's dtype; the optimizer
    state takes the dtype of what it steps (the fp32 masters when ``master_weights``). ``scale`` None means
    no loss scaling."""

    name: str
    description: str
    model_dtype: torch.dtype = torch.float32
    keep_batchnorm_fp32: bool = True  # BatchNorm's statistics are long reductions: fp32 costs few bytes
    master_weights: bool = False
    flat_master: bool = False  # one contiguous fp32 buffer per param group (one long optimizer kernel)
    # True keeps an fp32 gradient per master (4 bytes per parameter; any optimizer). False (Adam/AdamW):
    # the step reads the half gradients itself, 16 bytes per parameter with Adam, fp32 training's figure.
    master_grads: bool = True
    compile_step: bool = False  # with master_grads=False: the update as one compiled pass (master_kernel)
    # bf16 only: each fp32 master held as the bf16 weight plus its low 16 bits (LowPrecisionOptimizer
    # "split"), 14 bytes per parameter with Adam and no fp32 copy at all; the same start as O2's masters,
    # but a master exactly between two bf16 values rounds away from zero in the model, where O2 rounds to
    # even (~1 weight in 65536), so the two runs separate slowly
    split_masters: bool = False
    autocast_dtype: torch.dtype | None = None
    policy: Any = None  # a mixprec Policy or preset name for the autocast region; None: torch's op lists
    scale: ScaleConfig | None = None
    loss_fp32: bool = True  # compute the loss from an fp32 copy of the output: its reductions need fp32
    # A half model's floating inputs cast to its dtype at its boundary (apex O2's and fastai v1's way; a
    # GEMM would round them anyway). False leaves them as given, for inputs whose low bits matter
    # (coordinates under a Fourier encoding: docs/recipes.md); its GEMMs still round them.
    cast_inputs: bool = True

    def __post_init__(self) -> None:
        allowed = (torch.float32, *HALF_DTYPES)
        if self.model_dtype not in allowed:
            raise ConfigError(
                f"recipe {self.name!r}: model_dtype must be one of {allowed}, got {self.model_dtype!r}.",
                "use torch.float32, torch.float16 or torch.bfloat16.",
            )
        if self.autocast_dtype is not None and self.autocast_dtype not in HALF_DTYPES:
            raise ConfigError(
                f"recipe {self.name!r}: autocast_dtype must be float16 or bfloat16, got "
                f"{self.autocast_dtype!r}.",
                "use autocast_dtype=None for no per-op casting.",
            )
        if self.flat_master and not self.uses_masters:
            raise ConfigError(
                f"recipe {self.name!r}: flat_master=True, but it keeps no fp32 master weights.",
                "use master_weights=True with a half model_dtype, or drop flat_master.",
            )
        if (not self.master_grads or self.compile_step) and not self.uses_masters:
            raise ConfigError(
                f"recipe {self.name!r}: master_grads=False/compile_step=True shape the fp32 master step, but "
                "this recipe keeps no fp32 master weights.",
                "use them with opt_level='O2' (or master_weights=True and a half model dtype).",
            )
        if not self.master_grads and self.model_dtype is torch.float16 and self.scale is not None:
            # initialize's scale_loss and the Learner hand back unscaled gradients before the step; without
            # fp32 master gradients those are unscaled where they are, and an fp16 gradient divided by a
            # loss scale of 65536 flushes to zero -- what the scale protects. (bf16 scales by 1: exact.)
            raise ConfigError(
                f"recipe {self.name!r}: master_grads=False with fp16 and loss scaling: the gradients would "
                "be unscaled in fp16, flushing the small ones to zero.",
                "use torch.bfloat16 with master_grads=False, or keep master_grads=True for fp16 (torch.amp "
                "style, MasterWeights(opt, master_grads=False) with GradScaler's scaler.step(opt) unscales "
                "inside the fused step instead).",
            )
        if not self.cast_inputs and not self.casts_model:
            raise ConfigError(
                f"recipe {self.name!r}: cast_inputs=False keeps a half model's inputs as given, but this "
                "recipe makes no half model (O1 leaves the inputs as given already; O0 casts them to fp32).",
                "drop it, or use a half model's recipe (O2, O3, to_fp16()/to_bf16()).",
            )
        if self.split_masters:
            self._check_split()
        if self.compile_step and self.master_grads:
            raise ConfigError(
                f"recipe {self.name!r}: compile_step=True compiles the step that reads the half gradients "
                "itself.",
                "pass master_grads=False with it.",
            )
        if self.scale is not None and not isinstance(self.scale, ScaleConfig):
            raise ConfigError(
                f"recipe {self.name!r}: scale must be a ScaleConfig or None, got "
                f"{type(self.scale).__name__}.",
                "pass scale=ScaleConfig(...) or ScaleConfig.static(512.0).",
            )

    # ---- what the recipe implies
    @property
    def casts_model(self) -> bool:
        return self.model_dtype in HALF_DTYPES

    def _check_split(self) -> None:
        """split_masters is O2's masters in another layout, for bf16: say which part of that is missing."""
        missing = [
            (not self.uses_masters, "it keeps no fp32 master weights to split"),
            (self.model_dtype != torch.bfloat16, f"{self.model_dtype} is not an fp32's top half (bf16 is)"),
            (self.flat_master, "flat_master is a layout of fp32 masters"),
            (not self.master_grads or self.compile_step,
             "master_grads=False/compile_step=True shape the fp32 master step, which split masters replace"),
        ]
        problem = next((why for broken, why in missing if broken), None)
        if problem is not None:
            raise ConfigError(
                f"recipe {self.name!r}: split_masters=True holds each fp32 master as the bf16 weight plus "
                f"its low 16 bits, but {problem}.",
                "use split_masters=True with opt_level='O2' and dtype=torch.bfloat16 alone.",
            )

    @property
    def uses_masters(self) -> bool:
        """fp32 masters exist only for half weights: fp32 weights already are the masters."""
        return self.master_weights and self.casts_model

    @property
    def half_dtype(self) -> torch.dtype | None:
        """The half dtype arithmetic runs in, if any."""
        return self.model_dtype if self.casts_model else self.autocast_dtype

    @property
    def is_fp32(self) -> bool:
        return self.half_dtype is None

    def replace(self, **changes: Any) -> Recipe:
        return dataclasses.replace(self, **changes)

    def make_scaler(self, device: str | torch.device, **extras: Any) -> GradScaler:
        """The scaler this recipe trains with: disabled (every call a pass-through) when it scales nothing.
        Without masters the optimizer steps the half gradients in place, which the scaler must allow."""
        if self.scale is None:
            return GradScaler(torch.device(device).type, enabled=False, **extras)
        extras.setdefault("allow_fp16_grads", self.casts_model and not self.uses_masters)
        return GradScaler.from_config(torch.device(device).type, self.scale, **extras)

    # ---- presets
    @classmethod
    def from_opt_level(cls, opt_level: str, dtype: torch.dtype = torch.float16) -> Recipe:
        """apex's opt level ``O0``-``O3`` with ``dtype`` as its half dtype (fp16 as apex, or bf16).
        apex's property overrides are applied by :func:`mixprec.apex_properties.apply_overrides`."""
        if not isinstance(opt_level, str) or opt_level not in _APEX_FP16:
            raise ApexPropertyError(  # a RuntimeError too, as apex's initialize raised
                f"Unknown opt_level {opt_level!r}.",
                f"use one of {', '.join(_APEX_FP16)} (letter O, not zero: 'O1', not '01').",
            )
        return _APEX_FP16[opt_level].with_half_dtype(dtype)

    def with_half_dtype(self, dtype: torch.dtype) -> Recipe:
        """The same recipe computing in another half dtype. bf16 has fp32's exponent range, so gradients
        do not underflow: a dynamic scale becomes a static 1 (which still skips an overflowing step)."""
        if not (isinstance(dtype, torch.dtype) and dtype in HALF_DTYPES):
            raise ConfigError(
                f"dtype must be torch.float16 or torch.bfloat16, got {dtype!r}.",
                "integer dtypes are for quantization; use opt_level='O0' for fp32.",
            )
        if self.is_fp32 or dtype == self.half_dtype:
            return self
        scale = self.scale
        if dtype == torch.bfloat16 and scale is not None and scale.dynamic:
            scale = ScaleConfig.static(1.0)
        return self.replace(
            description=self.description.replace(_label(self.half_dtype), _label(dtype)),
            model_dtype=dtype if self.casts_model else self.model_dtype,
            autocast_dtype=dtype if self.autocast_dtype is not None else None,
            scale=scale,
        )

    @classmethod
    def fastai(
        cls,
        dtype: torch.dtype = torch.float16,
        loss_scale: float | None = None,
        max_noskip: int = FASTAI_MAX_NOSKIP,
        dynamic: bool = True,
        flat_master: bool = False,
        max_scale: float | None = APEX_MAX_LOSS_SCALE,
        loss_fp32: bool = True,
        **scale_extras: Any,
    ) -> Recipe:
        """fastai v1's ``to_fp16`` (and ``to_bf16``): a half model with BatchNorm fp32, fp32 masters, and
        (fp16 only) loss scaling from ``loss_scale``; None is fastai's rule, its default: a dynamic scale
        from 2**16 (at most ``max_scale``), a static one at 512. bf16 has fp32's exponent range: no
        scaling (for fp16 without it: the ``fp16-master`` preset)."""
        scale = None
        if loss_scale is None:  # fastai v1's rule (mixprec started at 512 once: see the module docstring)
            loss_scale = DEFAULT_INIT_SCALE if dynamic else FASTAI_LOSS_SCALE
            if dynamic and max_scale is not None:
                loss_scale = min(loss_scale, max_scale)  # never above the ceiling (fastai would start above)
        if dtype == torch.float16:
            bounds = {"max_scale": max_scale} if dynamic else {}
            scale = ScaleConfig(init_scale=loss_scale, dynamic=dynamic, growth_interval=max_noskip,
                                **bounds, **scale_extras)  # fmt: skip
        name = "fp16" if dtype == torch.float16 else "bf16"
        description = f"fastai to_{name}: {name} model, fp32 BatchNorm and masters"
        return cls(name, description, dtype, master_weights=True, flat_master=flat_master, scale=scale,
                   loss_fp32=loss_fp32)  # fmt: skip


def _label(dtype: torch.dtype | None) -> str:
    return "BF16" if dtype == torch.bfloat16 else "FP16"


_FP16 = torch.float16
_APEX_DYNAMIC = ScaleConfig(max_scale=APEX_MAX_LOSS_SCALE)  # from 2**16, as apex and torch.amp
# apex.amp's four opt levels (see mixprec.apex_properties for apex's names of these fields).
_APEX_FP16: dict[str, Recipe] = {
    "O0": Recipe("O0", "Pure FP32 training.", scale=ScaleConfig.static(1.0)),
    "O1": Recipe("O1", "Insert automatic casts around PyTorch functions and Tensor methods.",
                 autocast_dtype=_FP16, scale=_APEX_DYNAMIC),
    "O2": Recipe("O2", "FP16 training with FP32 batchnorm and FP32 master weights.", _FP16,
                 master_weights=True, scale=_APEX_DYNAMIC),
    "O3": Recipe("O3", "Pure FP16 training.", _FP16, keep_batchnorm_fp32=False,
                 scale=ScaleConfig.static(1.0)),
}  # fmt: skip
_DYNAMIC_512 = ScaleConfig(init_scale=FASTAI_LOSS_SCALE, growth_interval=FASTAI_MAX_NOSKIP,
                           max_scale=APEX_MAX_LOSS_SCALE)  # fmt: skip


def _presets() -> dict[str, Recipe]:
    fp32 = Recipe("fp32", "fp32 params, grads and optimizer state")
    table = [
        fp32,
        Recipe("pure-fp16", "pure fp16: fp16 params, grads and optimizer state, no masters", _FP16,
               keep_batchnorm_fp32=False),
        Recipe("pure-bf16", "pure bf16: bf16 params, grads and optimizer state, no masters", torch.bfloat16,
               keep_batchnorm_fp32=False),
        Recipe("fp16-master", "fp16 model, fp32 masters, no loss scaling", _FP16, master_weights=True),
        Recipe("fp16-static", f"fp16 model, fp32 masters, static loss scale {FASTAI_LOSS_SCALE:g}", _FP16,
               master_weights=True, scale=ScaleConfig.static(FASTAI_LOSS_SCALE)),
        Recipe("fp16-dynamic", "fp16 model, fp32 masters, dynamic loss scale from 512", _FP16,
               master_weights=True, scale=_DYNAMIC_512),
        Recipe.fastai(torch.float16),
        Recipe.fastai(torch.bfloat16),
        *_APEX_FP16.values(),
    ]  # fmt: skip
    return {r.name: r for r in table}


RECIPES: dict[str, Recipe] = _presets()
OPT_LEVELS: dict[str, Recipe] = {k: v for k, v in RECIPES.items() if k in ("O0", "O1", "O2", "O3")}


# Other names of presets: the experiment ladder's rung for pure fp16 (`mixprec compare --rungs`) is
# "fp16-naive"; `mixprec memory --precision` takes that name too.
ALIASES: dict[str, str] = {"fp16-naive": "pure-fp16"}


def get_recipe(name: str | Recipe) -> Recipe:
    """The preset named ``name`` (case-insensitive for opt levels; :data:`ALIASES` too), or ``name`` itself
    if a Recipe."""
    if isinstance(name, Recipe):
        return name
    key = name.upper() if name.upper() in OPT_LEVELS else name.lower()
    key = ALIASES.get(key, key)
    if key not in RECIPES:
        hint = " (letter O, not zero)" if name.startswith("0") else ""
        raise ConfigError(f"unknown precision recipe {name!r}{hint}.", f"use one of: {', '.join(RECIPES)}.")
    return RECIPES[key]
