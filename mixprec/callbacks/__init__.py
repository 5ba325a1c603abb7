"""Callbacks of the :class:`~mixprec.learner.Learner` loop, one concept per module (as fastai's):

- :mod:`~mixprec.callbacks.core` -- the events and their order, ``Callback``, the loop's exceptions;
- :mod:`~mixprec.callbacks.fp16` -- mixed precision from a ``Recipe``: ``MixedPrecision``,
  ``AutocastMixedPrecision``, ``callback_for(recipe)``;
- :mod:`~mixprec.callbacks.recorder` -- ``Recorder`` and ``StepTimer``;
- :mod:`~mixprec.callbacks.progress` -- ``ProgressBar``;
- :mod:`~mixprec.callbacks.clip` -- ``GradientClipping``, in any precision;
- :mod:`~mixprec.callbacks.accumulation` -- ``GradientAccumulation`` (fastai v2's), in any precision;
- :mod:`~mixprec.callbacks.schedule` -- ``OneCycleScheduler`` and ``WarmupCosineScheduler``;
- :mod:`~mixprec.callbacks.checkpoint` -- ``Checkpoint``.

Every name is re-exported here: ``from mixprec.callbacks import MixedPrecision`` works as before the split.
"""

from mixprec.callbacks.accumulation import GradientAccumulation
from mixprec.callbacks.checkpoint import Checkpoint
from mixprec.callbacks.clip import GradientClipping
from mixprec.callbacks.core import (
    EVENTS,
    Callback,
    CancelBatchException,
    CancelStepException,
    CancelTrainException,
    LearnerState,
    scaler_saw_step,
)
from mixprec.callbacks.fp16 import (
    DEFAULT_MAX_NOSKIP,
    DEFAULT_MAX_SCALE,
    AutocastMixedPrecision,
    LossScaling,
    MixedPrecision,
    callback_for,
    fastai_recipe,
    mixprec_callback_for,
    model_to_float,
    model_to_half,
)
from mixprec.callbacks.progress import ProgressBar
from mixprec.callbacks.recorder import EpochResult, Recorder, StepTimer
from mixprec.callbacks.schedule import OneCycleScheduler, StepScheduler, WarmupCosineScheduler

__all__ = [
    # the loop
    "EVENTS",
    "Callback",
    "CancelStepException",
    "CancelBatchException",
    "CancelTrainException",
    "LearnerState",
    # mixed precision
    "LossScaling",
    "MixedPrecision",
    "AutocastMixedPrecision",
    "DEFAULT_MAX_SCALE",
    "DEFAULT_MAX_NOSKIP",
    "callback_for",
    "fastai_recipe",
    "mixprec_callback_for",
    "model_to_half",
    "model_to_float",
    "scaler_saw_step",
    # recording and display
    "Recorder",
    "EpochResult",
    "StepTimer",
    "ProgressBar",
    # clipping, accumulation and schedules
    "GradientClipping",
    "GradientAccumulation",
    "StepScheduler",
    "OneCycleScheduler",
    "WarmupCosineScheduler",
    # checkpoints
    "Checkpoint",
]
