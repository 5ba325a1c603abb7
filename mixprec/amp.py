"""apex-style opt levels: ``initialize``, ``scale_loss``, ``master_params`` and the loss scalers' state.

An opt level is a named :class:`~mixprec.recipe.Recipe` (``Recipe.from_opt_level``), with apex's property
overrides applied by :mod:`mixprec.apex_properties`. Nothing here owns numerics: the pieces are the
library's one ``GradScaler`` (one per loss), one ``MasterWeights`` optimizer wrapper, and the half model
of :mod:`mixprec.half_model`. What this module adds is apex's arrangement of them:

* ``patch_torch_functions`` (O1): apex monkey-patched torch's functions globally. We do not patch globals;
  the model's forward runs inside ``mixprec.autocast``, and its floating outputs are returned in fp32 so a
  loss computed outside the model runs in fp32, which is what apex's patched loss functions achieved.
* ``cast_model_type`` (O2/O3): the model is cast in place (parameter objects keep their identity, so the
  optimizer built before ``initialize`` still refers to them); floating inputs are cast to the model's
  dtype on the way in and outputs to fp32 (or ``cast_model_outputs``) on the way out, through torch's
  pytree (namedtuples, OrderedDicts, HF ``ModelOutput``). ``model.state_dict()`` holds fp32 tensors, as
  apex's state_dict hook made it, so an O2 checkpoint loads into an fp32 model.
* ``master_weights`` (O2): the optimizer is wrapped in :class:`~mixprec.master.MasterWeights`.
* ``loss_scale``: one :class:`~mixprec.scaler.GradScaler` per loss (``num_losses``).

Skipping follows apex, not torch.amp: when the loss of a ``scale_loss(loss, [opt0, opt1])`` block
overflowed, the next ``step()`` of *every* optimizer passed to that block is skipped (torch.amp's
``GradScaler.step`` skips an optimizer only when its own gradients overflowed). The decision is the
scaler's (:func:`~mixprec.scaler.step_unless_inf`): on the device for fused optimizers, else one read.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import types
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from mixprec.apex_properties import OPT_LEVELS, Properties, apply_overrides, banner
from mixprec.apex_state import AmpStateView
from mixprec.checkpoint_checks import check_scaler
from mixprec.distributed import forward_skips_grad_sync, process_rank
from mixprec.errors import ApexPropertyError, BannedOpError, ConfigError, ScalerStateError, listed
from mixprec.half_model import (
    BATCHNORM_KEPT,
    MARKED,
    SPARSE,
    CastInputs,
    CastOutputs,
    HalfModel,
    check_castable,
    fp32_roots,
    prepare,
)
from mixprec.hardware import HALF_DTYPES
from mixprec.low_precision import LowPrecisionOptimizer, check_wrappable
from mixprec.master import MasterWeights, check_params_belong
from mixprec.policy import register_float_function, register_half_function, register_promote_function
from mixprec.policy.tables import BCE_ADVICE
from mixprec.recipe import APEX_MAX_LOSS_SCALE, Recipe
from mixprec.scaler import GradScaler
from mixprec.skip_step import (
    BufferWatch,
    combined_found_inf,
    remove_watches,
    running_statistics,
    step_unless_inf,
)
from mixprec.split_state_dict import hook_split_state_dict
from mixprec.warn_site import user_stacklevel

__all__ = [
    "Properties",
    "OPT_LEVELS",
    "initialize",
    "scale_loss",
    "master_params",
    "loss_scaler",
    "loss_scalers_of",
    "restore",
    "reset",
    "state_dict",
    "load_state_dict",
    "register_half_function",
    "register_float_function",
    "register_promote_function",
    "half_function",
    "float_function",
    "promote_function",
]


# ------------------------------------------------------------------------------------------------ state
@dataclass
class _PendingStep:
    """Inf flags recorded by ``scale_loss`` for one optimizer, consumed by its next ``step()``."""

    found_infs: list[torch.Tensor] = field(default_factory=list)
    loss_ids: list[int] = field(default_factory=list)  # whose scale_loss recorded each flag
    unscaled: bool = False  # grads currently hold unscaled values from an earlier loss this iteration
    stepped: bool = False  # step() has consumed these flags; another step() would reuse the gradients
    delayed: bool = False  # a delay_unscale backward left scaled gradients for a later scale_loss
    # unscaled gradients of earlier losses set aside when a delay_unscale loss began, added back by the next
    # scale_loss that unscales (apex: the iteration's gradients are the sum of all its losses')
    carried: dict[torch.Tensor, torch.Tensor] | None = None


@dataclass
class _AmpState:
    """What one ``initialize`` call set up; each of its optimizers points back to it."""

    recipe: Recipe
    device_type: str
    scalers: list[GradScaler]
    models: list[HalfModel]
    optimizers: list[Any] = field(default_factory=list)  # as initialize returned them
    pending: dict[int, _PendingStep] = field(default_factory=dict)
    verbosity: int = 1  # > 0: say when an overflow skips a step, as apex does
    warned_unsynced: bool = False  # scale_loss said once that it unscaled a no_sync() backward
    # by loss_id: its scaler's skipped_steps when its overflow was last said (each optimizer's step skips
    # on it; apex said it once per loss)
    said_overflow: dict[int, int] = field(default_factory=dict)
    checked_unheld: bool = False  # the first scale_loss looked for gradients no optimizer of it will unscale
    # by id of an optimizer initialize returned: the buffers of the models it trains (_buffer_watches)
    watches: dict[int, list[BufferWatch]] = field(default_factory=dict)
    # by id of an optimizer initialize returned: gradients a loss scaled without it wrote on its parameters,
    # each with (loss_id, its mark right after), checked at its step and its next scale_loss
    scaled_writes: dict[int, dict[torch.Tensor, tuple[int, _GradMark]]] = field(default_factory=dict)


_STATE: _AmpState | None = None  # the latest initialize's: what loss_scaler() and state_dict() read
_OPT_STATE_ATTR = "_mixprec_amp"
_DISABLED_ATTR = "_mixprec_amp_disabled"  # on the optimizers of an initialize(..., enabled=False)
_REPLACED_ATTR = "_mixprec_replaced_at"  # on an optimizer initialize wrapped in MasterWeights: the opt level


def _state() -> _AmpState:
    if _STATE is None:
        raise ScalerStateError(
            "mixprec.initialize has not been called.",
            "call model, optimizer = mixprec.initialize(model, optimizer, opt_level=...) first.",
        )
    return _STATE


# ------------------------------------------------------------------------------------------------ initialize
T = TypeVar("T")


def _as_list(x: T | Sequence[T] | None) -> tuple[list[T], bool]:
    if x is None:
        return [], False
    if isinstance(x, list | tuple):
        return list(x), True
    return [x], False  # type: ignore[list-item]


# apex's positional order after (models, optimizers). mixprec's third positional is opt_level (a str);
# apex's is enabled (a bool), so a bool there means the whole call is in apex's order.
APEX_POSITIONAL = ("enabled", "opt_level", "cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32",
                   "master_weights", "loss_scale", "cast_model_outputs", "num_losses", "verbosity",
                   "min_loss_scale", "max_loss_scale")


def _apex_order(first: Any, rest: tuple[Any, ...], given: dict[str, Any]) -> tuple[Any, ...]:
    """The values of APEX_POSITIONAL for a call in apex's positional order (``first``, a bool, is apex's
    ``enabled``; ``rest`` the positional arguments after it), each other name keeping its ``given`` value.
    No wrapper around initialize: a frame of ours above it would take its warnings' stacklevel."""
    if not isinstance(first, bool):
        raise TypeError(f"initialize() takes 3 positional arguments (models, optimizers, opt_level) but "
                        f"{3 + len(rest)} were given; in apex's order the third is enabled, a bool: "
                        "initialize(model, opt, True, 'O2', ...)")
    if len(rest) > len(APEX_POSITIONAL) - 1:
        raise TypeError(f"initialize() takes at most {len(APEX_POSITIONAL) + 2} positional arguments in "
                        f"apex's order (models, optimizers, {', '.join(APEX_POSITIONAL)}); got "
                        f"{len(rest) + 3}")
    named = dict(zip(APEX_POSITIONAL, (first, *rest), strict=False))
    twice = sorted(k for k in named if k != "opt_level" and given[k] != _INITIALIZE_DEFAULTS[k])
    if twice:
        raise TypeError(f"initialize() got {', '.join(twice)} both by position (apex's order: models, "
                        f"optimizers, enabled, opt_level, ...) and by keyword")
    return tuple(named.get(k, given[k]) if k != "opt_level" else named.get(k, "O1") for k in APEX_POSITIONAL)


