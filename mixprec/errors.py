"""The exceptions mixprec raises for mistakes a user can make.

Each message says what was wrong and what to do about it. Where torch raises an ``AssertionError`` or a
``RuntimeError`` for the same misuse, ours also derives from that class, so code written against
``torch.amp`` keeps catching what it caught before.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "MixprecError",
    # advice several messages give
    "FP32_MIN_MASK",
    "FP32_MIN_MASK_FIX",
    "listed",
    # settings and call order
    "ConfigError",
    "ApexPropertyError",
    "ScalerStateError",
    "PolicyError",
    "AutocastError",
    "UnknownArithmeticError",
    "UnknownFormatError",
    # what training ran into
    "Fp16GradientError",
    "PersistentOverflowError",
    "BannedOpError",
    "DeviceMismatchError",
    "ParameterMismatchError",
    "UnsupportedParameterError",
    # saving, loading, data, ranks
    "CheckpointError",
    "MasterStateWarning",
    "DatasetNotFoundError",
    "IDXFormatError",
    "DistributedError",
]


class MixprecError(Exception):
    """Base class of every error mixprec raises on purpose."""

    def __init__(self, problem: str, fix: str | None = None) -> None:
        self.problem = problem
        self.fix = fix
        super().__init__(problem if fix is None else f"{problem}\n  - fix: {fix}")


class ConfigError(MixprecError, ValueError, AssertionError):
    """A constructor argument or setting is out of range or contradicts another one."""


class ScalerStateError(MixprecError, RuntimeError, AssertionError):
    """GradScaler methods were called out of order (e.g. unscale_ twice, step without scale)."""


class Fp16GradientError(MixprecError, ValueError):
    """Gradients in fp16 reached the unscale step (there is no fp32 copy to unscale into)."""


class DeviceMismatchError(MixprecError, ValueError):
    """Tensors from different devices met where one device was expected."""


class ParameterMismatchError(MixprecError, ValueError):
    """An optimizer's parameters do not belong to the model they are used with."""


class PersistentOverflowError(MixprecError, FloatingPointError):
    """Steps kept being skipped for inf/NaN gradients although the loss scale backed off."""


class UnsupportedParameterError(MixprecError, TypeError):
    """A parameter's dtype, or its gradient's layout, is one the optimizer wrapper cannot update."""


class ApexPropertyError(ConfigError, RuntimeError):
    """What ``apex.amp.initialize`` itself refused with a RuntimeError: a property at an opt level that
    forbids it, an unknown opt level, a trained parameter already cast to half."""


class CheckpointError(MixprecError, RuntimeError):
    """A checkpoint cannot be read, is damaged, or does not fit the objects it is loaded into."""


class DistributedError(MixprecError, RuntimeError):
    """A rank of a distributed run failed or stalled; the message names the rank."""


class MasterStateWarning(MixprecError, UserWarning):
    """The wrapped optimizer of a MasterWeights was saved or loaded alone, without the fp32 masters."""


class UnknownFormatError(MixprecError, ValueError):
    """A float format name (or dtype) that mixprec.formats does not know."""


class DatasetNotFoundError(MixprecError, FileNotFoundError):
    """The files of a data set are not where they were looked for."""


class IDXFormatError(MixprecError, ValueError):
    """A file is not a valid IDX file (bad magic number, unknown type code, or wrong size)."""


class PolicyError(MixprecError, ValueError):
    """A policy, registration or lookup was given something it cannot use; the message names the fix."""


class AutocastError(ConfigError):
    """Bad arguments to mixprec.autocast, keep_fp32 or a checkpoint context; the message names the fix."""


class BannedOpError(MixprecError, NotImplementedError):
    """An op the policy bans was called inside an autocast region.

    A RuntimeError, like torch's own ban, and a NotImplementedError, which apex raised for banned functions.
    """


class UnknownArithmeticError(ConfigError):
    """An arithmetic choice (native/emulated) that mixprec.hardware does not know."""


# One wording of a pitfall three messages name (the scaler's stuck warning, trace_nonfinite, the input cast's
# first-forward check): fp32's finfo.min (-3.4e38) lies beyond fp16's and bf16's range.
FP32_MIN_MASK = ("an additive attention mask filled with torch.finfo(torch.float32).min becomes -inf when "
                 "cast to fp16 or bf16, and a row masked everywhere then makes softmax NaN")
FP32_MIN_MASK_FIX = "build the mask with its half dtype's own torch.finfo(dtype).min, or pass a bool mask"


def listed(items: Sequence[str], limit: int = 4, sep: str = ", ") -> str:
    """The first ``limit`` of ``items``, joined, and how many more: a message names enough to see the
    pattern, not every one of hundreds of tensors."""
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return sep.join(items[:limit]) + more
