"""O2's unscale in one pass on the CPU: the model's half gradients copied into the fp32 master gradients,
multiplied by the inverse loss scale and checked for inf/NaN as they go (``unscale_copy.c``).

A copy (read 2 bytes, write 4 per gradient) followed by torch's check-and-unscale of the fp32 copies
(read 4, write 4) moves 14 bytes per gradient; this pass moves 6, and computes what those two ops give,
bit for bit: the upcast is exact, then ``value * inv_scale`` in fp32, or the value itself where the inverse
scale is exactly 1 (torch's op; bf16's static scale). The flag is torch's: set to 1.0 once any gradient is
inf or NaN. Where it cannot run (no native library, not on the CPU, a tensor it cannot read: a DTensor's
wrapper, a gap in memory), the caller keeps the copy and torch's op.

One difference, with denormals flushed (``torch.set_flush_denormal(True)``): that flag holds on the
calling thread only, so a product that is an fp32 subnormal is flushed to 0 on the threads that have it,
by torch's op as by this loop, and the two split the work among their threads differently (torch per
tensor, this loop over all of them): such a gradient may come out 0 from one and subnormal from the other.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mixprec.native import library, pointers, readable, sizes

__all__ = ["unscale_copy_"]

# The loop for each half dtype (unscale_copy.c): bf16's upcast is a shift, fp16's a rebias of its exponent.
_LOOP: dict[torch.dtype, str] = {torch.bfloat16: "bf16_unscale_copy", torch.float16: "fp16_unscale_copy"}


def _same_layout(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Element i of one is element i of the other in memory: same shape, same strides."""
    return dst.shape == src.shape and dst.stride() == src.stride()


@torch.no_grad()
def unscale_copy_(
    dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], found: torch.Tensor, inv_scale: torch.Tensor
) -> bool | None:
    """``dst[i] = src[i].float() * inv_scale`` (fp32 ``dst``, one half dtype in ``src``), setting ``found``
    (0-d fp32) to 1.0 if any of ``src`` holds an inf or NaN; what ``torch._foreach_copy_(dst, src)`` then
    ``torch._amp_foreach_non_finite_check_and_unscale_(dst, found, inv_scale)`` do. Returns whether the
    inverse scale was exactly 1 (``dst`` then holds the exact upcasts of ``src``), or None, having written
    nothing, where it cannot run: the caller then copies and unscales with torch's ops."""
    if not src or len(dst) != len(src) or src[0].dtype not in _LOOP or inv_scale.dtype is not torch.float32:
        return None
    dtype = src[0].dtype
    lib = library()
    cpu = found.device.type == "cpu" and inv_scale.device.type == "cpu" and inv_scale.numel() == 1
    pairs = list(zip(dst, src, strict=True))
    if lib is None or not cpu or not all(
        readable(s, dtype) and readable(d, torch.float32) and _same_layout(d, s) for d, s in pairs
    ):
        return None
    # the tensors stay alive until the loop returns (ctypes lets go of the GIL)
    ins, outs = [s for _, s in pairs if s.numel()], [d for d, s in pairs if s.numel()]
    data_in, data_out, numel = pointers(ins), pointers(outs), sizes(ins)
    result = getattr(lib, _LOOP[dtype])(len(ins), data_in.ctypes.data, data_out.ctypes.data,
                                        numel.ctypes.data, torch.get_num_threads(), inv_scale.data_ptr())
    if result & 1:
        found.fill_(1.0)  # 1.0 once any is inf/NaN, never more (as torch's op)
    return bool(result & 2)
