"""Emulated half-precision GEMMs: tensor-core numerics computed with fp32 kernels, for fp16 and bf16.

Where a device has no fast kernels for a half format (:mod:`mixprec.hardware` decides, per device and
dtype: CPU fp16 GEMMs run at 0.3-57 GFLOP/s and, without AVX-512 BF16/AMX, bf16 GEMMs at ~0.5, against
45-150 for fp32), a half-precision GEMM/convolution is computed as a tensor core would compute it:

1. inputs rounded to the half format and carried in fp32 (:func:`round_to_half`);
2. the op run by its fp32 kernel: the product of two fp16 numbers has at most 22 significant bits (two
   bf16 numbers: 16), so it is exact in fp32's 24, and accumulating in fp32 is what tensor cores do;
3. the result rounded once to the half format (:func:`round_result`).

So the result equals a true half-input, fp32-accumulate GEMM up to fp32 summation order. Autograd records
the fp32 op between the two roundings, so backward is emulated too: each backward GEMM reads the half
gradient and the rounded operands autograd saved (no operand is rounded again), accumulates in fp32, and
its result is rounded once where it leaves through an input rounding.

**Compiled code.** Inductor keeps fp32 values in registers across casts it considers pointwise, so a plain
``t.to(half).float()`` is compiled to nothing and the GEMM silently reads unrounded inputs. The input
rounding is therefore an opaque custom op, ``mixprec::round_to_half`` (fake implementation for tracing;
its backward rounds the gradient, as the eager ``Tensor.to`` pair does), which no compiler can elide:
eager and compiled code compute the same bits. The op is the *rounding*, not the GEMM, so every GEMM and
convolution keeps torch's own fp32 forward and backward kernels.

Cost: autograd saves the fp32 copies of the rounded inputs (twice the bytes of half) for backward, except
that ``F.linear`` and plain matrix products save a half input as it is and upcast it again in backward
(:class:`_LinearSavingHalf`, :class:`_MatmulSavingHalf`: an O2 MLP's saved activations 25.9 -> 9.1 MiB,
below fp32's 17.6); each weight is rounded (or upcast) once per region however often it is used, and not
again in backward. The roundings are memory-bound passes: 14-18% of an eager emulated step of the
784-8192-10 MLP on a quiet AVX2 CPU (``benchmarks/RESULTS.md``).

:func:`emulates` says which dtypes to emulate on a device (from :mod:`mixprec.hardware`); the autocast
engine (:mod:`mixprec.autocast`) decides *which* ops are emulated and supplies a ``round_input`` that caches
the rounded copy of each parameter per region. Callers run :func:`emulated` with torch's autocast switched
off for the inputs' device: autocast would otherwise cast the fp32-carried inputs back to half and run the
slow kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from mixprec.hardware import HALF_DTYPES, half_arithmetic
from mixprec.tensor_args import iter_tensors, map_tensors

__all__ = ["emulated", "emulates", "round_result", "round_to_half"]

RoundInput = Callable[[torch.Tensor], torch.Tensor]


def emulates(device_type: str, dtype: torch.dtype, allow: bool = True) -> bool:
    """Whether ``dtype`` GEMMs on ``device_type`` are emulated (:func:`mixprec.hardware.half_arithmetic`,
    which honours ``MIXPREC_HALF_ARITHMETIC``); ``allow=False`` (a policy's ``emulate_fp16=False``) never."""
    return allow and dtype in HALF_DTYPES and half_arithmetic(device_type, dtype).emulated


@torch.library.custom_op("mixprec::round_to_half", mutates_args=())
def _round_op(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype).float()


@_round_op.register_fake
def _(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_like(t, dtype=torch.float32)


def _round_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.dtype = inputs[1]
    ctx.input_dtype = inputs[0].dtype


def _round_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    # What the eager pair t.to(half).float() does in backward: the gradient leaves rounded to half
    # (the one rounding of the backward GEMM that produced it), in the input's dtype.
    return _round_op(grad, ctx.dtype).to(ctx.input_dtype), None


_round_op.register_autograd(_round_backward, setup_context=_round_setup)


def round_to_half(t: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """``t``'s values rounded to ``dtype`` (round-to-nearest-even), carried in fp32.

    Tensors that are not floating, or are float64 (which autocast leaves alone), come back unchanged.
    """
    if not t.is_floating_point() or t.dtype is torch.float64:
        return t
    if t.dtype is dtype:
        return t.float()  # exact: every half value is an fp32 value, so there is nothing to elide
    return _round_op(t, dtype)  # opaque: see "Compiled code" in the module docstring


def round_result(value: Any, dtype: torch.dtype = torch.float16) -> Any:
    """Every fp32 tensor in ``value`` rounded once to ``dtype``: the output rounding of a half GEMM."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.dtype is torch.float32 else t

    return map_tensors(cast, value)


class _LinearSavingHalf(torch.autograd.Function):
    """``F.linear`` on rounded fp32 operands whose backward keeps a half-precision input as it is.

    Left to autograd, the fp32 linear saves its fp32 input, the upcast of a half activation: twice the
    bytes of the activation, held until backward. Here a half input (the ``keep`` argument, the tensor
    ``x_r`` is the exact upcast of) is saved instead and upcast again in backward: half the saved bytes for
    one more pass, and often none at all, since the op that made the activation (a ReLU, say) saves it
    too. (Compiled code is unaffected: AOTAutograd re-partitions what is saved across forward and
    backward whatever the function saves.)

    The backward GEMMs are the ones autograd runs for linear, in fp32; gradients leave through the input
    roundings as in :func:`emulated` (equal to it up to fp32 summation order)."""

    @staticmethod
    def forward(
        ctx: Any, keep: torch.Tensor | None, x_r: torch.Tensor, w_r: torch.Tensor, b_r: torch.Tensor | None
    ) -> torch.Tensor:
        ctx.has_bias = b_r is not None
        _, need_x, need_w, _ = ctx.needs_input_grad
        # What autograd's linear saves: the input for the weight's gradient, the weight for the input's.
        x = (x_r if keep is None else keep) if need_w else None
        ctx.save_for_backward(x, w_r if need_x else None)
        return F.linear(x_r, w_r, b_r)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w_r = ctx.saved_tensors
        _, need_x, need_w, need_b = ctx.needs_input_grad
        # fp32 GEMMs, as the forward: no autocast region may turn them into slow half kernels here.
        with torch.autocast(grad.device.type, enabled=False):
            grad_x = grad.matmul(w_r) if need_x else None
            rows = grad.reshape(-1, grad.shape[-1])
            # the half input's exact upcast, the same values the forward GEMM read
            grad_w = rows.t().mm(x.reshape(-1, x.shape[-1]).float()) if need_w else None
            grad_b = rows.sum(0) if need_b and ctx.has_bias else None
        return None, grad_x, grad_w, grad_b


class _MatmulSavingHalf(torch.autograd.Function):
    """``a @ b`` (mm, bmm, matmul of equal batch shapes) on rounded fp32 operands, saving each half operand
    as it is, as :class:`_LinearSavingHalf` does: attention's q, k, v and probabilities stay half."""

    @staticmethod
    def forward(
        ctx: Any, a_keep: torch.Tensor | None, b_keep: torch.Tensor | None, a_r: torch.Tensor,
        b_r: torch.Tensor,
    ) -> torch.Tensor:
        _, _, need_a, need_b = ctx.needs_input_grad
        a = (a_r if a_keep is None else a_keep) if need_b else None
        b = (b_r if b_keep is None else b_keep) if need_a else None
        ctx.save_for_backward(a, b)
        return torch.matmul(a_r, b_r)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        a, b = ctx.saved_tensors
        _, _, need_a, need_b = ctx.needs_input_grad
        with torch.autocast(grad.device.type, enabled=False):  # fp32 GEMMs, as in _LinearSavingHalf
            grad_a = grad.matmul(b.float().transpose(-2, -1)) if need_a else None
            grad_b = a.float().transpose(-2, -1).matmul(grad) if need_b else None
        return None, None, grad_a, grad_b


# The calls _MatmulSavingHalf computes: a plain product of two matrices or of equal-shaped stacks of them.
MATMULS = frozenset(
    {torch.matmul, torch.Tensor.matmul, torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm}
)


def _matmul_operands(args: Any, kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(a, b) of ``a @ b`` without broadcasting or ``out=``, else None (left to the generic path)."""
    if kwargs or len(args) != 2 or not all(isinstance(t, torch.Tensor) for t in args):
        return None
    a, b = args
    if a.dim() < 2 or a.shape[:-2] != b.shape[:-2] or a.shape[-1] != b.shape[-2]:
        return None
    return a, b


def _kept(t: torch.Tensor, rounded: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``t`` itself when ``rounded`` is its exact upcast (``t`` already holds ``dtype``) and ``t`` is an
    activation, else None. A parameter's upcast is kept: it is made once per region (the cast cache) and
    not again in backward."""
    parameter = t.is_leaf and t.requires_grad
    return t if t.dtype is dtype and rounded.dtype is torch.float32 and not parameter else None


def _emulated_matmul(
    a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, rounder: RoundInput
) -> torch.Tensor:
    a_r, b_r = rounder(a), rounder(b)
    if a_r.dtype is not torch.float32 or b_r.dtype is not torch.float32:
        return round_result(torch.matmul(a_r, b_r), dtype)  # an operand left alone: torch's own rules
    return round_result(_MatmulSavingHalf.apply(_kept(a, a_r, dtype), _kept(b, b_r, dtype), a_r, b_r), dtype)


def _linear_operands(args: Any, kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, Any] | None:
    """(input, weight, bias) of an F.linear call, or None for any other form (left to the generic path)."""
    bound = dict(zip(("input", "weight", "bias"), args, strict=False)) | kwargs
    x, w, b = bound.get("input"), bound.get("weight"), bound.get("bias")
    if set(bound) - {"input", "weight", "bias"} or not isinstance(x, torch.Tensor):
        return None
    if not isinstance(w, torch.Tensor) or not (b is None or isinstance(b, torch.Tensor)):
        return None
    return x, w, b


def _emulated_linear(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, dtype: torch.dtype, rounder: RoundInput
) -> torch.Tensor:
    x_r, w_r = rounder(x), rounder(w)
    b_r = None if b is None else rounder(b)
    if any(t is not None and t.dtype is not torch.float32 for t in (x_r, w_r, b_r)):
        return round_result(F.linear(x_r, w_r, b_r), dtype)  # an operand left alone: torch's own rules
    return round_result(_LinearSavingHalf.apply(_kept(x, x_r, dtype), x_r, w_r, b_r), dtype)


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
    if func is F.linear and (linear := _linear_operands(args, kwargs)) is not None:
        return _emulated_linear(*linear, dtype, rounder)
    if func in MATMULS and (product := _matmul_operands(args, kwargs)) is not None:
        return _emulated_matmul(*product, dtype, rounder)
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