def initialize(
    models: nn.Module | Sequence[nn.Module],
    optimizers: Any = None,
    opt_level: str | bool = "O1",
    *apex_positional: Any,
    enabled: bool = True,
    dtype: torch.dtype = torch.float16,
    cast_model_type: torch.dtype | bool | None = None,
    patch_torch_functions: bool | None = None,
    keep_batchnorm_fp32: bool | str | None = None,
    master_weights: bool | None = None,
    loss_scale: float | str | None = None,
    cast_model_outputs: torch.dtype | None = None,
    num_losses: int = 1,
    min_loss_scale: float | None = None,
    max_loss_scale: float = APEX_MAX_LOSS_SCALE,
    skip_limit: int | None = None,
    master_grads: bool = True,
    compile_step: bool = False,
    split_masters: bool = False,
    cast_model_inputs: bool = True,
    verbosity: int = 1,
) -> Any:
    """Prepare models and optimizers for mixed precision at an apex opt level.

    Returns the same structure it was given: ``model, optimizer``; ``[models], [optimizers]``; or just the
    model(s) when no optimizer is passed. Build the optimizers before calling this, over the fp32 model.
    apex's arguments keep apex's meaning (``enabled=False`` returns everything untouched); ``dtype``
    chooses the half dtype (bf16 too) and ``skip_limit`` stops a run whose steps keep overflowing
    (:class:`~mixprec.errors.PersistentOverflowError`). ``master_grads=False`` (O2 with Adam/AdamW, bf16)
    keeps no fp32 master gradients -- 16 bytes per parameter instead of 20 -- and ``compile_step=True``
    runs that step as one compiled pass (:class:`~mixprec.master.MasterWeights`). ``split_masters=True``
    (O2, bf16) holds each fp32 master as the bf16 weight plus its low 16 bits instead
    (:class:`~mixprec.low_precision.LowPrecisionOptimizer` ``"split"``): the masters start at the same fp32
    values, 14 bytes per parameter with Adam, and on the CPU one native pass for Adam/AdamW.
    ``cast_model_inputs=False`` (O2, O3) leaves the model's floating inputs as given, where apex casts them
    to the half dtype: for inputs whose low bits matter (coordinates under a Fourier encoding, in a module
    marked ``keep_fp32``; docs/recipes.md); the model's GEMMs still round them.
    ``verbosity``: 0 silent, 1 one line, 2 apex's property list.

    The third positional argument is ``opt_level``; apex's is ``enabled``, and a call in apex's order
    (a bool third, ``initialize(model, opt, True, "O2")``) is read in apex's order."""
    global _STATE
    if isinstance(opt_level, bool) or apex_positional:  # apex's positional order
        given = {k: v for k, v in locals().items() if k in APEX_POSITIONAL}
        (enabled, opt_level, cast_model_type, patch_torch_functions, keep_batchnorm_fp32, master_weights,
         loss_scale, cast_model_outputs, num_losses, verbosity, min_loss_scale, max_loss_scale,
         ) = _apex_order(opt_level, apex_positional, given)
    if not enabled:
        for opt in _as_list(optimizers)[0]:
            setattr(opt, _DISABLED_ATTR, True)  # scale_loss passes its loss through, as apex's does
        return models if optimizers is None else (models, optimizers)
    recipe = apply_overrides(
        Recipe.from_opt_level(opt_level, dtype),
        min_loss_scale=min_loss_scale,
        max_loss_scale=max_loss_scale,
        cast_model_type=cast_model_type,
        patch_torch_functions=patch_torch_functions,
        keep_batchnorm_fp32=keep_batchnorm_fp32,
        master_weights=master_weights,
        loss_scale=loss_scale,
    )
    if skip_limit is not None and recipe.scale is not None:
        recipe = recipe.replace(scale=dataclasses.replace(recipe.scale, skip_limit=skip_limit))
    recipe = recipe.replace(master_grads=master_grads, compile_step=compile_step, split_masters=split_masters,
                            cast_inputs=cast_model_inputs)
    model_list, models_were_list = _as_list(models)
    opt_list, opts_were_list = _as_list(optimizers)
    given = opt_list
    _check_models_and_optimizers(model_list, opt_list)
    for model in model_list:
        check_castable(model, recipe)  # before any model is cast: FSDP2 shards, a DDP wrapper
    if recipe.split_masters:
        check_split_params(model_list, opt_list, recipe)
    device_type = _device_type(model_list)
    for line in banner(recipe, verbosity) if process_rank() == 0 else ():  # apex prints it on rank 0 only
        print(line)
    # apex casts O0's floating inputs and outputs to fp32 (its cast_model_type is torch.float32 there, and
    # it casts the model too: mixprec leaves a model of another dtype, fp64, and its inputs as they are)
    o0_casts = recipe.name == "O0" and cast_model_type is not False
    halves = [_prepare(m, recipe, device_type, cast_model_outputs, o0_casts and _all_fp32(m))
              for m in model_list]  # fmt: skip
    if recipe.uses_masters:
        originals = {k: v for h in halves for k, v in h.fp32_originals().items()}
        # Seeded from the fp32 weights, not their half rounding: the same masters as MixedPrecision's.
        opt_list = [_with_masters(opt, originals, recipe) for opt in opt_list]
        del originals
        if recipe.split_masters:  # model.state_dict() holds the exact masters; a load sets both halves
            for half, opt in ((h, _inner(o)) for h in halves for o in opt_list):
                half.handles += hook_split_state_dict(half.model, opt)  # type: ignore[arg-type]
    else:
        _warn_if_state_underflows(recipe, opt_list)
    for half in halves:
        # The buffers' fp32 values are kept (few: RoPE's inv_freq came back from restore() rounded to half,
        # a user trial), not frozen parameters' (4 bytes each: a frozen backbone, a model for inference).
        half.release_originals(keep_buffers=True)
    scalers = [recipe.make_scaler(device_type) for _ in range(num_losses)]
    if _STATE is not None and opt_list:
        warnings.warn(
            "mixprec.initialize was called again: its optimizers keep their own loss scalers, and "
            "mixprec.amp.state_dict()/loss_scaler() now refer to this call's (an earlier call's scaler: "
            "loss_scaler(optimizer=its_optimizer)). For independent runs one "
            "after another (a sweep, a notebook), call mixprec.amp.reset() when a run ends: then no warning.",
            stacklevel=2,
        )
    for mine, returned in zip(given, opt_list, strict=True):
        mine.__dict__.pop(_DISABLED_ATTR, None)  # an earlier initialize(..., enabled=False) no longer holds
        if mine is not returned:  # wrapped in fp32 master weights: scale_loss must get the wrapper
            setattr(mine, _REPLACED_ATTR, recipe.name)
    _STATE = _AmpState(recipe, device_type, scalers, halves, list(opt_list), verbosity=verbosity,
                       watches=_buffer_watches(model_list, opt_list))
    for half in halves:
        half.handles.append(half.model.register_forward_pre_hook(_note_grad_sync))
    for opt in opt_list:
        _patch_step(opt, _STATE)
    out_models: Any = model_list if models_were_list else model_list[0]
    if optimizers is None:
        return out_models
    return out_models, (opt_list if opts_were_list else opt_list[0])


_INITIALIZE_DEFAULTS = {k: p.default for k, p in inspect.signature(initialize).parameters.items()}


# Whether the latest forward of an initialize's model ran inside DDP's no_sync(): scale_loss must not move
# that backward's gradients away (_warn_if_unsynced). Module-level, as _STATE is: the hook holds no state,
# so deepcopy(model) (an EMA copy) and torch.save(model) stay as light as before.
_UNSYNCED_FORWARD = [False]


