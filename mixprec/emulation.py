"""Emulated half-precision GEMMs: tensor-core numerics computed with fp32 kernels.

Where a device has no fast fp16 GEMM (CPU: torch's fp16 GEMMs run at 0.3-57 GFLOP/s against ~150 for
fp32), a half-precision GEMM/convolution is computed as an fp16 tensor core would compute it:

1. inputs rounded to the half format and carried in fp32 (:func:`round_to_half`);
2. the op run by its fp32 kernel: the product of two fp16 numbers has at most 22 significant bits, so it
   is exact in fp32's 24, and accumulating in fp32 is what tensor cores do;
3. the result rounded once to the half format (:func:`round_result`).

So the result equals a true fp16-input, fp32-accumulate GEMM up to fp32 summation order. Autograd records
the fp32 op between the two roundings, so backward is emulated too, and the gradients that leave an
emulated op are half precision, as under real half autocast.

Cost: the fp32 copies of the rounded inputs (twice the bytes of fp16) are what autograd saves for
backward.

This module is the only numerics of autocast; the engine (:mod:`mixprec.autocast`) decides *which* ops
are emulated and supplies a ``round_input`` that caches the rounded copy of each parameter per region.
Callers run :func:`emulated` with torch's autocast switched off for the inputs' device: autocast would
otherwise cast the fp32-carried inputs back to half and run the slow kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mixprec.tensor_args import iter_tensors, map_tensors

__all__ = ["emulated", "round_result", "round_to_half"]

RoundInput = Callable[[torch.Tensor], torch.Tensor]


def round_to_half(t: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """``t``'s values rounded to ``dtype`` (round-to-nearest-even), carried in fp32.

    Tensors that are not floating, or are float64 (which autocast leaves alone), come back unchanged.
    """
    if not t.is_floating_point() or t.dtype is torch.float64:
        return t
    if t.dtype is dtype:
        return t.float()  # exact: every half value is an fp32 value
    return t.to(dtype).float()


def round_result(value: Any, dtype: torch.dtype = torch.float16) -> Any:
    """Every fp32 tensor in ``value`` rounded once to ``dtype``: the output rounding of a half GEMM."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.dtype is torch.float32 else t

    return map_tensors(cast, value)


def emulated(
    func: Callable[..., Any],
    args: Any,
    kwargs: dict[str, Any],
    dtype: torch.dtype = torch.float16,
    round_input: RoundInput | None = None,
) -> Any:
    """``func(*args, **kwargs)`` computed as a ``dtype`` tensor core would (see the module docstring).

    ``round_input`` maps each tensor argument to its ``dtype``-rounded fp32 copy (default
    :func:`round_to_half`; the autocast engine passes one that caches parameters and skips tensors on
    other devices). An ``out=`` tensor receives the rounded result and is returned, as torch does.
    """
    rounder = round_input if round_input is not None else lambda t: round_to_half(t, dtype)
    out = kwargs.get("out")
    if out is not None:  # compute into a fresh fp32 result, then write the caller's half tensor
        kwargs = {k: v for k, v in kwargs.items() if k != "out"}
    result = round_result(func(*map_tensors(rounder, args), **map_tensors(rounder, kwargs)), dtype)
    if out is None:
        return result
    with torch.no_grad():
        for dst, src in zip(iter_tensors(out), iter_tensors(result), strict=True):
            dst.copy_(src)
    return out
