"""The scaler's inf/NaN check of gradients on the CPU where the loss scale is exactly 1.

At a scale of 1 (bf16's static scale; a dynamic scale at its floor of 1), unscaling multiplies every
gradient by 1 and leaves it as it is, bit for bit (NaN stays NaN, -0 stays -0): what is left of torch's
fused check-and-unscale is the check. Torch's op converts each half element to fp32 and multiplies it
anyway, and is slow for half gradients on the CPU: 3.1-3.5 ms for the benchmark GPT's 14.8M bf16 gradients
on an AMX Xeon with 2 threads (5.8 ms inside a training step), where ``non_finite.c`` tests the exponent
bits of each element and takes 1.2 ms (benchmarks/RESULTS.md). On fp32 gradients (O2's master gradients,
O1's) it reads once where torch's op reads and writes. Same flag, the gradients untouched.

One difference, with denormals flushed (``torch.set_flush_denormal(True)``): torch's multiply by 1 flushes
fp32 (and bf16, which has fp32's exponent range) subnormal gradients to 0; this check leaves them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mixprec.native import cpu_scalar, library, pointers, readable, sizes

__all__ = ["EXPONENT_MASK", "check_grads_"]

# All exponent bits set: inf (zero fraction) or NaN (any other), IEEE 754's encoding in every format.
EXPONENT_MASK: dict[torch.dtype, int] = {torch.float16: 0x7C00, torch.bfloat16: 0x7F80,
                                         torch.float32: 0x7F800000}
# The loop for each element width (non_finite.c).
_LOOP: dict[torch.dtype, str] = {torch.float16: "half_non_finite", torch.bfloat16: "half_non_finite",
                                 torch.float32: "float_non_finite"}


@torch.no_grad()
def check_grads_(grads: Sequence[torch.Tensor], found: torch.Tensor, inv_scale: torch.Tensor) -> bool:
    """Where ``inv_scale`` (0-d fp32, the factor an unscale multiplies by) is exactly 1: set ``found`` (0-d
    fp32) to 1.0 if any of ``grads`` (one dtype: fp16, bf16 or fp32) holds an inf or NaN, reading them
    only -- what ``torch._amp_foreach_non_finite_check_and_unscale_`` does at that scale -- and return
    True.

    Returns False, having changed nothing, where the scale is any other value (the loop reads it from
    memory, as torch's CPU kernel does: whatever wrote it, no host copy can go stale), or it cannot check
    them (no native library on this machine, not all on the CPU, a tensor the loop cannot read, another
    dtype): the caller then runs torch's op."""
    cpu = found.device.type == "cpu" and inv_scale.device.type == "cpu"
    if not grads or grads[0].dtype not in EXPONENT_MASK or not cpu or inv_scale.dtype is not torch.float32:
        return False
    # Declined before the per-tensor tables are built (~5 us a gradient): fp16's dynamic scale is never 1.
    # The loop reads the scale again itself.
    if inv_scale.numel() != 1 or cpu_scalar(inv_scale) != 1.0:
        return False
    lib = library()
    if lib is None or not all(readable(g, grads[0].dtype) for g in grads):
        return False
    held = [g for g in grads if g.numel()]  # alive until the loop returns (ctypes lets go of the GIL)
    data, numel = pointers(held), sizes(held)
    dtype = grads[0].dtype
    bad = getattr(lib, _LOOP[dtype])(len(held), data.ctypes.data, numel.ctypes.data, EXPONENT_MASK[dtype],
                                     torch.get_num_threads(), inv_scale.data_ptr())
    if bad < 0:
        return False  # not a scale of 1: the gradients must be multiplied
    if bad:
        found.fill_(1.0)  # 1.0 once any is inf/NaN, never more (as torch's op)
    return True
