"""fp32 master weights: ``MasterWeights`` wraps any ``torch.optim`` optimizer of a half-precision model.

Why: an update ``lr * grad`` is often smaller than half a unit in the last place of the weight it is added
to. In fp16 (11 significant bits) ``1.0 + 1e-4 == 1.0``, so a model whose weights are stored only in fp16
stops learning once its updates get small. The fix is to keep an fp32 copy of every half-precision weight
(the *master*), let the optimizer update the masters, and round them to half precision only to run the
model. Forward and backward still run in half precision; only the update is fp32.

One training step through this module::

    model (fp16/bf16) --backward--> half grads --copy_grads_to_master--> fp32 master grads
        --(GradScaler: unscale in fp32, find inf/NaN)--> optimizer.step() on the masters
        --copy back (round to nearest)--> model weights

Parameters that are already fp32 (e.g. BatchNorm kept in fp32) are their own masters: no copy.

Two layouts:
  * per parameter (default): one fp32 master per half parameter; optimizer state per parameter.
  * flat (``flat=True``, fastai's ``flat_master``): one contiguous fp32 buffer per param group, which the
    optimizer sees as a single parameter, so its update runs as one long kernel; ``master_views()`` gives
    the per-parameter views of it.

Cost: the copies are ``torch._foreach_copy_`` calls (one kernel each way per group), never a Python loop
of small ops. When the wrapped optimizer is Adam, AdamW or Adagrad and the user left both ``foreach`` and
``fused`` unset, the masters are updated with the fused
kernel: one pass over memory instead of the ~10 of the foreach path, and it can skip an overflowing step
on the device (``GradScaler`` then never syncs). Pass ``fused=False`` to keep the optimizer as it was.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from mixprec.errors import ConfigError, ParameterMismatchError

# re-exported: they lived here before mixprec.half_model
from mixprec.half_model import BATCHNORM, HALF_DTYPES, Converted, fp32_originals, model_to_half

__all__ = [
    "MasterWeights",
    "HALF_DTYPES",
    "BATCHNORM",
    "Converted",
    "check_params_belong",
    "model_to_half",
    "fp32_originals",
]

@dataclass
class _GroupMasters:
    """The model's half parameters of one param group and the fp32 tensors that shadow them."""

    model: list[torch.Tensor]  # half-precision model parameters, in group order
    views: list[torch.Tensor]  # their fp32 masters (per-parameter tensors, or views of `flat`)
    flat: torch.Tensor | None  # the contiguous fp32 buffer in flat mode, else None
    # fp32 gradient storage, allocated once and re-attached as `.grad` after each zero_grad(set_to_none):
    # users see None between iterations, the step does not allocate a model-sized buffer every time.
    grad_buffers: list[torch.Tensor] | None = None  # aligned with `model` (views of one buffer when flat)
    flat_grad: torch.Tensor | None = None

    def _buffers(self) -> list[torch.Tensor]:
        if self.grad_buffers is None:
            if self.flat is not None:
                self.flat_grad = torch.empty_like(self.flat)
                self.grad_buffers = _views_like(self.flat_grad, self.model)
            else:
                self.grad_buffers = [torch.empty_like(m) for m in self.views]
        return self.grad_buffers

    def grads_to_fill(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(fp32 master grads, half model grads) to copy, pairwise, with the buffers attached as the
        masters' ``.grad``. A model parameter without a gradient leaves its master gradient None
        (per-parameter) or zero (flat: the buffer has no holes)."""
        have = [p.grad is not None for p in self.model]
        src = [cast(torch.Tensor, p.grad) for p in self.model if p.grad is not None]
        if not src:
            return [], []
        buffers = self._buffers()
        if self.flat is not None:
            self.flat.grad = self.flat_grad
            holes = [b for b, h in zip(buffers, have, strict=True) if not h]
            if holes:
                torch._foreach_zero_(holes)
        else:
            for master, buffer, h in zip(self.views, buffers, have, strict=True):
                master.grad = buffer if h else None
        return [b for b, h in zip(buffers, have, strict=True) if h], src


def _views_like(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    views, offset = [], 0
    for p in like:
        views.append(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return views


def _make_masters(
    half: list[torch.Tensor], flat: bool, initial: Mapping[torch.Tensor, torch.Tensor]
) -> _GroupMasters:
    """fp32 copies of ``half``, or of their fp32 values in ``initial`` (what they were before rounding).
    Converting fp16/bf16 to fp32 is exact, so without ``initial`` the masters start equal to the model."""
    values = [initial.get(p, p).detach() for p in half]
    with torch.no_grad():
        if not flat or not half:
            masters = [v.float().clone().requires_grad_(True) for v in values]
            return _GroupMasters(half, masters, None)
        devices = {p.device for p in half}
        if len(devices) > 1:
            raise ConfigError(
                f"flat=True needs one device per param group, found {sorted(map(str, devices))}.",
                "put parameters of different devices in separate param groups, or use flat=False.",
            )
        buffer = torch.cat([v.reshape(-1).float() for v in values]).requires_grad_(True)
        return _GroupMasters(half, _views_like(buffer.detach(), half), buffer)


# Optimizers whose fused kernel we pick on the user's behalf. Not SGD: in torch 2.13 a fused SGD with
# momentum whose *first* step is skipped (found_inf) leaves its momentum buffer uninitialized (torch.empty),
# and the next step reads garbage -- exactly what a loss scaler's first overflows trigger.
AUTO_FUSED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad)


def _fused_capable(optimizer: torch.optim.Optimizer) -> bool:
    """True when we may pick the fused kernel: a class on AUTO_FUSED and neither foreach nor fused chosen."""
    defaults = optimizer.defaults
    return (
        type(optimizer) in AUTO_FUSED
        and "fused" in defaults
        and defaults.get("fused") is None
        and defaults.get("foreach") is None
        and not defaults.get("differentiable", False)
    )


class MasterWeights(torch.optim.Optimizer):
    """Keep fp32 master weights for a half-precision model and let ``optimizer`` update them.

    Args:
        optimizer: any ``torch.optim`` optimizer built over the model's (fp16/bf16) parameters, before
            its first step. Its param groups are rewired to the masters in place.
        flat: one contiguous fp32 buffer per param group instead of one master per parameter.
        model: if given, every optimized parameter must belong to it (catches a model/optimizer mix-up).
        fused: None picks torch's fused update when the optimizer has one and no choice was made;
            False leaves the optimizer as it was; True requires it.
        initial: fp32 values to seed the masters of these half parameters, keyed by the parameter
            (e.g. :func:`fp32_originals` of :func:`model_to_half`): the weights before they were rounded to
            half precision, so rounding the model loses nothing the masters keep. Default: the half values.

    The wrapper *is* a ``torch.optim.Optimizer`` (LR schedulers accept it) whose ``param_groups`` and
    ``state`` are the wrapped optimizer's. Build schedulers on the wrapper, step the wrapper.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        flat: bool = False,
        model: nn.Module | None = None,
        fused: bool | None = None,
        initial: Mapping[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        _check_wrappable(optimizer, model)
        self.optimizer = optimizer
        self.flat = flat
        # `initial` is used here only: keeping it would hold a second fp32 copy of the model alive.
        self._groups = [self._rewire(group, initial or {}) for group in optimizer.param_groups]
        self._use_fused(optimizer, fused)
        # param_groups, state and defaults are properties reading the wrapped optimizer, so schedulers see
        # one object even after load_state_dict replaces the wrapped optimizer's lists.
        self._optimizer_step_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._patch_step_function()
        self._grads_copied = False

    # ------------------------------------------------------------------ the wrapped optimizer's bookkeeping
    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    # ------------------------------------------------------------------ construction
    def _rewire(self, group: dict[str, Any], initial: Mapping[torch.Tensor, torch.Tensor]) -> _GroupMasters:
        params: list[torch.Tensor] = list(group["params"])
        half = [p for p in params if p.dtype in HALF_DTYPES]
        others = [p for p in params if p.dtype not in HALF_DTYPES]
        masters = _make_masters(half, self.flat, initial)
        shadow = [masters.flat] if masters.flat is not None else masters.views
        group["params"] = shadow + others
        return masters

    def _use_fused(self, optimizer: torch.optim.Optimizer, fused: bool | None) -> None:
        if fused is False or (fused is None and not _fused_capable(optimizer)):
            return
        if "fused" not in optimizer.defaults:
            raise ConfigError(
                f"fused=True, but {type(optimizer).__name__} has no fused implementation in torch.",
                "use fused=None (pick it when available) or one of Adam, AdamW, SGD, Adagrad.",
            )
        devices = {p.device.type for g in optimizer.param_groups for p in g["params"]}
        if fused is None and not devices <= {"cpu", "cuda"}:
            return  # fused kernels of other backends vary; keep the user's choice
        optimizer.defaults["fused"] = True
        for group in optimizer.param_groups:
            group["fused"] = True
            group["foreach"] = False
        optimizer._step_supports_amp_scaling = True  # type: ignore[attr-defined]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of model parameters; their masters are made here."""
        self.optimizer.add_param_group(param_group)
        self._groups.append(self._rewire(self.optimizer.param_groups[-1], {}))

    # ------------------------------------------------------------------ the step
    @property
    def _step_supports_amp_scaling(self) -> bool:  # type: ignore[override]
        return bool(getattr(self.optimizer, "_step_supports_amp_scaling", False))

    @torch.no_grad()
    def copy_grads_to_master(self) -> None:
        """Copy the model's half gradients into the fp32 master gradients (one foreach copy per group).

        fp16/bf16 -> fp32 is exact, so nothing is lost here; the scaler unscales the fp32 copies."""
        for g in self._groups:
            dst, src = g.grads_to_fill()
            if dst:
                torch._foreach_copy_(dst, src)
        self._grads_copied = True

    @torch.no_grad()
    def copy_master_to_model(self) -> None:
        """Round the masters to the model's dtype (round-to-nearest-even) and write them into the model."""
        for g in self._groups:
            if g.model:
                torch._foreach_copy_(g.model, g.views)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Masters <- optimizer update from master gradients; then model <- masters.

        Gradients are copied from the model first unless the scaler already did so in this iteration."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            self._grads_copied = False
        if not self._grads_copied:
            self.copy_grads_to_master()
        forwarded = [a for a in ("grad_scale", "found_inf") if hasattr(self, a)]
        for name in forwarded:  # set by GradScaler for fused optimizers: skip/unscale on the device
            setattr(self.optimizer, name, getattr(self, name))
        try:
            self.optimizer.step()
        finally:
            for name in forwarded:
                delattr(self.optimizer, name)
        self.copy_master_to_model()
        self._grads_copied = False
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of the model's half parameters and of the masters."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for g in self._groups:
            for p in g.model:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()
        self._grads_copied = False

    # ------------------------------------------------------------------ access
    def master_params(self) -> Iterator[torch.Tensor]:
        """The tensors the optimizer updates (fp32 masters, flat buffers, fp32 model params). Clip these."""
        for group in self.param_groups:
            yield from group["params"]

    def master_views(self) -> Iterator[torch.Tensor]:
        """One fp32 master per half model parameter, in model order (views into the buffer when flat)."""
        for g in self._groups:
            yield from g.views

    def model_params(self) -> Iterator[torch.Tensor]:
        """The half-precision model parameters that have masters."""
        for g in self._groups:
            yield from g.model

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state plus the fp32 masters, so a resume never rounds through half."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "masters": [v.detach().clone() for v in self.master_views()],
            "flat": self.flat,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if set(state_dict) != {"optimizer", "masters", "flat"}:
            raise ConfigError(
                "This is not a MasterWeights state_dict (expected keys optimizer, masters, flat).",
                "load a plain optimizer's state into the wrapped one: wrapper.optimizer.load_state_dict(sd).",
            )
        masters = state_dict["masters"]
        views = list(self.master_views())
        if len(masters) != len(views) or any(m.shape != v.shape for m, v in zip(masters, views, strict=True)):
            raise ConfigError(
                "The saved master weights do not match this model's half-precision parameters.",
                "load a checkpoint saved from the same model architecture and param groups.",
            )
        if state_dict["flat"] != self.flat:
            raise ConfigError(
                f"The checkpoint was saved with flat={state_dict['flat']}, this wrapper has "
                f"flat={self.flat}.",
                f"construct MasterWeights(..., flat={state_dict['flat']}) to resume it.",
            )
        with torch.no_grad():
            torch._foreach_copy_(views, [m.to(v.device) for m, v in zip(masters, views, strict=True)])
        # torch's load_state_dict restores each group's saved settings, fused/foreach included; keep the
        # implementation this wrapper chose (the scaler relies on it to skip on the device).
        chosen = [(g.get("fused"), g.get("foreach")) for g in self.optimizer.param_groups]
        self.optimizer.load_state_dict(state_dict["optimizer"])
        for group, (fused, foreach) in zip(self.optimizer.param_groups, chosen, strict=True):
            group["fused"], group["foreach"] = fused, foreach
        self.copy_master_to_model()

    def __repr__(self) -> str:
        layout = "flat" if self.flat else "per-parameter"
        n = sum(v.numel() for v in self.master_views())
        return f"MasterWeights({layout}, {n:,} fp32 master values,\n  {self.optimizer!r})"


def _check_wrappable(optimizer: torch.optim.Optimizer, model: nn.Module | None) -> None:
    if isinstance(optimizer, MasterWeights):
        raise ConfigError(
            "This optimizer already keeps master weights.", "wrap the plain optimizer once, not twice."
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"MasterWeights wraps a torch.optim.Optimizer, got {type(optimizer).__name__}.",
            "build the optimizer first, e.g. MasterWeights(torch.optim.AdamW(model.parameters())).",
        )
    if len(optimizer.state) > 0:
        raise ConfigError(
            "The optimizer has already stepped: its state belongs to the half-precision parameters.",
            "wrap the optimizer right after building it, before its first step.",
        )
    if model is not None:
        check_params_belong(optimizer, [model])


def check_params_belong(optimizer: torch.optim.Optimizer, models: list[nn.Module], label: str = "") -> None:
    """Raise if ``optimizer`` updates a tensor that is not a parameter of one of ``models``."""
    owned = {id(p) for m in models for p in m.parameters()}
    foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in owned]
    if foreign:
        raise ParameterMismatchError(
            f"{len(foreign)} of the {label or 'optimizer'}'s parameters (e.g. shape "
            f"{tuple(foreign[0].shape)}) are not parameters of the given model(s).",
            "build the optimizer from the model's parameters (after any model.half()/.to() call).",
        )
