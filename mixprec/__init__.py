"""mixprec: mixed precision training on PyTorch — loss scaling, fp32 master weights and a per-op cast
policy, implemented once, offered as torch.amp-style, apex-style and fastai-style interfaces."""

# formats: float formats bit by bit
# scaler: loss scaling (drop-in for torch.amp.GradScaler)
# master: fp32 master weights around any torch.optim optimizer
# data & models: bundled data sets and reference models
# errors: what mixprec raises for user mistakes
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
from mixprec.master import MasterWeights
from mixprec.models import build as build_model
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
    # scaler
    "GradScaler",
    "OptState",
    # master weights
    "MasterWeights",
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