def _note_grad_sync(module: nn.Module, args: Any) -> None:
    """Forward pre-hook on each model ``initialize`` prepares."""
    if torch.compiler.is_compiling():  # traced, its reads of DDP's state would become guards: recompiles
        return
    _UNSYNCED_FORWARD[0] = torch.is_grad_enabled() and forward_skips_grad_sync()


def _warn_if_unsynced(state: _AmpState) -> None:
    if not _UNSYNCED_FORWARD[0] or state.warned_unsynced:
        return
    state.warned_unsynced = True
    warnings.warn(
        "scale_loss unscaled the gradients of a backward run inside DistributedDataParallel.no_sync(): "
        "they leave the model's .grad here (into the fp32 masters, or set aside while the next loss's "
        "backward runs), so DDP's synchronising backward all-reduces only the last micro-batch's gradients "
        "and the ranks drift apart. Pass delay_unscale=True to the "
        "scale_loss calls inside no_sync(), and leave it False for the last micro-batch's, outside it.",
        stacklevel=4,  # the user's `with scale_loss(...)` line, past contextlib's __exit__
    )


def _prepare(
    model: nn.Module, recipe: Recipe, device_type: str, out: torch.dtype | None, fp32_io: bool = False
) -> HalfModel:
    model._mixprec_opt_level = recipe.name  # type: ignore[assignment]
    if recipe.is_fp32:  # O0, or overrides that turned every cast off: no region
        half = HalfModel(model, recipe)
        if fp32_io:  # apex O0: an fp16 or fp64 batch reaches the fp32 model as fp32
            half.handles.append(model.register_forward_pre_hook(CastInputs(torch.float32), with_kwargs=True))
        out = out or (torch.float32 if fp32_io else None)
        if out is not None:
            half.handles.append(model.register_forward_hook(CastOutputs(out, every=True)))
        return half
    return prepare(model, recipe, device_type, output_dtype=out, fp32_state_dict=True)


def _inner(opt: Any) -> torch.optim.Optimizer:
    """The torch optimizer of ``opt``: itself, or the one a wrapper (apex's LARC) holds in ``.optim``."""
    inner = getattr(opt, "optim", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else opt


def _with_masters(opt: Any, originals: dict[torch.Tensor, torch.Tensor], recipe: Recipe) -> Any:
    """Wrap the optimizer (or a LARC-style wrapper's inner one) in fp32 master weights: MasterWeights, or
    the split layout seeded from the same fp32 values."""
    inner = _inner(opt)
    masters: torch.optim.Optimizer
    if recipe.split_masters:
        masters = split_masters_of(inner, originals)
    else:
        masters = MasterWeights(inner, model=None, initial=originals, master_grads=recipe.master_grads,
                                compile_step=recipe.compile_step)
    if inner is opt:
        return masters
    opt.optim = masters  # the wrapper adjusts the masters' gradients, then steps through MasterWeights
    return opt


# fp16's smallest subnormal: an optimizer constant below it rounds to 0 in an fp16 tensor op.
_FP16_TINY = 2.0**-24


def _warn_if_state_underflows(recipe: Recipe, optimizers: list[Any]) -> None:
    """O3 (or O2 with master_weights=False) with fp16 weights: the optimizer's state and arithmetic are fp16.
    Adam-style ``eps`` (1e-8) rounds to 0 there and small squared gradients underflow, so the first update
    divides by zero and every weight becomes inf/NaN; say so before it happens."""
    if recipe.model_dtype != torch.float16:
        return
    for i, opt in enumerate(optimizers):
        eps = [g.get("eps") for g in _inner(opt).param_groups if isinstance(g.get("eps"), float)]
        if any(e < _FP16_TINY for e in eps):
            warnings.warn(
                f"optimizers[{i}] ({type(_inner(opt)).__name__}, eps={min(eps):g}) will update fp16 weights "
                f"with fp16 state at {recipe.name}: eps rounds to 0 in fp16 and squared gradients underflow, "
                "so its first step makes the weights inf/NaN. Use opt_level='O2' (fp32 master weights and "
                "optimizer state), or eps >= 1e-4, or dtype=torch.bfloat16.",
                stacklevel=3,
            )


def _check_models_and_optimizers(models: list[nn.Module], optimizers: list[Any]) -> None:
    if not models or not all(isinstance(m, nn.Module) for m in models):
        raise ConfigError(
            "initialize expects an nn.Module or a list of them as its first argument.",
            "call mixprec.initialize(model, optimizer, opt_level='O2').",
        )
    # (a wrong optimizer object is named by the loop below; here it just holds nothing)
    groups = [g for opt in optimizers for g in getattr(_inner(opt), "param_groups", ())]
    held = {id(p) for g in groups for p in g["params"]}
    for model in models:
        if getattr(model, "_mixprec_opt_level", None) is not None:
            raise ConfigError(
                f"initialize was already called on this {type(model).__name__} "
                f"(opt level {model._mixprec_opt_level}).",
                "call mixprec.initialize once per model, with every optimizer and the number of losses.",
            )
        _check_fp32(model, held)
    for i, opt in enumerate(optimizers):
        inner = _inner(opt)
        if not isinstance(inner, torch.optim.Optimizer) or isinstance(inner, MasterWeights):
            raise ConfigError(
                f"optimizers[{i}] is a {type(opt).__name__}, not a plain torch.optim.Optimizer (or a wrapper "
                "holding one in .optim, as apex's LARC).",
                "pass the optimizer you built over the model's parameters; initialize adds master weights.",
            )
        check_params_belong(inner, models, label=f"optimizers[{i}]")


def split_masters_of(optimizer: torch.optim.Optimizer,
                     originals: dict[torch.Tensor, torch.Tensor]) -> LowPrecisionOptimizer:
    """``optimizer`` wrapped in split masters seeded from ``originals`` (the fp32 weights a half model was
    cast from; those of other optimizers' parameters are left out, as ``initial=`` requires)."""
    own = {p for g in optimizer.param_groups for p in g["params"]}
    return LowPrecisionOptimizer(optimizer, "split", initial={p: v for p, v in originals.items() if p in own})


def check_split_params(models: list[nn.Module], optimizers: list[Any], recipe: Recipe) -> None:
    """Split masters complete bf16 weights; O2 keeps some modules' parameters fp32 (half_model.fp32_roots:
    BatchNorm, sparse tables, keep_fp32 modules), which the split wrapper would refuse once the model is
    cast: refuse before anything changes."""
    for opt in optimizers:
        check_wrappable(_inner(opt))  # the optimizers the split layout cannot step (LBFGS), named now
    held = {id(p): p for opt in optimizers for g in _inner(opt).param_groups for p in g["params"]}
    cast = {id(p) for model in models for p in model.parameters() if p.dtype == torch.float32}
    outside = [p for k, p in held.items() if k not in cast]
    if outside:
        raise ConfigError(
            f"split_masters=True completes the bf16 weights the model is cast to, but the optimizer also "
            f"holds a tensor of shape {tuple(outside[0].shape)} ({outside[0].dtype}) that is no fp32 "
            "parameter of the model, so it stays as it is: the split layout has nothing to split there.",
            "give the optimizer the model's parameters only, or keep O2's fp32 masters (drop split_masters).",
        )
    for model in models:
        for module, why in fp32_roots(model, recipe.keep_batchnorm_fp32):
            if any(id(p) in held for p in module.parameters()):
                problem, fix = _SPLIT_REFUSALS[why]
                raise ConfigError(f"split_masters=True completes bf16 weights, but the model's "
                                  f"{type(module).__name__} {problem}: the split layout has nothing to split "
                                  "there.", fix)


# Why a module the cast keeps fp32 (half_model.fp32_roots) cannot be held as split masters, and the fix
_SPLIT_REFUSALS: dict[str, tuple[str, str]] = {
    MARKED: ("is marked with mixprec.keep_fp32, so its parameters stay fp32",
             "keep O2's fp32 masters (split_masters=False), or leave the module unmarked."),
    SPARSE: ("built with sparse=True stays fp32 (its sparse gradient has no dense master; the split step "
             "takes dense gradients only)",
             "keep O2's fp32 masters (split_masters=False) for a model with sparse-gradient tables, or build "
             "them with sparse=False."),
    BATCHNORM_KEPT: ("parameters stay fp32 under O2 (keep_batchnorm_fp32)",
                     "pass keep_batchnorm_fp32=False as well (to the Learner: recipe.replace("
                     "keep_batchnorm_fp32=False)), or keep O2's fp32 masters (split_masters=False) for a "
                     "model with BatchNorm."),
}


def _check_fp32(model: nn.Module, held: set[int]) -> None:
    """apex's check_params_fp32, for the parameters it matters for: initialize casts the model itself,
    from fp32. A trained parameter already half would get an fp32 master seeded from half values (O2), or
    half gradients to unscale (O0/O1). Frozen half parameters (a bf16 backbone under fp32 adapters) and
    half buffers train nothing and stay allowed; apex also refused those."""
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad and (not held or id(p) in held)]
    for name, p in trained:  # with no optimizer given, every parameter that requires grad
        if p.dtype in HALF_DTYPES:
            raise ApexPropertyError(  # a RuntimeError, as apex's
                f"Found parameter {name!r} of {p.dtype}, expected torch.float32: initialize casts the model "
                "itself, so you do not need to call .half() on your model before passing it, at any opt "
                "level (apex refuses this too).",
                "pass the fp32 model: drop the .half() / .to(dtype) before initialize (model.float() undoes "
                "it).",
            )


