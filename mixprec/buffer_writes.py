"""Buffers a half model's forward writes: said once, since a running sum or average kept in fp16/bf16 loses
its small updates silently.

A cast to half (O2, O3, ``to_fp16()``/``to_bf16()``) rounds every floating buffer outside the modules it
keeps fp32, as apex's ``model.half()`` did. For a constant (a mask, a table) that is one rounding. For a
buffer the forward accumulates into -- a VQ-VAE's EMA codebook (``cluster_size.mul_(0.99).add_(n, alpha=
0.01)``), a running normaliser -- every update rounds again: bf16 keeps 8 significant bits, so its decay
0.99 is 0.98828125 and an update below 1/512 of the value is always lost (a user trial: a codebook's
counts summed to 702 in bf16 against fp32's 849, with nothing said). Normalization layers' running
statistics are left out: O2 keeps them fp32, and O3's pure half model casts them on purpose.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from mixprec.func_transforms import values_readable
from mixprec.skip_step import running_statistics
from mixprec.warn_site import user_stacklevel

__all__ = ["watch_buffer_writes"]


class _FirstTrainingForward:
    """Versions of the watched buffers before the model's first eager training forward, compared after it:
    a warning names those it wrote, once."""

    def __init__(self, buffers: Sequence[tuple[str, nn.Module, str]], dtype: torch.dtype) -> None:
        self.buffers, self.dtype = list(buffers), dtype
        self.before: dict[str, tuple[torch.Tensor, int]] | None = None
        self.done = False

    def pre(self, module: nn.Module, args: Any) -> None:
        if not self.done and module.training and values_readable():
            self.before = {q: (t, t._version) for q, m, n in self.buffers
                           if isinstance(t := m._buffers.get(n), torch.Tensor)}

    def post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.done or self.before is None:
            return
        self.done = True
        written = [q for q, m, n in self.buffers if q in self.before and _written(m._buffers.get(n),
                                                                              *self.before[q], self.dtype)]
        self.before = None
        if written:
            _warn(written, self.dtype)


def _written(now: torch.Tensor | None, before: torch.Tensor, version: int, dtype: torch.dtype) -> bool:
    """Whether the forward wrote the buffer and it is still ``dtype``: in place (its version moved) or
    replaced by another half tensor (``self.buf = new``)."""
    if now is None or now.dtype != dtype:
        return False
    return now is not before or now._version != version


def _warn(written: list[str], dtype: torch.dtype) -> None:
    name = str(dtype).removeprefix("torch.")
    bits = 1 - round(math.log2(torch.finfo(dtype).eps))  # significant bits: bf16 8, fp16 11
    shown = ", ".join(written[:4]) + (" ..." if len(written) > 4 else "")
    warnings.warn(
        f"The forward wrote the buffer(s) {shown}, which the cast made {name}: a running sum or average "
        f"(an EMA codebook, a running normaliser) kept in {name} rounds every update to {bits} significant "
        f"bits (a decay of 0.99 is {torch.tensor(0.99, dtype=dtype).item():.8g}; an update below "
        f"1/{2 ** (bits + 1)} of the value is always lost). Fix: mark the module holding them with "
        "mixprec.keep_fp32(module) before the cast (initialize, to_fp16()/to_bf16()): its parameters and "
        "buffers stay fp32 and it computes in fp32. A buffer written on purpose in half (a cache) needs "
        "nothing.",
        UserWarning,
        stacklevel=user_stacklevel(),
    )


def watch_buffer_writes(model: nn.Module, buffers: Sequence[tuple[str, nn.Module, str]],
                        dtype: torch.dtype) -> list[RemovableHandle]:
    """Hooks on ``model`` that warn once where its first training forward writes one of ``buffers``
    (``(qualname, module, name)``: the ones the cast made ``dtype``), but for normalization layers' running
    statistics. No hooks where there is no such buffer."""
    stats = {id(t) for t in running_statistics(model)}
    kept = [(q, m, n) for q, m, n in buffers if id(m._buffers.get(n)) not in stats]
    if not kept:
        return []
    check = _FirstTrainingForward(kept, dtype)
    return [model.register_forward_pre_hook(check.pre), model.register_forward_hook(check.post)]
