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

__all__ = ["InnerOptimizerGuard", "check_master_state"]

STATE_KEYS = {"optimizer", "masters", "flat"}


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
        warnings.warn(MasterStateWarning(
            "The wrapped optimizer was loaded without master weights; they were re-seeded from the model's "
            "half-precision parameters (load the model first).",
            "save and load the wrapper: opt.state_dict() / opt.load_state_dict(sd).",
        ), stacklevel=5)  # the user's call, past torch's state_dict and its dynamo guard


def check_master_state(state_dict: Any, views: list[torch.Tensor], flat: bool) -> None:
    """Raise unless ``state_dict`` is a MasterWeights state fitting the masters ``views`` and ``flat``."""
    if not isinstance(state_dict, dict) or set(state_dict) != STATE_KEYS:
        raise ConfigError(
            "This is not a MasterWeights state_dict (expected keys optimizer, masters, flat); a plain "
            "optimizer's state_dict has no masters.",
            "save and load the wrapper: sd = opt.state_dict() ... opt.load_state_dict(sd).",
        )
    masters = state_dict["masters"]
    if len(masters) != len(views) or any(m.shape != v.shape for m, v in zip(masters, views, strict=True)):
        raise ConfigError(
            "The saved master weights do not match this model's half-precision parameters.",
            "load a checkpoint saved from the same model architecture and param groups.",
        )
    if state_dict["flat"] != flat:
        raise ConfigError(
            f"The checkpoint was saved with flat={state_dict['flat']}, this wrapper has flat={flat}.",
            f"construct MasterWeights(..., flat={state_dict['flat']}) to resume it.",
        )
