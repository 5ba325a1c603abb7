"""ReLU of an emulated half activation, with a backward that ``torch.compile`` partitions well.

Where mixprec emulates half GEMMs (:mod:`mixprec.hardware`), ``Linear -> ReLU -> Linear`` runs as: fp32
GEMM, rounded to half; ReLU on the half tensor; fp32 upcast of the ReLU output for the next GEMM, which
backward needs too. torch's ReLU backward (``threshold_backward``) reads the *half* ReLU output, so
AOTAutograd's partitioner must keep that tensor or a mask made from it, on top of the fp32 upcast it keeps
for the GEMM; it keeps the 1-byte mask. Inductor's vectorized bool store is slow on CPUs (compiled
``x <= 0`` on 512x8192: 41 ms against 2.5 ms eager on a 2-core AVX2 EPYC), so the compiled emulated
784-8192-10 MLP step took 1.35-1.44x compiled fp32's time, where eager took about 1.1x.

Here the backward in compiled code builds its mask from the fp32 upcast of the saved output. That upcast
is the one the next emulated GEMM made in forward (the compiler merges the two identical casts), which the
partitioner keeps anyway: no mask is stored, and the mask is computed inside the fused backward kernel. The
same compiled MLP step on that CPU: 1.35-1.44x -> 1.09x compiled fp32, timed in one process with this
routing off and on (benchmarks/RESULTS.md). That holds where the ReLU output goes straight into an
emulated GEMM; with another op in between (Dropout), or no GEMM after it, there is no fp32 copy to share and
a mask is still saved.

Eager backward is torch's own kernel (``threshold_backward``) on the half output. Compiled,
``where(out.float() <= 0, 0, grad)`` gives the same gradient: ``out <= 0`` and ``out.float() <= 0`` agree
for every value (the upcast is exact), and zero where ``out <= 0``, else ``grad``, is
``threshold_backward``'s rule, NaN passing its gradient through.

In-place ReLU (``relu_``, ``F.relu(x, inplace=True)``) is left to torch: its output overwrites the input.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.cast_handlers import eligible
from mixprec.func_transforms import inside_transform

__all__ = ["RELU_NAMES", "half_relu", "relu"]

# The Python-level names a torch-function mode sees for an out-of-place ReLU (F.relu, torch.relu,
# Tensor.relu all report "relu"; F.relu's ``inplace`` comes as an argument).
RELU_NAMES = frozenset({"relu"})


class _HalfRelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(x)
        ctx.save_for_backward(out)  # what torch's ReLU saves: the half output
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (out,) = ctx.saved_tensors
        if not torch.compiler.is_compiling():
            return torch.ops.aten.threshold_backward(grad, out, 0)  # torch's own ReLU backward kernel
        # Compiled: the mask from the fp32 upcast the next emulated GEMM keeps (see the module docstring);
        # threshold_backward's rule, written out so that its comparison can read the fp32 copy.
        return torch.where(out.float() <= 0, 0, grad)


def half_relu(
    args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype, device_type: str
) -> torch.Tensor | None:
    """ReLU through :class:`_HalfRelu` when the call is an out-of-place ReLU that needs a gradient, of one
    ``dtype`` tensor on the region's device; None otherwise (the caller runs torch's own)."""
    x = args[0] if args else kwargs.get("input")
    inplace = kwargs.get("inplace", args[1] if len(args) > 1 else False)
    if not (isinstance(x, torch.Tensor) and x.dtype is dtype and eligible(x, device_type)):
        return None
    if inplace or not (x.requires_grad and torch.is_grad_enabled()) or inside_transform():
        return None  # inside torch.func's transforms: torch's ReLU, which composes with them
    return _HalfRelu.apply(x)


def relu(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype, device_type: str
) -> Any:
    """What a region's torch-function mode returns for a ReLU name: :func:`half_relu`, else ``func``."""
    out = half_relu(args, kwargs, dtype, device_type)
    return func(*args, **kwargs) if out is None else out
