"""``amp._amp_state``: the attribute stash apex scripts read the loss scale from.

apex kept its state in a module-level object, ``apex.amp._amp_state``. It was private, but training scripts
of that era read it to log or reuse the loss scale (Megatron-LM's ``_amp_state.loss_scalers[0].loss_scale()``,
NVIDIA's BERT, timm-era scripts that scale a loss by hand). ``mixprec.amp._amp_state`` answers those reads
from the latest ``initialize``'s scalers: a view, so it is never stale, and nothing is kept twice.

Only what such scripts use is offered; everything else raises an AttributeError that names
``amp.loss_scaler()``, the :class:`~mixprec.scaler.GradScaler` behind each loss, which has the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mixprec.apex_properties import Properties
from mixprec.errors import ScalerStateError
from mixprec.scaler import GradScaler

__all__ = ["AmpStateView", "LossScalerView"]

_ELSEWHERE = "mixprec.amp.loss_scaler(i) is the GradScaler behind loss i (get_scale(), update(new_scale))"


class LossScalerView:
    """One of apex's ``LossScaler`` objects as scripts read it, over a mixprec :class:`GradScaler`."""

    def __init__(self, scaler: GradScaler) -> None:
        self._scaler = scaler

    def loss_scale(self) -> float:
        """The current loss scale (apex's method; one host sync, as ``GradScaler.get_scale``)."""
        return self._scaler.get_scale()

    @property
    def _loss_scale(self) -> float:
        return self._scaler.get_scale()

    @_loss_scale.setter
    def _loss_scale(self, value: float) -> None:
        # apex scripts set it to force a scale (a resume, a test): the scale alone changes, as in apex, and
        # no iteration is counted (update(new_scale) would record one); load_state_dict checks the value
        state = self._scaler.state_dict()
        state["scale"] = float(value)
        self._scaler.load_state_dict(state)

    @property
    def dynamic(self) -> bool:
        return self._scaler.is_dynamic

    @property
    def _unskipped(self) -> int:
        """Clean iterations since the last overflow (what ``amp.state_dict()`` saves as ``unskipped``)."""
        return self._scaler._get_growth_tracker()

    @property
    def _has_overflow(self) -> bool:
        """Whether the last iteration overflowed (its step was skipped)."""
        return self._scaler.last_step_skipped

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"mixprec's view of apex's LossScaler has no {name!r}: {_ELSEWHERE}.")

    def __repr__(self) -> str:
        return f"LossScalerView({self._scaler!r})"


class AmpStateView:
    """``amp._amp_state``: ``loss_scalers``, ``opt_properties`` and ``verbosity`` of the latest
    ``initialize``. Before it they raise an AttributeError naming ``initialize``: apex set them there, and
    scripts test ``hasattr(amp._amp_state, "loss_scalers")`` to learn whether amp is on."""

    def __init__(self, state: Callable[[], Any]) -> None:
        self._latest = state  # amp's: the latest initialize's _AmpState, or a ScalerStateError

    def _state(self) -> Any:
        try:
            return self._latest()
        except ScalerStateError as err:
            raise AttributeError(str(err)) from None

    @property
    def loss_scalers(self) -> list[LossScalerView]:
        return [LossScalerView(s) for s in self._state().scalers]

    @property
    def opt_properties(self) -> Properties:
        return Properties.of(self._state().recipe)

    @property
    def verbosity(self) -> int:
        return int(self._state().verbosity)

    @verbosity.setter
    def verbosity(self, value: int) -> None:
        self._state().verbosity = int(value)

    def __getattr__(self, name: str) -> Any:
        if name in ("loss_scalers", "opt_properties", "verbosity"):
            self._state()  # a property's AttributeError lands here (Python's rule): raise initialize's again
        raise AttributeError(
            f"mixprec.amp._amp_state offers loss_scalers, opt_properties and verbosity, not {name!r}: "
            f"{_ELSEWHERE}."
        )
