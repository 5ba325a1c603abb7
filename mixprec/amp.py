"""apex-style opt levels: ``initialize``, ``scale_loss``, ``master_params`` and the loss scalers' state.

An opt level is a named preset of one :class:`Properties` dataclass, exactly as apex.amp defined them:

======  ===============  =====================  ===================  ==============  ===========
level   cast_model_type  patch_torch_functions  keep_batchnorm_fp32  master_weights  loss_scale
======  ===============  =====================  ===================  ==============  ===========
O0      float32          False                  None                 False           1.0
O1      None             True                   None                 None            "dynamic"
O2      half             False                  True                 True            "dynamic"
O3      half             False                  False                False           1.0
======  ===============  =====================  ===================  ==============  ===========

Nothing here owns numerics: the pieces are the library's one ``GradScaler`` (one per loss), one
``MasterWeights`` optimizer wrapper and one ``autocast`` engine. What this module adds is arrangement:

* ``patch_torch_functions`` (O1): apex monkey-patched torch's functions globally. We do not patch globals;
  the model's forward runs inside ``mixprec.autocast`` (a pre-hook enters the region, an always-called
  forward hook leaves it), and its floating outputs are returned in fp32 so a loss computed outside the
  model runs in fp32, which is what apex's patched loss functions achieved.
* ``cast_model_type`` (O2/O3): the model is cast in place (parameter objects keep their identity, so the
  optimizer built before ``initialize`` still refers to them); floating inputs are cast to the model's
  dtype on the way in and outputs to fp32 on the way out. Where the device has no fast fp16 GEMM (CPU),
  the forward runs inside ``half_compute``: fp16 GEMMs accumulate in fp32 on exact upcasts, as tensor
  cores do.
* ``master_weights`` (O2): the optimizer is wrapped in :class:`~mixprec.master.MasterWeights`.
* ``loss_scale``: one :class:`~mixprec.scaler.GradScaler` per loss (``num_losses``); a number gives a
  static scale, "dynamic" a dynamic one (init 2**16, apex's ``max_loss_scale`` 2**24 cap).

``scale_loss`` unscales when its block exits and updates that loss's scaler; the optimizer's next
``step()`` is skipped if a gradient was inf/NaN. The step decides without a host sync when the optimizer
can skip on the device (torch's fused optimizers, which ``MasterWeights`` selects when it can); otherwise it
reads the inf flag once, as apex did.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from mixprec.autocast import autocast, half_compute, map_tensors
from mixprec.errors import ConfigError, ScalerStateError
from mixprec.master import (
    HALF_DTYPES,
    Converted,
    MasterWeights,
    check_params_belong,
    fp32_originals,
    model_to_half,
)
from mixprec.scaler import DEFAULT_INIT_SCALE, GradScaler, device_skip_is_safe

__all__ = [
    "Properties",
    "OPT_LEVELS",
    "initialize",
    "scale_loss",
    "master_params",
    "loss_scaler",
    "reset",
    "state_dict",
    "load_state_dict",
]

HALF = HALF_DTYPES  # the half dtypes of mixprec.master: one definition
DYNAMIC = "dynamic"
# apex's dynamic scaler: starts at 2**16 and never grows past 2**24 (larger scales only buy overflows).
DEFAULT_MAX_LOSS_SCALE = 2.0**24


@dataclass(frozen=True)
class Properties:
    """What an opt level does. ``None`` means "not applicable at this level"."""

    opt_level: str
    description: str
    cast_model_type: torch.dtype | None
    patch_torch_functions: bool
    keep_batchnorm_fp32: bool | None
    master_weights: bool | None
    loss_scale: float | str
    half_dtype: torch.dtype = torch.float16  # what "half" means at this level: fp16 (apex) or bf16
    enabled: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.loss_scale, str) and self.loss_scale != DYNAMIC:
            raise ConfigError(
                f"loss_scale must be a positive number or 'dynamic', got {self.loss_scale!r}.",
                "pass loss_scale='dynamic' or e.g. loss_scale=128.0.",
            )
        if not isinstance(self.loss_scale, str) and not float(self.loss_scale) > 0:
            raise ConfigError(
                f"loss_scale must be positive, got {self.loss_scale!r}.", "pass e.g. loss_scale=128.0."
            )
        casts_half = self.cast_model_type in HALF
        if self.patch_torch_functions and casts_half:
            raise ConfigError(
                f"{self.opt_level}: patch_torch_functions=True (the O1 cast policy) together with casting "
                f"the model to {self.cast_model_type} contradicts itself.",
                "use opt_level='O1' for the cast policy with fp32 weights, or O2/O3 for a half model.",
            )
        if self.master_weights and not casts_half:
            raise ConfigError(
                f"{self.opt_level}: master_weights=True, but the model's weights stay fp32, so they already "
                "are the master weights.",
                "use opt_level='O2' for a half model with fp32 master weights, or drop master_weights.",
            )
        if self.keep_batchnorm_fp32 is not None and not casts_half:
            raise ConfigError(
                f"{self.opt_level}: keep_batchnorm_fp32 only applies when the model is cast to half "
                "precision.",
                "drop keep_batchnorm_fp32, or use opt_level='O2'/'O3'.",
            )

    @property
    def casts_model(self) -> bool:
        return self.cast_model_type in HALF

    def overridden(self, **overrides: Any) -> Properties:
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def with_dtype(self, dtype: torch.dtype) -> Properties:
        """The same level for another half dtype. bf16 has fp32's exponent range, so gradients do not
        underflow: its default loss scale is a static 1.0."""
        cast = dtype if self.casts_model else self.cast_model_type
        scale: float | str = 1.0 if dtype == torch.bfloat16 else self.loss_scale
        return dataclasses.replace(self, cast_model_type=cast, loss_scale=scale, half_dtype=dtype)


OPT_LEVELS: dict[str, Properties] = {
    "O0": Properties("O0", "Pure FP32 training.", torch.float32, False, None, False, 1.0),
    "O1": Properties("O1", "Insert automatic casts around PyTorch functions and Tensor methods.",
                     None, True, None, None, DYNAMIC),
    "O2": Properties("O2", "FP16 training with FP32 batchnorm and FP32 master weights.",
                     torch.float16, False, True, True, DYNAMIC),
    "O3": Properties("O3", "Pure FP16 training.", torch.float16, False, False, False, 1.0),
}  # fmt: skip


# ------------------------------------------------------------------------------------------------ state
@dataclass
class _PendingStep:
    """Inf flags recorded by ``scale_loss`` for one optimizer, consumed by its next ``step()``."""

    found_infs: list[torch.Tensor] = field(default_factory=list)
    unscaled: bool = False  # grads currently hold unscaled values from an earlier loss this iteration
    stepped: bool = False  # step() has consumed these flags; another step() would reuse the gradients


@dataclass
class _AmpState:
    properties: Properties
    device_type: str
    scalers: list[GradScaler]
    models: list[nn.Module]
    pending: dict[int, _PendingStep] = field(default_factory=dict)


_STATE: _AmpState | None = None


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


def initialize(
    models: nn.Module | Sequence[nn.Module],
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    opt_level: str = "O1",
    *,
    dtype: torch.dtype = torch.float16,
    cast_model_type: torch.dtype | None = None,
    patch_torch_functions: bool | None = None,
    keep_batchnorm_fp32: bool | None = None,
    master_weights: bool | None = None,
    loss_scale: float | str | None = None,
    num_losses: int = 1,
    min_loss_scale: float | None = None,
    max_loss_scale: float = DEFAULT_MAX_LOSS_SCALE,
    verbosity: int = 1,
) -> Any:
    """Prepare models and optimizers for mixed precision at an apex opt level.

    Returns the same structure it was given: ``model, optimizer``; ``[models], [optimizers]``; or just the
    model(s) when no optimizer is passed. Build the optimizers before calling this, over the fp32 model."""
    global _STATE
    props = _resolve_properties(
        opt_level,
        dtype,
        cast_model_type,
        patch_torch_functions,
        keep_batchnorm_fp32,
        master_weights,
        loss_scale,
    )
    model_list, models_were_list = _as_list(models)
    opt_list, opts_were_list = _as_list(optimizers)
    _check_models_and_optimizers(model_list, opt_list)
    device_type = _device_type(model_list)
    if verbosity > 0:
        _print_properties(props)
    originals: dict[torch.Tensor, torch.Tensor] = {}
    for model in model_list:
        originals.update(fp32_originals(_prepare_model(model, props, device_type)))
    if props.master_weights:
        # Seeded from the fp32 weights, not their half rounding: the same masters as MixedPrecision's.
        opt_list = [MasterWeights(opt, model=None, initial=originals) for opt in opt_list]
    scalers = [_make_scaler(props, device_type, min_loss_scale, max_loss_scale) for _ in range(num_losses)]
    _STATE = _AmpState(props, device_type, scalers, model_list)
    for opt in opt_list:
        _patch_step(opt)
    out_models: Any = model_list if models_were_list else model_list[0]
    if optimizers is None:
        return out_models
    return out_models, (opt_list if opts_were_list else opt_list[0])


def _resolve_properties(
    opt_level: str,
    dtype: torch.dtype,
    cast_model_type: torch.dtype | None,
    patch_torch_functions: bool | None,
    keep_batchnorm_fp32: bool | None,
    master_weights: bool | None,
    loss_scale: float | str | None,
) -> Properties:
    if opt_level not in OPT_LEVELS:
        raise ConfigError(
            f"Unknown opt_level {opt_level!r}.",
            f"use one of {', '.join(OPT_LEVELS)} (letter O, not zero: 'O1', not '01').",
        )
    if not (isinstance(dtype, torch.dtype) and dtype in HALF):
        raise ConfigError(
            f"dtype must be torch.float16 or torch.bfloat16, got {dtype!r}.",
            "integer dtypes are for quantization; use opt_level='O0' for fp32.",
        )
    base = OPT_LEVELS[opt_level]
    if opt_level != "O0":
        base = base.with_dtype(dtype)
    return base.overridden(
        cast_model_type=cast_model_type,
        patch_torch_functions=patch_torch_functions,
        keep_batchnorm_fp32=keep_batchnorm_fp32,
        master_weights=master_weights,
        loss_scale=loss_scale,
    )


def _check_models_and_optimizers(models: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
    if not models or not all(isinstance(m, nn.Module) for m in models):
        raise ConfigError(
            "initialize expects an nn.Module or a list of them as its first argument.",
            "call mixprec.initialize(model, optimizer, opt_level='O2').",
        )
    for model in models:
        if getattr(model, "_mixprec_opt_level", None) is not None:
            raise ConfigError(
                f"initialize was already called on this {type(model).__name__} "
                f"(opt level {model._mixprec_opt_level}).",
                "call mixprec.initialize once per model, with every optimizer and the number of losses.",
            )
    for i, opt in enumerate(optimizers):
        if not isinstance(opt, torch.optim.Optimizer) or isinstance(opt, MasterWeights):
            raise ConfigError(
                f"optimizers[{i}] is a {type(opt).__name__}, not a plain torch.optim.Optimizer.",
                "pass the optimizer you built over the model's parameters; initialize adds master weights.",
            )
        check_params_belong(opt, models, label=f"optimizers[{i}]")


def _device_type(models: list[nn.Module]) -> str:
    types_ = {p.device.type for m in models for p in m.parameters()}
    if len(types_) > 1:
        raise ConfigError(
            f"The models' parameters live on several device types: {sorted(types_)}.",
            "move every model to one device (model.to(device)) before initialize.",
        )
    return types_.pop() if types_ else "cpu"


def _make_scaler(
    props: Properties, device_type: str, min_scale: float | None, max_scale: float
) -> GradScaler:
    dynamic = props.loss_scale == DYNAMIC
    # Without master weights (O3, O2 with master_weights=False) the optimizer steps on the half gradients
    # in place: allow that explicitly. A static scale (even 1.0) still goes through the scaler, so
    # overflowing steps are skipped rather than written into the weights.
    return GradScaler(
        device_type,
        init_scale=DEFAULT_INIT_SCALE if dynamic else float(props.loss_scale),
        dynamic=dynamic,
        min_scale=min_scale if dynamic else None,
        max_scale=max_scale if dynamic else None,
        allow_fp16_grads=not props.master_weights,
    )


def _print_properties(props: Properties) -> None:
    print(f"Selected optimization level {props.opt_level}:  {props.description}")
    for f in dataclasses.fields(props):
        if f.name not in ("description",):
            print(f"{f.name:<22} : {getattr(props, f.name)}")


# ------------------------------------------------------------------------------------------------ models


def _prepare_model(model: nn.Module, props: Properties, device_type: str) -> list[Converted]:
    """Cast the model as ``props`` say and hook its forward; returns what was cast (with the fp32 values
    before rounding, which seed the O2 masters)."""
    model._mixprec_opt_level = props.opt_level  # type: ignore[assignment]
    converted: list[Converted] = []
    if props.casts_model:
        dtype = props.cast_model_type
        assert dtype is not None  # casts_model says it is a half dtype
        converted = model_to_half(model, dtype, keep_bn_fp32=bool(props.keep_batchnorm_fp32))
        model.register_forward_pre_hook(_CastInputs(dtype), with_kwargs=True)
    if props.patch_torch_functions or props.casts_model:
        model.register_forward_pre_hook(_EnterRegion(props, device_type), with_kwargs=True)
        model.register_forward_hook(_LeaveRegion(), always_call=True)
    if props.opt_level != "O0":
        model.register_forward_hook(_outputs_to_fp32)
    return converted


def _cast_floating(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t


class _CastInputs:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        cast = functools.partial(_cast_floating, dtype=self.dtype)
        return map_tensors(cast, args), map_tensors(cast, kwargs)


class _EnterRegion:
    """Enters the forward's precision context: the O1 cast policy, or half compute for O2/O3."""

    def __init__(self, props: Properties, device_type: str) -> None:
        self.props = props
        self.device_type = device_type

    def _context(self) -> contextlib.AbstractContextManager[Any]:
        if self.props.patch_torch_functions:
            return autocast(self.device_type, dtype=self.props.half_dtype)
        return half_compute(self.device_type, self.props.half_dtype)

    def __call__(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        ctx = self._context()
        ctx.__enter__()
        module.__dict__.setdefault("_mixprec_regions", []).append(ctx)


class _LeaveRegion:
    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        regions = module.__dict__.get("_mixprec_regions")
        if regions:
            regions.pop().__exit__(None, None, None)


def _outputs_to_fp32(module: nn.Module, args: Any, output: Any) -> Any:
    return map_tensors(lambda t: t.float() if t.dtype in HALF else t, output)


# ------------------------------------------------------------------------------------------------ steps
def _patch_step(opt: torch.optim.Optimizer) -> None:
    """Route ``opt.step()`` through the inf flags ``scale_loss`` recorded (a bound method, so LR
    schedulers can wrap it as they wrap any optimizer's step)."""
    opt._mixprec_plain_step = opt.step  # type: ignore[attr-defined]
    opt.step = types.MethodType(_amp_step, opt)  # type: ignore[method-assign]


def _amp_step(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
    plain = opt._mixprec_plain_step  # type: ignore[attr-defined]
    pending = _STATE.pending.get(id(opt)) if _STATE is not None else None
    if pending is None or not pending.found_infs:
        return plain(*args, **kwargs)
    if pending.stepped:
        raise ScalerStateError(
            "optimizer.step() was called twice for one scale_loss: the second step would apply the same "
            "gradients again (and, after an overflow, write their inf/NaN into the weights).",
            "call optimizer.zero_grad() and run the next forward/backward inside scale_loss before stepping.",
        )
    pending.stepped = True
    found = torch.stack([f.to(pending.found_infs[0].device) for f in pending.found_infs]).sum()
    if getattr(opt, "_step_supports_amp_scaling", False) and device_skip_is_safe(opt):
        # fused optimizers skip on the device: no host sync
        opt.found_inf, opt.grad_scale = found, None  # type: ignore[attr-defined]
        try:
            return plain(*args, **kwargs)
        finally:
            del opt.found_inf, opt.grad_scale  # type: ignore[attr-defined]
    if found.item() == 0:  # one sync, as apex
        return plain(*args, **kwargs)
    opt._opt_called = True  # type: ignore[attr-defined]  # skipped, but called in order (see GradScaler.step)
    return None


@contextlib.contextmanager
def scale_loss(
    loss: torch.Tensor,
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    loss_id: int = 0,
    model: nn.Module | None = None,
    delay_unscale: bool = False,
) -> Iterator[torch.Tensor]:
    """``with scale_loss(loss, optimizer) as scaled: scaled.backward()``.

    On exit the gradients are unscaled (into the fp32 masters under O2) and checked; the optimizer's next
    ``step()`` is skipped if any was inf/NaN, and this loss's scaler is updated. Several losses may feed
    one optimizer in an iteration: gradients already unscaled for an earlier loss are set aside and added
    back after this loss's are unscaled. ``delay_unscale=True`` leaves the gradients scaled (accumulate,
    then let the last ``scale_loss`` of the iteration unscale them all with the same scale)."""
    state = _state()
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ConfigError(
            f"scale_loss got a loss of shape {shape}; it scales one scalar loss.",
            "reduce it first: loss.mean() (or loss.sum()).",
        )
    if not 0 <= loss_id < len(state.scalers):
        raise ConfigError(
            f"loss_id {loss_id} is out of range: initialize was called with num_losses={len(state.scalers)}.",
            f"pass num_losses={loss_id + 1} (or more) to mixprec.initialize.",
        )
    opts, _ = _as_list(optimizers)
    scaler = state.scalers[loss_id]
    for opt in opts:  # a new iteration for these optimizers: flags of a consumed step are done
        if id(opt) in state.pending and state.pending[id(opt)].stepped:
            del state.pending[id(opt)]
    stashes = {id(opt): _stash_unscaled(state, opt) for opt in opts}
    yield scaler.scale(loss)
    if delay_unscale:
        return
    for opt in opts:
        scaler.unscale_(opt)
        _add_stash(stashes[id(opt)])
        pending = state.pending.setdefault(id(opt), _PendingStep())
        pending.found_infs.extend(scaler._found_inf_per_device(opt).values())
        pending.unscaled = True
    scaler.update()


def _stash_unscaled(state: _AmpState, opt: torch.optim.Optimizer) -> dict[torch.Tensor, torch.Tensor] | None:
    """Set aside the gradients an earlier loss of this iteration left unscaled, keyed by the tensor they
    belong to (fp32 masters under O2): this loss's backward must start from zero."""
    pending = state.pending.get(id(opt))
    if pending is None or not pending.unscaled:
        return None
    stash = {p: p.grad.clone() for g in opt.param_groups for p in g["params"] if p.grad is not None}
    opt.zero_grad(set_to_none=True)
    return stash or None


@torch.no_grad()
def _add_stash(stash: dict[torch.Tensor, torch.Tensor] | None) -> None:
    for param, grad in (stash or {}).items():
        if param.grad is None:
            param.grad = grad
        else:
            param.grad.add_(grad)


# ------------------------------------------------------------------------------------------------ access
def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The parameters the optimizer updates: fp32 masters under O2, the model's parameters otherwise.
    Clip these: ``torch.nn.utils.clip_grad_norm_(mixprec.master_params(opt), max_norm)``."""
    if isinstance(optimizer, MasterWeights):
        yield from optimizer.master_params()
        return
    for group in optimizer.param_groups:
        yield from group["params"]


def loss_scaler(loss_id: int = 0) -> GradScaler:
    """The GradScaler behind ``loss_id`` (e.g. ``loss_scaler().get_scale()`` for a gradient penalty)."""
    return _state().scalers[loss_id]


def reset() -> None:
    """Forget the state of the last ``initialize`` (its scalers and pending steps). The models keep their
    dtype and hooks: build fresh models to initialize again."""
    global _STATE
    _STATE = None


def state_dict() -> dict[str, Any]:
    """Every loss scaler's state, keyed ``loss_scaler0``, ``loss_scaler1``, ... as apex did."""
    return {f"loss_scaler{i}": s.state_dict() for i, s in enumerate(_state().scalers)}


def load_state_dict(saved: dict[str, Any]) -> None:
    scalers = _state().scalers
    if len(saved) != len(scalers):
        raise ConfigError(
            f"The saved amp state has {len(saved)} loss scaler(s), this run has {len(scalers)}.",
            "call initialize with the same num_losses as the run that saved it.",
        )
    for i, scaler in enumerate(scalers):
        scaler.load_state_dict(saved[f"loss_scaler{i}"])
