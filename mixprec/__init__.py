"""mixprec: mixed precision training on PyTorch — loss scaling, fp32 master weights and a per-op cast
policy, implemented once, offered as torch.amp-style, apex-style and fastai-style interfaces.

What a training loop needs is here, grouped below. apex's module-level state (``state_dict``,
``load_state_dict``, ``loss_scaler``) lives in :mod:`mixprec.amp`; every exception in :mod:`mixprec.errors`;
the tools in :mod:`mixprec.diagnostics`.
"""

import importlib
import importlib.util
from types import ModuleType

import mixprec.torch_floor  # noqa: F401  first: an ImportError that names the fix on a torch too old
from mixprec.activation_checkpoint import checkpoint_context
from mixprec.amp import initialize, master_params, scale_loss
from mixprec.autocast import autocast, half_compute, keep_fp32
from mixprec.callbacks import (
    AutocastMixedPrecision,
    Callback,
    CancelBatchException,
    CancelStepException,
    CancelTrainException,
    Checkpoint,
    GradientAccumulation,
    MixedPrecision,
    Recorder,
)
from mixprec.checkpoint import ResumableLoader, load_checkpoint, save_checkpoint
from mixprec.data import DataBunch, digits, mnist, synthetic
from mixprec.errors import (
    AutocastError,
    BannedOpError,
    CheckpointError,
    ConfigError,
    DeviceMismatchError,
    Fp16GradientError,
    MixprecError,
    ParameterMismatchError,
    PersistentOverflowError,
    PolicyError,
    ScalerStateError,
)
from mixprec.formats import FORMATS, Decoded, FloatFormat, FormatInfo, decode, get_format, info
from mixprec.hardware import half_arithmetic
from mixprec.learner import Learner, accuracy, error_rate
from mixprec.low_precision import LowPrecisionOptimizer
from mixprec.master import MasterWeights
from mixprec.models import build as build_model
from mixprec.policy import (
    Policy,
    get_preset,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from mixprec.recipe import RECIPES, Recipe, ScaleConfig, get_recipe
from mixprec.scaler import GradScaler, OptState

__version__ = "0.1.0"


def __getattr__(name: str) -> ModuleType:
    """``mixprec.diagnostics``, ``mixprec.host_memory``, ...: a submodule imported on first use, so the
    dotted names the docs use work after a plain ``import mixprec`` (as ``numpy.linalg`` does), without
    every ``import mixprec`` paying for the tools' imports."""
    # a plain name only: find_spec imports the parents of a dotted one, and hasattr() must not raise
    if name.isidentifier() and not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    # configuration: one Recipe describes a precision set-up; presets by name
    "Recipe",
    "ScaleConfig",
    "RECIPES",
    "get_recipe",
    # torch.amp style: a cast policy around the forward, a loss scaler
    "autocast",
    "GradScaler",
    "OptState",
    "half_compute",
    "keep_fp32",
    "checkpoint_context",
    "half_arithmetic",
    # weights: fp32 masters, or pure half precision without them
    "MasterWeights",
    "LowPrecisionOptimizer",
    # apex style (mixprec.amp holds the rest of apex's names)
    "initialize",
    "scale_loss",
    "master_params",
    # fastai style
    "Learner",
    "accuracy",
    "error_rate",
    "Callback",
    "MixedPrecision",
    "AutocastMixedPrecision",
    "Recorder",
    "GradientAccumulation",
    "CancelStepException",
    "CancelBatchException",
    "CancelTrainException",
    # the cast policy
    "Policy",
    "get_preset",
    "register_half_function",
    "register_float_function",
    "register_promote_function",
    # checkpoints
    "save_checkpoint",
    "load_checkpoint",
    "ResumableLoader",
    "Checkpoint",
    # data & models
    "DataBunch",
    "digits",
    "mnist",
    "synthetic",
    "build_model",
    # float formats
    "FORMATS",
    "FloatFormat",
    "FormatInfo",
    "Decoded",
    "decode",
    "get_format",
    "info",
    # the errors a loop most often catches (all of them: mixprec.errors)
    "MixprecError",
    "ConfigError",
    "ScalerStateError",
    "Fp16GradientError",
    "PersistentOverflowError",
    "CheckpointError",
    "PolicyError",
    "AutocastError",
    "BannedOpError",
    "DeviceMismatchError",
    "ParameterMismatchError",
]