def _all_fp32(model: nn.Module) -> bool:
    return all(p.dtype == torch.float32 for p in model.parameters() if p.is_floating_point())


def _device_type(models: list[nn.Module]) -> str:
    types_ = {p.device.type for m in models for p in m.parameters()}
    if len(types_) > 1:
        raise ConfigError(
            f"The models' parameters live on several device types: {sorted(types_)}.",
            "move every model to one device (model.to(device)) before initialize.",
        )
    return types_.pop() if types_ else "cpu"


# ------------------------------------------------------------------------------------------------ steps
def _buffer_watches(models: list[nn.Module], opts: list[Any]) -> dict[int, list[BufferWatch]]:
    """A skipped step of an optimizer puts back the running statistics (BatchNorm's; other buffers stay
    as the forward left them, as apex leaves every buffer) of the models it trains -- those holding any of
    its parameters -- as they were after its previous step. Per optimizer,
    not per loss scaler: with several models and losses (apex's DCGAN: three losses, two optimizers) a
    generator loss's overflow skips the generator's step only, and leaves the discriminator's statistics."""
    watches: dict[int, list[BufferWatch]] = {}
    for opt in opts:
        held = {id(p) for p in _held_params(_inner(opt))}
        watches[id(opt)] = [BufferWatch(m) for m in models
                            if running_statistics(m) and any(id(p) in held for p in m.parameters())]
    return watches


def _patch_step(opt: Any, state: _AmpState) -> None:
    """Route ``opt.step()`` through the inf flags ``scale_loss`` recorded."""
    setattr(opt, _OPT_STATE_ATTR, state)
    opt._mixprec_plain_step = opt.step

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        return _amp_step(self, *args, **kwargs)

    # An LR scheduler built before initialize wrapped step to record that it ran. The plain step we call is
    # that wrapper, so carry its mark: without it torch warns at the first scheduler.step() that
    # "optimizer.step() has been overridden after learning rate scheduler initialization". (A skipped first
    # step marks the optimizer as stepped, skip_step.step_unless_inf, so the scheduler does not warn then
    # either.) Bound, as torch's schedulers expect to wrap; a bound method reads its function's mark.
    if getattr(opt.step, "_wrapped_by_lr_sched", False):
        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    opt.step = types.MethodType(step, opt)


def _amp_step(opt: Any, *args: Any, **kwargs: Any) -> Any:
    state: _AmpState = getattr(opt, _OPT_STATE_ATTR)
    plain = opt._mixprec_plain_step
    inner = _inner(opt)
    if inner is not opt and isinstance(inner, MasterWeights):
        # a clip of model.parameters() reaches the masters' gradients before a wrapper around them (apex's
        # LARC) scales them: after that the masters' edit would win (MasterWeights.step takes them itself)
        inner.take_grad_edits()
    pending = state.pending.get(id(opt))
    if pending is not None and pending.delayed and not pending.stepped:
        raise ScalerStateError(
            "optimizer.step() after scale_loss(..., delay_unscale=True) with no scale_loss after it that "
            "unscales: the gradients are still multiplied by the loss scale (under O2 the fp32 masters have "
            "not received them at all), so the step would apply them scaled.",
            "end each accumulation with a scale_loss without delay_unscale (the last micro-batch's), then "
            "step.",
        )
    if state.scaled_writes:
        _check_no_scaled_writes(state, opt, "optimizer.step()")
    watches = state.watches.get(id(opt), [])
    if pending is None or not pending.found_infs:
        for watch in watches:  # a step with nothing to skip: the next training forward snapshots anew
            watch.arm()
        return plain(*args, **kwargs)
    if pending.stepped:
        raise ScalerStateError(
            "optimizer.step() was called twice for one scale_loss: the second step would apply the same "
            "gradients again (and, after an overflow, write their inf/NaN into the weights).",
            "call optimizer.zero_grad() and run the next forward/backward inside scale_loss before stepping.",
        )
    pending.stepped = True
    # The scaler's one skip decision: on the device for fused optimizers, else one read (as apex).
    on_skip = (lambda: _say_overflow(state, pending.loss_ids)) if state.verbosity > 0 else None
    found = combined_found_inf(pending.found_infs)
    result = step_unless_inf(_inner(opt), found, plain, *args, on_skip=on_skip, **kwargs)
    for watch in watches:  # on the device where it was skipped there: no sync
        watch.restore_if(found)
    return result


def _say_overflow(state: _AmpState, loss_ids: list[int]) -> None:
    """apex's line for a skipped step, on rank 0 only, once per loss that overflowed. (A fused optimizer
    on a GPU skips on the device: reading the flag to say so would cost a sync every step, so it stays
    quiet; on the CPU the flag is read for free.)"""
    if process_rank() != 0:
        return
    for loss_id in sorted(set(loss_ids)):
        scaler = state.scalers[loss_id]
        if not scaler.last_step_skipped:
            continue  # another loss of this optimizer overflowed
        skipped = scaler.skipped_steps
        if state.said_overflow.get(loss_id) == skipped:
            continue  # said at another optimizer's step of this iteration
        state.said_overflow[loss_id] = skipped
        scale = scaler.get_scale()
        if not scaler.is_dynamic:
            change = f"keeping its static {scale}"
        elif scaler.scale_history()[-1:] == [scale]:  # not reduced: at the floor (amp's scalers back off
            change = f"keeping loss scale at its floor {scale}"  # on every overflow); apex says "reducing"
        else:
            change = f"reducing loss scale to {scale}"
        print(f"Gradient overflow.  Skipping step, loss scaler {loss_id} {change}")


