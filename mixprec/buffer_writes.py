"""Buffers a half model's forward writes: said once, since a running sum or average kept in fp16/bf16 loses
its small updates silently.

A cast to half (O2, O3, ``to_fp16()``/``to_bf16()``) rounds every floating buffer outside the modules it
keeps fp32, as apex's ``model.half()`` did. For a constant (a mask, a table) that is one rounding. For a
buffer the forward accumulates into -- a VQ-VAE's EMA codebook (``cluster_size.mul_(0.99).add_(n, alpha=
0.01)``), a running normaliser -- every update rounds again: bf16 keeps 8 significant bits, so an update
below 1/512 of the value is always lost (a user trial: a codebook's counts summed to 702 in bf16 against
fp32's 849, with nothing said). Left out: normalization layers' running statistics (O2 keeps them fp32,
and O3's pure half model casts them on purpose) and spectral norm's power-iteration vectors (recomputed
from the weight at every forward: nothing accumulates in them).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.utils.parametrizations import _SpectralNorm
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.utils.hooks import RemovableHandle

from mixprec.errors import listed
from mixprec.func_transforms import values_readable
from mixprec.skip_step import running_statistics
from mixprec.warn_site import user_stacklevel

__all__ = ["watch_buffer_writes"]

# Buffers up to this size are also compared by value after the first forward: a write through ``.data``
# (rosinality's vq-vae-2 updates its EMA so) leaves the version counter as it was. Larger ones (a cache
# allocated up front) are judged by their version alone, not copied.
COMPARED_NUMEL = 1 << 20


class _FirstTrainingForward:
    """The watched buffers before the model's first eager training forward (versions; copies of the small
    ones), compared after it: a warning names those it wrote, once; then the hooks take themselves off."""

    def __init__(self, buffers: Sequence[tuple[str, nn.Module, str]], dtype: torch.dtype) -> None:
        self.buffers, self.dtype = list(buffers), dtype
        self.before: dict[str, tuple[torch.Tensor, int, torch.Tensor | None]] | None = None
        self.handles: list[RemovableHandle] = []

    @torch.no_grad()
    def pre(self, module: nn.Module, args: Any) -> None:
        if module.training and values_readable():
            self.before = {q: (t, t._version, t.clone() if t.numel() <= COMPARED_NUMEL else None)
                           for q, m, n in self.buffers if isinstance(t := m._buffers.get(n), torch.Tensor)}

    def post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.before is None:  # an eval or compiled forward: the next training one is checked
            return
        written = [q for q, m, n in self.buffers if q in self.before and _written(m._buffers.get(n),
                                                                              *self.before[q], self.dtype)]
        self.before = None
        for handle in self.handles:  # checked once: no hook per forward for the model's life
            handle.remove()
        if written:
            _warn(written, self.dtype)


def _written(now: torch.Tensor | None, before: torch.Tensor, version: int, copy: torch.Tensor | None,
             dtype: torch.dtype) -> bool:
    """Whether the forward wrote the buffer and it is still ``dtype``: in place (its version moved, or its
    values, for a write through ``.data``) or replaced by another half tensor (``self.buf = new``)."""
    if now is None or now.dtype != dtype:
        return False
    if now is not before or now._version != version:
        return True
    return copy is not None and not torch.equal(now, copy)


def _warn(written: list[str], dtype: torch.dtype) -> None:
    name = str(dtype).removeprefix("torch.")
    bits = 1 - round(math.log2(torch.finfo(dtype).eps))  # significant bits: bf16 8, fp16 11
    shown = listed(written)
    warnings.warn(
        f"The forward wrote the buffer(s) {shown}, which the cast made {name}: a running sum or average "
        f"(an EMA codebook, a running normaliser) kept in {name} rounds at every update to {bits} "
        f"significant bits, and an update below 1/{2 ** (bits + 1)} of the value is always lost. Fix: mark "
        "the module holding them with mixprec.keep_fp32(module) before the cast (initialize, "
        "to_fp16()/to_bf16()): its parameters and buffers stay fp32 and it computes in fp32. A buffer "
        "written on purpose in half (a cache) needs nothing.",
        UserWarning,
        stacklevel=user_stacklevel(),
    )


def _recomputed(model: nn.Module) -> set[int]:
    """The ids of spectral norm's power-iteration vectors (u, v), both forms of it: recomputed from the
    weight at each training forward, they hold nothing that rounding could lose over time."""
    found = set()
    for m in model.modules():
        if isinstance(m, _SpectralNorm):  # torch.nn.utils.parametrizations.spectral_norm
            found |= {id(b) for b in m.buffers(recurse=False)}
        for hook in m._forward_pre_hooks.values():  # torch.nn.utils.spectral_norm (a hook)
            if isinstance(hook, SpectralNorm):
                found |= {id(m._buffers.get(f"{hook.name}_{v}")) for v in ("u", "v")}
    return found


def watch_buffer_writes(model: nn.Module, buffers: Sequence[tuple[str, nn.Module, str]],
                        dtype: torch.dtype) -> list[RemovableHandle]:
    """Hooks on ``model`` that warn once where its first training forward writes one of ``buffers``
    (``(qualname, module, name)``: the ones the cast made ``dtype``), but for normalization layers' running
    statistics and spectral norm's vectors. No hooks where there is no such buffer."""
    left_out = {id(t) for t in running_statistics(model)} | _recomputed(model)
    kept = [(q, m, n) for q, m, n in buffers if id(m._buffers.get(n)) not in left_out]
    if not kept:
        return []
    check = _FirstTrainingForward(kept, dtype)
    check.handles = [model.register_forward_pre_hook(check.pre), model.register_forward_hook(check.post)]
    return check.handles
