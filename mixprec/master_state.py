"""Saving and loading MasterWeights: the wrapper's state_dict carries the fp32 masters; the wrapped
optimizer's alone does not, so saving it warns and loading it re-seeds the masters from the model.

Without the guard, a checkpoint of ``opt.optimizer`` resumed with the masters of before the load, and the
first step wrote those stale values over the loaded model.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from mixprec.errors import ConfigError, MasterStateWarning

__all__ = ["InnerOptimizerGuard", "check_state_shapes", "split_master_state", "warn_reseeded"]

LEGACY_KEYS = {"optimizer", "masters", "flat"}  # mixprec 0.1 nested the optimizer's state


class InnerOptimizerGuard:
    """Hooks on the wrapped optimizer for the calls a user makes on it directly; the wrapper's own calls
    run inside :meth:`own` and pass unremarked."""

    def __init__(self, optimizer: torch.optim.Optimizer, reseed: Callable[[], None]) -> None:
        self._own = False
        self._reseed = reseed
        optimizer.register_state_dict_pre_hook(self._saved)
        optimizer.register_load_state_dict_post_hook(self._loaded)

    @contextmanager
    def own(self) -> Iterator[None]:
        self._own = True
        try:
            yield
        finally:
            self._own = False

    def _saved(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._own:
            warnings.warn(MasterStateWarning(
                "The wrapped optimizer's state_dict has no fp32 master weights: a resume from it restarts "
                "the masters from the half-precision model, losing the bits fp32 keeps.",
                "save the MasterWeights wrapper's state: opt.state_dict() (and load it with "
                "opt.load_state_dict).",
            ), stacklevel=5)  # the user's call, past torch's state_dict and its dynamo guard

    def _loaded(self, optimizer: torch.optim.Optimizer) -> None:
        if self._own:
            return
        # The masters still hold their values of before the load; seed them from the (loaded) model
        # instead, an exact upcast: the best this state allows.
        self._reseed()
        warn_reseeded(stacklevel=6)  # the user's call, past torch's state_dict and its dynamo guard


def warn_reseeded(stacklevel: int) -> None:
    """An optimizer state without masters was loaded: the masters now come from the model."""
    warnings.warn(MasterStateWarning(
        "An optimizer state without master weights was loaded; the masters were re-seeded from the model's "
        "half-precision parameters (load the model first).",
        "to keep fp32's bits across a resume, save and load the wrapper: opt.state_dict() / "
        "opt.load_state_dict(sd).",
    ), stacklevel=stacklevel)


# Optimizer state shaped like its parameter, by key (torch.optim's names).
PARAM_SHAPED = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "exp_inf", "momentum_buffer", "sum", "square_avg",
                "grad_avg", "acc_delta", "prev", "step_size", "ax")


def check_state_shapes(inner_state: dict[str, Any], param_groups: list[dict[str, Any]]) -> None:
    """Raise if a saved moment would land on a tensor of another shape: torch's load_state_dict takes it,
    and the fused kernels then read and write past the tensor (heap corruption, not an error)."""
    for saved, group in zip(inner_state["param_groups"], param_groups, strict=False):
        for i, p in zip(saved["params"], group["params"], strict=False):
            for key, value in inner_state["state"].get(i, {}).items():
                if key in PARAM_SHAPED and isinstance(value, torch.Tensor) and value.shape != p.shape:
                    raise ConfigError(
                        f"The saved optimizer state {key!r} of shape {tuple(value.shape)} would load onto a "
                        f"tensor of shape {tuple(p.shape)}.",
                        "load a checkpoint saved from the same model and param groups (and the same "
                        "MasterWeights layout).",
                    )


def split_master_state(
    state_dict: Any, views: list[torch.Tensor], flat: bool
) -> tuple[dict[str, Any], list[torch.Tensor] | None]:
    """The wrapped optimizer's part of ``state_dict`` and the saved masters (None for a plain optimizer's
    state_dict, as apex O2 users load one saved before ``initialize``). Raises unless it fits ``views``.

    Accepted: the wrapper's own (a plain optimizer's ``state``/``param_groups`` plus ``masters`` and
    ``flat``), mixprec 0.1's (``optimizer``/``masters``/``flat``), and a plain optimizer's."""
    if not isinstance(state_dict, dict) or not ({"state", "param_groups"} <= set(state_dict)
                                                or LEGACY_KEYS <= set(state_dict)):  # fmt: skip
        raise ConfigError(
            "This is not an optimizer state_dict (expected state and param_groups, plus masters and flat "
            "from a MasterWeights).",
            "pass what opt.state_dict() returned.",
        )
    if "optimizer" in state_dict:  # mixprec 0.1's layout
        inner = state_dict["optimizer"]
    else:
        inner = {k: v for k, v in state_dict.items() if k not in ("masters", "flat", "order")}
    masters = state_dict.get("masters")
    if masters is None:
        return inner, None
    if len(masters) != len(views) or any(m.shape != v.shape for m, v in zip(masters, views, strict=True)):
        raise ConfigError(
            "The saved master weights do not match this model's half-precision parameters.",
            "load a checkpoint saved from the same model architecture and param groups.",
        )
    if state_dict.get("flat", flat) != flat:
        raise ConfigError(
            f"The checkpoint was saved with flat={state_dict['flat']}, this wrapper has flat={flat}.",
            f"construct MasterWeights(..., flat={state_dict['flat']}) to resume it.",
        )
    return inner, masters