def _check_from_initialize(opts: list[Any], state: _AmpState) -> None:
    """Each optimizer must be one initialize returned: only those skip an overflowing step, and under O2
    initialize returns a new object (MasterWeights around the one it was given)."""
    level = state.recipe.name
    for i, opt in enumerate(opts):
        if getattr(opt, _OPT_STATE_ATTR, None) is not None:
            continue
        name = type(opt).__name__
        replaced_at = getattr(_inner(opt), _REPLACED_ATTR, None)
        if replaced_at is not None:
            raise ConfigError(
                f"scale_loss got optimizers[{i}], the {name} passed to mixprec.initialize. At {replaced_at} "
                "initialize returned a new optimizer (a wrapper around it holding the fp32 masters: "
                "MasterWeights, or LowPrecisionOptimizer with split_masters): that is the one to use.",
                "keep what initialize returns: model, opt = mixprec.initialize(model, opt, "
                f"{replaced_at!r}), then scale_loss(loss, opt) and opt.step() (wrap an optimizer in LARC "
                "before initialize, not after).",
            )
        if isinstance(opt, LowPrecisionOptimizer):
            raise ConfigError(
                f"scale_loss got optimizers[{i}], a LowPrecisionOptimizer: scale_loss scales for, and skips "
                "the steps of, the optimizers mixprec.initialize returned, and this wrapper was built after.",
                "for O2's masters in the split layout let initialize build it: mixprec.initialize(model, "
                "opt, 'O2', dtype=torch.bfloat16, split_masters=True); else bf16 needs no loss scale: call "
                "loss.backward() and opt.step() directly; for fp16 use a mixprec.GradScaler: "
                "scaler.scale(loss).backward(), scaler.step(opt), scaler.update().",
            )
        if not callable(getattr(opt, "step", None)):
            raise ConfigError(
                f"scale_loss got {name} where its second argument, the optimizer(s), goes: it is not an "
                "optimizer.",
                "pass the optimizer(s) mixprec.initialize returned: scale_loss(loss, opt) or "
                "scale_loss(loss, [opt1, opt2]).",
            )
        masters = " and, with the model's weights in half precision, no fp32 masters" if (
            state.recipe.uses_masters) else ""
        raise ConfigError(
            f"scale_loss got optimizers[{i}], an optimizer ({name}) that mixprec.initialize did not return "
            f"(built after it?): its step would not be skipped on an overflow{masters}.",
            "build the optimizer over the fp32 model before initialize and pass it in: "
            f"model, opt = mixprec.initialize(model, opt, {level!r}).",
        )


def _state_of(opts: list[Any]) -> _AmpState:
    states = {id(s): s for s in (getattr(o, _OPT_STATE_ATTR, None) for o in opts) if s is not None}
    if len(states) > 1:
        raise ConfigError(
            "scale_loss got optimizers from two different initialize calls.",
            "pass the optimizers of one initialize call per scale_loss block.",
        )
    return next(iter(states.values())) if states else _state()


@contextlib.contextmanager
def scale_loss(
    loss: torch.Tensor,
    optimizers: Any,
    loss_id: int = 0,
    model: nn.Module | None = None,
    delay_unscale: bool = False,
    delay_overflow_check: bool = False,
) -> Iterator[torch.Tensor]:
    """``with scale_loss(loss, optimizer) as scaled: scaled.backward()``.

    On exit the gradients are unscaled (into the fp32 masters under O2) and checked; if any gradient of any
    optimizer passed here was inf/NaN, the next ``step()`` of every one of them is skipped (apex's rule),
    and this loss's scaler is updated. Several losses may feed one optimizer in an iteration: gradients
    already unscaled for an earlier loss are set aside and added back after this loss's are unscaled.
    ``delay_unscale=True`` leaves the gradients scaled (accumulate, then let the last ``scale_loss`` of the
    iteration unscale them all with the same scale); inside DDP's ``no_sync()`` it is needed (a warning
    says so), or the synchronising backward all-reduces only the last micro-batch's gradients.

    As apex's, the loss may have several elements (backward then takes a ``gradient``), is scaled in fp32
    (``loss.float()``), and ``model`` is unused. ``delay_overflow_check=True`` made apex skip the inf check
    and the scale update (for fused optimizers it planned); here the check stays (a warning says so once):
    it needs no host read with fused optimizers, and without it an overflow reaches the weights."""
    if not isinstance(loss, torch.Tensor) or not loss.is_floating_point():
        kind = f"a {loss.dtype} tensor" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ConfigError(
            f"scale_loss got {kind} as the loss; it scales a floating-point tensor (what backward takes).",
            "pass the loss tensor your loss function returned, e.g. F.cross_entropy(out, y).",
        )
    if delay_overflow_check:
        _warn_overflow_check_kept()
    opts, _ = _as_list(optimizers)
    if not opts:  # the checks below would blame the parameters "no optimizer holds"
        raise ConfigError(
            f"scale_loss got no optimizer ({optimizers!r}): it unscales the gradients into the optimizers "
            "passed and skips their steps on inf/NaN.",
            "pass initialize an optimizer over the model's parameters and pass it here too; a training loop "
            "that updates by hand (p -= lr * p.grad) is torch.optim.SGD(model.parameters(), lr=lr), its lr "
            "set through optimizer.param_groups.",
        )
    if all(getattr(opt, _DISABLED_ATTR, False) for opt in opts):
        yield loss  # initialize(..., enabled=False): apex's scale_loss passes the loss through
        return
    state = _state_of(opts)
    _check_from_initialize(opts, state)
    scaler = _scaler_of(state, loss_id)
    if state.recipe.autocast_dtype is not None:  # O1: apex's patched functions refused a half BCE input
        _refuse_half_bce(loss)
    for opt in opts:  # a new iteration for these optimizers: flags of a consumed step are done
        if id(opt) in state.pending and state.pending[id(opt)].stepped:
            del state.pending[id(opt)]
    for opt in opts:  # gradients carried past a delayed loss, zeroed since (zero_grad): gone with them
        pending = state.pending.get(id(opt))
        if pending is not None and pending.carried and all(p.grad is None for p in _held_params(_inner(opt))):
            pending.carried = None
    what = f"scale_loss(..., loss_id={loss_id})"
    stale_at_entry: dict[int, dict[torch.Tensor, int]] = {}
    for opt in opts:  # what another loss left scaled would be unscaled (or set aside) as this loss's
        pending = state.pending.get(id(opt))
        if delay_unscale and not (pending is not None and pending.unscaled):
            # unscales and sets aside nothing: refused at its end only if its backward added to them
            stale_at_entry[id(opt)] = _stale_scaled(state, opt)
        else:
            _check_no_scaled_writes(state, opt, what)
    stashes = {id(opt): _stash_unscaled(state, opt) for opt in opts}
    others = _marks_of_others(state, opts)  # to tell this loss's gradients from earlier ones (below)
    yield scaler.scale(loss.float())  # apex's (loss.float()) * scale: a half loss times 2**16 would overflow
    _record_scaled_writes(state, loss_id, others)
    if delay_unscale:
        for opt in opts:
            added = _added_to_stale(state, opt, stale_at_entry.get(id(opt), {}))
            _check_no_scaled_writes(state, opt, f"{what}, delay_unscale=True, whose backward added to them,",
                                    stale=added)  # fmt: skip
        for opt in opts:
            pending = state.pending.setdefault(id(opt), _PendingStep())
            pending.carried = _summed(pending.carried, stashes[id(opt)])
            # the gradients hold this loss's scaled ones now: the next loss must not set them aside
            pending.delayed, pending.unscaled = True, False
        return
    _warn_if_unsynced(state)
    flags: list[torch.Tensor] = []
    for opt in opts:
        inner = _inner(opt)
        by_one = scaler.is_enabled() and scaler._unscale(inner)
        pending = state.pending.get(id(opt))
        earlier = _summed(pending.carried if pending is not None else None, stashes[id(opt)])
        if pending is not None:
            pending.carried = None
        _add_stash(earlier)
        # Only now do the gradients hold every loss of the iteration: mirror them into the model's .grad
        # (MasterWeights), so a clip of the model's parameters reads and edits the sum, not this loss alone.
        # Unscaled by exactly 1 and no earlier loss added: the model's .grad already hold those values.
        mirror = getattr(inner, "grads_unscaled", None)
        if callable(mirror) and scaler.is_enabled():
            mirror(exact_upcasts=by_one and earlier is None)
        flags.extend(scaler._found_inf_per_device(inner).values())
    if not flags and scaler.is_enabled():  # nothing reached them
        _check_gradients_reached(state, opts, others)
        for opt in opts:  # apex passes the loss through: a clean iteration, the scale's growth goes on
            scaler._record_clean(_inner(opt))
    if not state.checked_unheld:
        state.checked_unheld = True
        _warn_unheld_gradients(state, scaler)
    found = combined_found_inf(flags) if flags else None
    for opt in opts:  # apex: this loss overflowed, so no optimizer it fed may step
        pending = state.pending.setdefault(id(opt), _PendingStep())
        if found is not None:
            pending.found_infs.append(found)
            pending.loss_ids.append(loss_id)
        pending.unscaled, pending.delayed = True, False
    scaler.update()


