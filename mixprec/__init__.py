"""mixprec: mixed precision training on PyTorch — loss scaling, fp32 master weights and a per-op cast
policy, implemented once, offered as torch.amp-style, apex-style and fastai-style interfaces."""

# formats: float formats bit by bit
# policy & autocast: which op runs in which dtype
# scaler: loss scaling (drop-in for torch.amp.GradScaler)
# master: fp32 master weights around any torch.optim optimizer
# opt levels: apex's O0-O3 as presets over the same parts
# learner: a fastai-style training loop whose MixedPrecision callback uses the same parts
# checkpoints: atomic save/resume of model, masters, optimizer, scalers, schedulers, RNG
# data & models: bundled data sets and reference models
# errors: what mixprec raises for user mistakes
from mixprec.amp import initialize, load_state_dict, loss_scaler, master_params, scale_loss, state_dict
from mixprec.autocast import AutocastError, BannedOpError, autocast, half_compute, keep_fp32
from mixprec.callbacks import (
    AutocastMixedPrecision,
    Callback,
    CancelStepException,
    CancelTrainException,
    Checkpoint,
    MixedPrecision,
    Recorder,
)
from mixprec.checkpoint import ResumableLoader, load_checkpoint, save_checkpoint
from mixprec.data import DataBunch, digits, mnist, synthetic
from mixprec.errors import (
    ConfigError,
    DeviceMismatchError,
    Fp16GradientError,
    MixprecError,
    ParameterMismatchError,
    ScalerStateError,
)
from mixprec.formats import FORMATS, Decoded, FloatFormat, FormatInfo, decode, get_format, info
from mixprec.learner import Learner, accuracy, error_rate
from mixprec.master import MasterWeights
from mixprec.models import build as build_model
from mixprec.policy import (
    Policy,
    get_preset,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from mixprec.scaler import GradScaler, OptState

__version__ = "0.1.0"

__all__ = [
    # formats
    "FORMATS",
    "FloatFormat",
    "FormatInfo",
    "Decoded",
    "decode",
    "get_format",
    "info",
    # policy & autocast
    "autocast",
    "half_compute",
    "keep_fp32",
    "Policy",
    "get_preset",
    "register_half_function",
    "register_float_function",
    "register_promote_function",
    "AutocastError",
    "BannedOpError",
    # scaler
    "GradScaler",
    "OptState",
    # master weights
    "MasterWeights",
    # opt levels (apex style)
    "initialize",
    "scale_loss",
    "master_params",
    "loss_scaler",
    "state_dict",
    "load_state_dict",
    # learner (fastai style)
    "Learner",
    "accuracy",
    "error_rate",
    "Callback",
    "MixedPrecision",
    "AutocastMixedPrecision",
    "Recorder",
    "CancelStepException",
    "CancelTrainException",
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
    # errors
    "MixprecError",
    "ConfigError",
    "ScalerStateError",
    "Fp16GradientError",
    "DeviceMismatchError",
    "ParameterMismatchError",
]
