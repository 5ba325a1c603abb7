"""A half model trained with its forward outside every mixprec region, where torch's own half kernels are
slow: say so, once.

On a CPU without fp16/bf16 units torch's own half GEMMs run 3x-500x slower than fp32 (mixprec.hardware
then says "emulated"); a mixprec region (``half_compute``, ``autocast``) computes them at fp32's speed with
the half format's numerics (emulation.py). A model cast by hand (``model.to(torch.bfloat16)``) whose
optimizer is wrapped in ``MasterWeights`` or ``LowPrecisionOptimizer`` but whose forward runs bare gets
torch's slow kernels, and nothing would say why the step takes a minute.

So such an optimizer notes, when built, how many regions this thread had entered
(``region.STATE.entries``); at its first step, when none was entered since and a parameter with a gradient
has a dtype that mixprec emulates on its device, it warns. Parameters of models mixprec prepared itself
(``initialize``, ``to_fp16()``; :func:`mark_prepared`) are left out: their forward always runs in a
region, compiled or not (a compiled region enters nothing this module could count).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from mixprec.formats import dtype_label
from mixprec.hardware import HALF_DTYPES, half_arithmetic
from mixprec.region import STATE
from mixprec.warn_site import user_stacklevel

__all__ = ["RegionWatch", "is_prepared", "mark_prepared"]

# Parameters of models whose forward mixprec put in a region (half_model.prepare), by identity: a WeakSet
# would compare two tensors with == (elementwise) when their hashes collide.
_PREPARED = WeakIdKeyDictionary()


def mark_prepared(params: Iterable[torch.Tensor]) -> None:
    """These parameters' model runs its forward in a mixprec region: no warning for them."""
    _PREPARED.update(dict.fromkeys(params, True))


def is_prepared(param: torch.Tensor) -> bool:
    """Whether ``param``'s model was prepared (half_model.prepare: cast, and its forward in a region)."""
    return param in _PREPARED


class RegionWatch:
    """Built with the optimizer; :meth:`check` at each step warns once, at the first step (module
    docstring). ``who`` names the optimizer in the message."""

    def __init__(self, who: str) -> None:
        self.who = who
        self.entries = STATE.entries
        self.pending = True

    def check(self, params: Iterable[torch.Tensor]) -> None:
        if not self.pending:
            return
        self.pending = False
        if STATE.entries != self.entries:
            return  # a region was entered on this thread since the optimizer was built
        slow = _slow_half_kinds(params)
        if slow:
            warnings.warn(_message(self.who, *slow[0]), UserWarning, stacklevel=user_stacklevel())


def _slow_half_kinds(params: Iterable[torch.Tensor]) -> list[tuple[str, torch.dtype, str]]:
    """(device type, dtype, why) of the trained half parameters whose dtype mixprec emulates there."""
    kinds = {
        (p.device.type, p.dtype)
        for p in params
        if p.grad is not None and p.dtype in HALF_DTYPES and p not in _PREPARED
    }
    found = []
    for device_type, dtype in sorted(kinds, key=str):
        arithmetic = half_arithmetic(device_type, dtype)
        if arithmetic.emulated:
            found.append((device_type, dtype, arithmetic.reason))
    return found


def _message(who: str, device_type: str, dtype: torch.dtype, why: str) -> str:
    label = dtype_label(dtype)
    return (
        f"{who}: the model's {dtype} parameters got their gradients from a forward run outside any mixprec "
        f"region, so torch's own {label} GEMMs ran, which on this {device_type} are several to hundreds of "
        f"times slower than fp32 ({why}). Fix: run the forward (and loss) inside "
        f"`with mixprec.half_compute({device_type!r}, {dtype}):`, which computes them at fp32's speed with "
        f"{label}'s numerics (or let mixprec cast the model: mixprec.initialize(..., opt_level='O2'), "
        f"Learner.to_{label}()). To keep torch's kernels, set MIXPREC_HALF_ARITHMETIC={label}=native. "
        "(A half_compute region entered only inside torch.compile'd code is not counted here: there this "
        "warning is wrong; warnings.filterwarnings('ignore', '.*outside any mixprec region') silences it.)"
    )