def _warn_overflow_check_kept() -> None:
    warnings.warn(
        "scale_loss(..., delay_overflow_check=True): apex then skipped the inf/NaN check and the scale "
        "update; mixprec keeps both (with fused optimizers the check needs no host read), so an overflowing "
        "step is still skipped and the scale still backs off.",
        stacklevel=4,  # the user's with-line: past this function, scale_loss and contextlib's __enter__
    )


_GradMark = tuple[int, int]  # (id, version) of a gradient: backward's accumulation changes the version


def _mark(grad: torch.Tensor | None) -> _GradMark | None:
    return None if grad is None else (id(grad), grad._version)


_Marks = dict[int, dict[torch.Tensor, "_GradMark | None"]]  # by id of an optimizer initialize returned


def _marks_of_others(state: _AmpState, opts: list[Any]) -> _Marks:
    """The gradients, now, of the parameters each of the initialize's other optimizers holds (none with one
    optimizer: nothing to walk)."""
    passed = {id(_inner(opt)) for opt in opts}
    others = [o for o in state.optimizers if id(_inner(o)) not in passed]
    if not others:
        return {}
    # a parameter a passed optimizer holds too is unscaled with it: its gradient is not left scaled
    unscaled = {id(p) for opt in opts for p in _held_params(_inner(opt))}
    held = {id(o): [p for p in _held_params(_inner(o)) if id(p) not in unscaled] for o in others}
    return {opt_id: {p: _mark(p.grad) for p in params} for opt_id, params in held.items()}


def _written(marks: dict[torch.Tensor, _GradMark | None]) -> dict[torch.Tensor, _GradMark]:
    """The gradients among ``marks`` that a backward wrote since they were taken, each with its new mark."""
    now = {p: _mark(p.grad) for p in marks}
    return {p: mark for p, mark in now.items() if mark is not None and mark != marks[p]}


def _record_scaled_writes(state: _AmpState, loss_id: int, others: _Marks) -> None:
    """Remember the gradients this loss's backward wrote on optimizers not passed to scale_loss: they hold
    this loss's scaled values, which nothing unscales. A GAN's generator loss writes the discriminator's
    this way, harmlessly when its zero_grad comes before its next loss and step."""
    for opt_id, marks in others.items():
        written = _written(marks)
        if written:
            state.scaled_writes.setdefault(opt_id, {}).update({p: (loss_id, m) for p, m in written.items()})


def _stale_scaled(state: _AmpState, opt: Any) -> dict[torch.Tensor, int]:
    """The parameters of ``opt`` whose gradients still hold a scaled loss another scale_loss left there
    (their marks unchanged since: neither zeroed nor written again), by that loss's id. The record goes
    once none holds; a scale of 1 leaves nothing scaled (read only where a record holds: one sync, off
    the usual path)."""
    written = state.scaled_writes.get(id(opt))
    if written is None:
        return {}
    kept = {p: loss_id for p, (loss_id, mark) in written.items() if _mark(p.grad) == mark}
    scaled = {i for i in set(kept.values()) if state.scalers[i].get_scale() != 1.0}
    if not scaled:
        del state.scaled_writes[id(opt)]
        return {}
    return {p: i for p, i in kept.items() if i in scaled}


def _check_no_scaled_writes(state: _AmpState, opt: Any, what: str,
                            stale: dict[torch.Tensor, int] | None = None) -> None:  # fmt: skip
    """Refuse ``what`` (a step, or a scale_loss that would unscale them as its own) on gradients that still
    hold a scaled loss another scale_loss left there (:func:`_stale_scaled`, or ``stale``: those of them a
    delayed block's backward then added to). At 2**16 the update would be 65536x too large, and an
    overflow would go unnoticed. The record stays while it holds, so a second try is refused too. Known
    gap: an in-place edit (a clip of these gradients) changes the mark as a zero_grad(set_to_none=False)
    does, and passes."""
    stale = _stale_scaled(state, opt) if stale is None else stale
    if not stale:
        return
    loss_id = min(stale.values())
    n, scale = sum(i == loss_id for i in stale.values()), state.scalers[loss_id].get_scale()
    raise ScalerStateError(
        f"{what} on {n} gradient(s) that the backward of scale_loss(..., loss_id={loss_id}) wrote while this "
        f"optimizer was not passed to it: they are still multiplied by that loss's scale ({scale:g}), and an "
        "overflow in them was not checked.",
        "pass scale_loss every optimizer whose parameters the loss reaches (scale_loss(loss, [opt1, opt2])), "
        "or zero this optimizer's gradients (opt.zero_grad()) before its next loss if that loss should not "
        "train it (a GAN's discriminator under the generator's loss).",
    )


def _added_to_stale(state: _AmpState, opt: Any, stale: dict[torch.Tensor, int]) -> dict[torch.Tensor, int]:
    """Those of ``stale`` (at a delayed block's entry) whose gradient the block's backward wrote: added in
    place (a later version) or as a new tensor (a backward with create_graph=True). A block that wrote no
    gradient (a gradient penalty's autograd.grad) leaves them to the next check, which a zero_grad in
    between passes."""
    written = state.scaled_writes.get(id(opt), {})
    marks = {p: _mark(p.grad) for p in stale}
    return {p: i for p, i in stale.items()
            if p in written and marks[p] is not None and marks[p] != written[p][1]}


def _check_gradients_reached(state: _AmpState, opts: list[Any], others: _Marks) -> None:
    """None of ``opts`` got a gradient from this loss. A loss that reaches no parameter at all (a constant
    auxiliary loss, a frozen warm-up) passes, as in apex. A gradient this backward wrote on another
    optimizer's parameters (gradients an earlier loss left there are not this one's), or on a model
    parameter no optimizer holds (replaced after initialize: fully_shard, re-wrapping), would stay scaled:
    this raises."""
    held = {id(p) for opt in state.optimizers for p in _held_params(_inner(opt))}
    params = [p for h in state.models for p in h.model.parameters()]
    orphans = [p for p in params if p.grad is not None and id(p) not in held]
    written = [p for marks in others.values() for p in _written(marks)]
    if orphans or written:
        raise ScalerStateError(
            f"scale_loss: no parameter of the {len(opts)} optimizer(s) passed to it received a gradient, "
            f"while {len(written)} parameter(s) of another optimizer of this initialize and {len(orphans)} "
            "that no optimizer holds did, and would stay scaled. The first means the loss trains another "
            "optimizer's parameters; the second, that the model's parameters were replaced after "
            "initialize (FSDP's fully_shard, re-wrapping).",
            "pass scale_loss every optimizer this loss trains; shard or wrap the model before initialize "
            "(with FSDP2 use fully_shard's MixedPrecisionPolicy instead of O2: docs/recipes.md, "
            "Distributed).",
        )


def _warn_unheld_gradients(state: _AmpState, scaler: GradScaler) -> None:
    """Once, at the first scale_loss: model parameters that no optimizer of this initialize holds got
    gradients, which stay multiplied by the loss scale. An optimizer stepping them outside initialize (a
    SparseAdam kept apart for a DLRM's tables) then steps the scaled gradients: with SGD the weights went
    NaN in a few steps, and with Adam (scale-invariant) the skipped overflows go unseen. A warning, not an
    error: a parameter left out of every optimizer on purpose (frozen by omission) trains nothing anyway."""
    held = {id(p) for opt in state.optimizers for p in _held_params(_inner(opt))}
    unheld = [name for h in state.models for name, p in h.model.named_parameters()
              if p.grad is not None and id(p) not in held]
    scale = scaler.get_scale() if unheld and scaler.is_enabled() else 1.0  # one read, at the first loss
    if scale == 1.0:
        return
    shown = listed(unheld, 3)
    warnings.warn(
        f"scale_loss: {len(unheld)} model parameter(s) that no optimizer passed to mixprec.initialize holds "
        f"received gradients ({shown}); they stay multiplied by the loss scale ({scale:g}) and "
        "their overflows are not checked. Fix: pass every optimizer that steps them to initialize (a list: "
        "initialize(model, [opt_sparse, opt_dense], ...)) and to scale_loss; a parameter no optimizer should "
        "train takes requires_grad_(False).",
        stacklevel=user_stacklevel(),
    )


def _held_params(inner: Any) -> list[torch.Tensor]:
    """The model parameters an optimizer updates (under MasterWeights: those with masters, and fp32 ones)."""
    own = [p for g in inner.param_groups for p in g["params"]]
    return [*inner.model_params(), *own] if isinstance(inner, MasterWeights) else own


def _stash_unscaled(state: _AmpState, opt: Any) -> dict[torch.Tensor, torch.Tensor] | None:
    """Set aside the gradients an earlier loss of this iteration left unscaled, keyed by the tensor they
    belong to (fp32 masters under O2): this loss's backward must start from zero."""
    pending = state.pending.get(id(opt))
    if pending is None or not pending.unscaled:
        return None
    inner = _inner(opt)
    if isinstance(inner, MasterWeights):
        held = [*inner.model_params(), *inner.fp32_params()]  # fp32 ones too: a loss may reach only those
        if held and all(p.grad is None for p in held) and \
                any(m.grad is not None for m in inner.master_params()):
            # model.zero_grad() since that loss (word_language_model's loop): a new iteration, as in torch,
            # where the masters' gradients had been summed into every later .grad the mirror shows
            inner.zero_grad(set_to_none=True)
            return None
        inner.take_grad_edits()  # zeroed in place (zero_grad(set_to_none=False)) or clipped: masters show it
    # master_params: the tensors whose gradients hold the unscaled values (the model's own parameters with
    # master_grads=False, where the masters get no gradient).
    stash = {p: p.grad.clone() for p in _step_params(opt) if p.grad is not None}
    _inner(opt).zero_grad(set_to_none=True)
    return stash or None


def _summed(a: dict[torch.Tensor, torch.Tensor] | None, b: dict[torch.Tensor, torch.Tensor] | None
            ) -> dict[torch.Tensor, torch.Tensor] | None:
    """Two stashes as one: a tensor in both gets the sum of its gradients."""
    if not a or not b:
        return a or b
    return {**a, **b, **{k: a[k] + b[k] for k in a.keys() & b.keys()}}


@torch.no_grad()
def _add_stash(stash: dict[torch.Tensor, torch.Tensor] | None) -> None:
    for param, grad in (stash or {}).items():
        if param.grad is None:
            param.grad = grad
        else:
            param.grad.add_(grad)


# ------------------------------------------------------------------------------------------------ access
def master_params(optimizer: Any) -> Iterator[torch.Tensor]:
    """The parameters the optimizer updates: fp32 masters under O2, the model's parameters otherwise
    (also O2 with ``split_masters``: a clip of these computes in bf16, its norm up to ~1% off the fp32 one;
    ``opt.clip_grad_norm_(max_norm)`` takes it in fp32).
    Clip these: ``torch.nn.utils.clip_grad_norm_(mixprec.master_params(opt), max_norm)``.

    Where the model holds gradients its masters have not received (backward outside ``scale_loss``, or a
    ``MasterWeights`` built by hand, before its step) they are copied to the masters first, as
    ``opt.clip_grad_norm_`` does, and the step uses them: a clip of the masters had clipped nothing. Between
    the micro-steps of a ``delay_unscale`` accumulation they are left where they are (still scaled)."""
    inner = _inner(optimizer)
    if isinstance(inner, MasterWeights):
        if inner.master_grads_pending() and not _delayed(optimizer):
            inner.copy_grads_to_master()
        inner.take_grad_edits()  # a clip of model.parameters() after scale_loss: the masters show it now
    yield from _step_params(inner)


def _delayed(optimizer: Any) -> bool:
    """Whether ``optimizer`` is between the micro-steps of a ``delay_unscale`` accumulation: its masters
    get the gradients at the last ``scale_loss``, as the user arranged."""
    state = getattr(optimizer, _OPT_STATE_ATTR, None)
    pending = state.pending.get(id(optimizer)) if state is not None else None
    return pending is not None and pending.delayed


def _step_params(optimizer: Any) -> Iterator[torch.Tensor]:
    """The tensors whose gradients the step reads, unchecked (see master_params)."""
    inner = _inner(optimizer)
    if isinstance(inner, MasterWeights):
        # master_grads=False: the masters have no gradient; the step reads (and a clip must scale) the
        # model's half gradients, unscaled in place by scale_loss.
        yield from inner.master_params() if inner.keeps_master_grads else inner.scaled_grad_params()
        return
    for group in inner.param_groups:
        yield from group["params"]


# apex's private attribute stash, which apex-era scripts read the loss scale from
# (``amp._amp_state.loss_scalers[0].loss_scale()``): a view of the latest initialize's state
_amp_state = AmpStateView(_state)


def loss_scaler(loss_id: int = 0, optimizer: Any = None) -> GradScaler:
    """The GradScaler behind ``loss_id`` (e.g. ``loss_scaler().get_scale()`` for a gradient penalty) of
    the latest ``initialize``, or of the one that returned ``optimizer``: with a model per ``initialize``
    call (a GAN's critic, then its generator), the critic's penalty must read the critic's scale."""
    if optimizer is None:
        return _scaler_of(_state(), loss_id)
    state = getattr(optimizer, _OPT_STATE_ATTR, None)
    if state is None:
        raise ConfigError(
            f"loss_scaler(optimizer=...) got a {type(optimizer).__name__} that no mixprec.initialize "
            "returned.",
            "pass the optimizer initialize returned (model, opt = mixprec.initialize(model, opt, ...)).",
        )
    return _scaler_of(state, loss_id)


def _scaler_of(state: _AmpState, loss_id: int) -> GradScaler:
    if not 0 <= loss_id < len(state.scalers):
        raise ConfigError(
            f"loss_id {loss_id} is out of range: initialize was called with num_losses={len(state.scalers)}.",
            f"pass num_losses={loss_id + 1} (or more) to mixprec.initialize.",
        )
    return state.scalers[loss_id]


# How many autograd nodes nearest the loss are searched for a binary cross-entropy: a loss is usually that
# op itself, or a sum or scaling of a few losses; the search costs ~1 us a node, once per scale_loss.
_BCE_SEARCH = 16


def _refuse_half_bce(loss: torch.Tensor) -> None:
    """apex's O1 refused ``F.binary_cross_entropy`` (``nn.BCELoss``) of half probabilities wherever it ran:
    the sigmoid before it saturates in half (1.0 above x ~ 8.3 in fp16, ~6.2 in bf16), and a confident
    model's loss and gradients go inf/NaN, every step skipped (a DCGAN's discriminator). mixprec's O1
    computes the loss outside the model's region, where the policy's ban cannot see it, from the output
    cast to fp32 after the sigmoid; the loss's own autograd graph shows where the probabilities came from."""
    todo, searched = collections.deque([loss.grad_fn]), 0
    while todo and searched < _BCE_SEARCH:
        node = todo.popleft()
        if node is None:
            continue
        searched += 1
        dtype = _probabilities_dtype(node) if "BinaryCrossEntropyBackward" in type(node).__name__ else None
        if dtype in HALF_DTYPES:
            raise BannedOpError(
                f"binary_cross_entropy (nn.BCELoss) got probabilities computed in {dtype} under O1, which "
                "apex's O1 refused: a sigmoid computed in half precision rounds to 1.0 for logits above ~8 "
                "(fp16; ~6 in bf16), and the loss and its gradients become inf/NaN.",
                BCE_ADVICE,
            )
        todo.extend(fn for fn, _ in node.next_functions)


# Nodes that pass probabilities on unchanged in value: the output's cast to fp32, views, copies.
_PASS_THROUGH = ("ToCopyBackward", "ViewBackward", "ReshapeAliasBackward", "SqueezeBackward",
                 "UnsqueezeBackward", "CloneBackward", "ExpandBackward", "PermuteBackward", "TBackward",
                 "SelectBackward", "SliceBackward")


def _probabilities_dtype(bce: Any) -> torch.dtype | None:
    """The dtype BCE's input was computed in: its own, or, behind casts and views, the dtype of the op that
    made it (the sigmoid's saved result); None where the graph does not say."""
    saved = getattr(bce, "_saved_self", None)
    if isinstance(saved, torch.Tensor) and saved.dtype in HALF_DTYPES:
        return saved.dtype
    producer = bce.next_functions[0][0] if bce.next_functions else None
    while producer is not None and type(producer).__name__.startswith(_PASS_THROUGH):
        producer = producer.next_functions[0][0] if producer.next_functions else None
    for name in ("_saved_result", "_saved_self"):
        made = getattr(producer, name, None)
        if isinstance(made, torch.Tensor):
            return made.dtype
    return None


def loss_scalers_of(optimizers: Sequence[Any]) -> list[GradScaler]:
    """The loss scalers of the ``initialize`` calls that returned these optimizers, in order (none for an
    optimizer initialize did not return): what a checkpoint of an apex-style run must hold."""
    states = [getattr(opt, _OPT_STATE_ATTR, None) for opt in optimizers]
    unique = list({id(s): s for s in states if s is not None}.values())
    return [scaler for state in unique for scaler in state.scalers]


def restore(model: nn.Module) -> nn.Module:
    """Undo ``initialize`` on ``model``, in place: its hooks and forward wrappers come off and its half
    parameters become fp32 again, holding their masters' values (not their half rounding); float buffers
    (RoPE's inv_freq), unless changed since, their values from before initialize (and buffers registered
    since in the half dtype, a KV cache, fp32); parameters without a
    master (frozen, or at O3) their half values upcast (load the fp32 weights where those must be exact).
    For exporting
    or evaluating the trained model in fp32: ``model.float()`` alone leaves the input hook that casts to
    half. Training goes on with a new optimizer over the restored parameters. Returns ``model``."""
    half = None if _STATE is None else next((h for h in _STATE.models if h.model is model), None)
    if half is None:
        # A model torch.load gave back (another process: no initialize at all) lands here too.
        raise ConfigError(
            f"{type(model).__name__} is not a model the last mixprec.initialize of this process prepared (or "
            "it was restored already, or loaded with torch.load: its masters are not in it).",
            "pass the model initialize returned, before initializing other models, and restore before "
            "saving; for an fp32 copy of a saved O2/O3 model, build the fp32 model and call "
            "fp32_model.load_state_dict(saved_model.state_dict()) (its state dict is fp32).",
        )
    half.check_parameters_kept()  # before anything changes
    state = _state()
    # a LARC-style wrapper holds the MasterWeights as its .optim
    inners = [_inner(opt) for opt in state.optimizers]
    mine = {getattr(c.module, c.name) for c in half.converted if c.is_param}  # this model's half parameters
    split = {k: v for m in inners if isinstance(m, LowPrecisionOptimizer)
             for k, v in split_master_values(m, mine).items()}
    half.restore(*(m for m in inners if isinstance(m, MasterWeights)), values=split)
    for watches in state.watches.values():
        remove_watches(watches, model)
    state.models.remove(half)
    model.__dict__.pop("_mixprec_opt_level", None)
    return model


def split_master_values(opt: LowPrecisionOptimizer, among: set[torch.Tensor]) -> dict[int, torch.Tensor]:
    """The fp32 values of the split masters of ``among``'s parameters (one model's: another model of the
    same initialize may be restored, fp32, already), by the parameter's id as ``HalfModel.restore`` takes
    them: the bf16 weight and the low half put together (``model.load_state_dict`` sets both halves:
    mixprec.split_state_dict)."""
    params = [p for g in opt.param_groups for p in g["params"] if p in among]
    return {id(p): v for p, v in zip(params, opt.master_values(params), strict=True)}


# ------------------------------------------------------------------------------------------------ registry
# apex.amp's function registry: register_*_function(module, "name") are mixprec.policy's (they work at any
# time, not only before initialize), and the decorators are the same registrations of your own function.


def half_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """apex's ``@amp.half_function``: ``fn``'s floating tensor arguments are cast to the half dtype inside
    mixprec's precision regions (O1's autocast, an O2 model's forward)."""
    return register_half_function(fn)


def float_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """apex's ``@amp.float_function``: ``fn`` runs in fp32 inside mixprec's precision regions."""
    return register_float_function(fn)


def promote_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """apex's ``@amp.promote_function``: ``fn`` runs in its widest floating input dtype inside regions."""
    return register_promote_function(fn)


def reset() -> None:
    """Forget the state of the last ``initialize`` (its scalers and pending steps). The models keep their
    dtype and hooks: build fresh models to initialize again."""
    global _STATE
    _STATE = None


# The key of each amp.state_dict() entry that holds the scaler's full state, beside apex's two.
MIXPREC_KEY = "mixprec"


def state_dict(destination: MutableMapping[str, Any] | None = None) -> MutableMapping[str, Any]:
    """Every loss scaler's state in apex's format, ``{"loss_scaler0": {"loss_scale": ..., "unskipped":
    ...}, ...}`` (an OrderedDict, or written into ``destination`` and returned, as apex's). Each entry also
    holds the scaler's full state under ``"mixprec"`` (growth settings, hysteresis, history: what an exact
    resume needs), one key apex's loader ignores and a printout can skip. ``unskipped`` counts the clean
    iterations since the last overflow, at a static scale too. Reads the scale: one host sync."""
    out: MutableMapping[str, Any] = OrderedDict() if destination is None else destination
    for i, scaler in enumerate(_state().scalers):
        full = scaler.state_dict()
        out[f"loss_scaler{i}"] = {
            "loss_scale": scaler.get_scale(),
            "unskipped": int(full.get("_growth_tracker", 0)),
            MIXPREC_KEY: full,
        }
    return out


def load_state_dict(saved: dict[str, Any]) -> None:
    """Load :func:`state_dict`'s output, or a checkpoint written by apex (``loss_scale``/``unskipped``
    only: the scale and the count of clean steps since the last overflow, into this run's kind of scaling,
    as apex loaded them). mixprec's own state of a dynamic scale into a static one, or back (a bf16 run's
    into an fp16 one), raises ``CheckpointError``: it would replace this run's loss scaling."""
    scalers = _state().scalers
    if len(saved) != len(scalers):
        raise ConfigError(
            f"The saved amp state has {len(saved)} loss scaler(s), this run has {len(scalers)}.",
            "call initialize with the same num_losses as the run that saved it.",
        )
    for i, scaler in enumerate(scalers):
        entry = saved.get(f"loss_scaler{i}")
        if not isinstance(entry, dict):
            raise ConfigError(
                f"The saved amp state has no entry 'loss_scaler{i}'.",
                "pass what mixprec.amp.state_dict() (or apex's amp.state_dict()) returned.",
            )
        if isinstance(entry.get(MIXPREC_KEY), dict):  # apex's two keys keep this run's kind of scaling
            check_scaler(i, scaler, entry[MIXPREC_KEY])  # a bf16 run's static 1 into fp16's dynamic, say
        scaler.load_state_dict(_full_scaler_state(scaler, entry))


def _full_scaler_state(scaler: GradScaler, entry: dict[str, Any]) -> dict[str, Any]:
    if isinstance(entry.get(MIXPREC_KEY), dict):
        return dict(entry[MIXPREC_KEY])
    if "scale" in entry:  # written by mixprec before the full state moved under MIXPREC_KEY: flat
        return {k: v for k, v in entry.items() if k not in ("loss_scale", "unskipped")}
    if "loss_scale" not in entry:
        raise ConfigError("An apex loss scaler entry needs 'loss_scale'.",
                          "pass what apex's amp.state_dict() returned.")  # fmt: skip
    full = scaler.state_dict()  # this run's settings; the saved scale and clean-step count
    full["scale"] = float(entry["loss_scale"])
    if full["scale"] < scaler.scale_floor:  # apex has no floor unless min_loss_scale sets one
        raise ConfigError(
            f"The apex checkpoint's loss scale {full['scale']:g} is below this run's scale floor "
            f"{scaler.scale_floor:g} (mixprec's default floor: below 1 an unscaled gradient can overflow "
            "after the inf check; apex has none).",
            f"pass min_loss_scale={full['scale']:g} (or lower) to mixprec.initialize to resume at it.",
        )
    full["_growth_tracker"] = int(entry.get("unskipped", 0))
    return full
