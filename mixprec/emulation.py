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
``t.to(half).float()`` is compiled to nothing and the GEMM silently reads unrounded inputs. Compiled code
therefore rounds fp32 inputs by arithmetic (:data:`COMPILED_ROUNDING`): bf16 by torch's own formula on the
bits, fp16 by dividing x by fp16's spacing around it (a power of two), ``torch.round`` (ties to even), and
the product. No compiler may elide that, and Inductor fuses it into the ops around it: no pass of its own.
Eager code, where nothing fuses, runs the cast pair itself. Both give the same bits, forward and backward
(tests/test_emulation.py, every class of fp32 value). They replaced an opaque custom op, whose Python
dispatch (~80 us a call) and unfusable passes made a small GPT's emulated bf16 step 1.5x fp32's eager and
1.3x compiled. Two roundings compiled code can still lose (strict xfails in tests/test_emulation.py): a
GEMM's half result read by an fp32 op Inductor fuses with its cast, and a half input cast from fp32 in the
same fused kernel. Rounding those by arithmetic too made the small GPT's compiled step 1.4-1.9x fp32's.
The rounding is all that is emulated, not the GEMM: every GEMM and convolution keeps torch's own fp32
forward and backward kernels.

Cost: linear, plain matrix products and convolutions save a half activation as it is for backward and
upcast it again there (:mod:`mixprec.half_saving_gemms`: an O2 MLP's saved activations 25.9 -> 9.1 MiB,
below fp32's 17.6); other call forms save the fp32 copies of their rounded inputs (twice the bytes of
half). Each weight is rounded (or upcast) once per region however often it is used, and not again in
backward. The roundings are memory-bound passes: 14-18% of an eager emulated step of the
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

from mixprec.half_saving_gemms import half_saving_gemm
from mixprec.hardware import HALF_DTYPES, half_arithmetic
from mixprec.tensor_args import iter_tensors, map_tensors

__all__ = ["emulated", "emulates", "round_result", "round_to_half"]

RoundInput = Callable[[torch.Tensor], torch.Tensor]


def emulates(device_type: str, dtype: torch.dtype, allow: bool = True) -> bool:
    """Whether ``dtype`` GEMMs on ``device_type`` are emulated (:func:`mixprec.hardware.half_arithmetic`,
    which honours ``MIXPREC_HALF_ARITHMETIC``); ``allow=False`` (a policy's ``emulate_fp16=False``) never."""
    return allow and dtype in HALF_DTYPES and half_arithmetic(device_type, dtype).emulated


# Compiled code's roundings (module docstring, "Compiled code"): fp32 x to the nearest value of the half
# format (ties to even), carried in fp32, by ops no compiler may elide, each value read as few times as it
# can be (Inductor inlines a value into every use, so nested roundings multiply their reads), and no
# subnormal operand where the inputs are normal (x86 takes ~100 cycles per subnormal operation: ReLU
# zeros would pay it).


def _round_bf16(x: torch.Tensor) -> torch.Tensor:
    # torch's own conversion (c10's round_to_nearest_even) on the bits: add 0x7FFF, plus 1 where the kept
    # part is odd (ties to even), and keep the high 16 bits. A carry moves the exponent up, to inf past
    # bf16's largest value as in the cast.
    bits = x.view(torch.int32)
    rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) & -65536).view(torch.float32)
    return torch.where(x.isnan(), x, rounded)  # a NaN's sum may carry into its sign or leave inf


def _round_fp16(x: torch.Tensor) -> torch.Tensor:
    # x divided by fp16's spacing around it, rounded to an integer by torch.round (ties to even), multiplied
    # back. The spacing is 2**(x's exponent - 10) but never below fp16's subnormal spacing 2**-24: a power of
    # two, so the division and the products are exact. Its upper bound keeps inf/NaN (exponent bits all
    # ones: spacing inf) from dividing inf by inf. Overflow: scaled up by 2**112 the product overflows fp32
    # exactly where the rounded value reaches 2**16 (fp16's largest finite value is 65504), and inf stays
    # inf when scaled back.
    power = (x.view(torch.int32) & 0x7F800000).view(torch.float32)  # 2**(x's exponent); 0 if subnormal
    spacing = torch.clamp(power * 2.0**-10, 2.0**-24, 2.0**117)
    return torch.round(x / spacing) * (spacing * 2.0**112) * 2.0**-112


# half dtype -> compiled code's rounding of fp32 values to it
COMPILED_ROUNDING: dict[torch.dtype, Callable[[torch.Tensor], torch.Tensor]] = {
    torch.bfloat16: _round_bf16,
    torch.float16: _round_fp16,
}


class _CompiledRound(torch.autograd.Function):
    """The rounding compiled code traces (module docstring, "Compiled code"). Backward rounds the gradient
    and returns it in the input's dtype, as the eager pair ``t.to(half).float()`` does: the one rounding of
    the backward GEMM that produced it."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.dtype, ctx.input_dtype = dtype, t.dtype
        return COMPILED_ROUNDING[dtype](t.float())  # a half input upcasts exactly

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return COMPILED_ROUNDING[ctx.dtype](grad.float()).to(ctx.input_dtype), None


def round_to_half(t: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """``t``'s values rounded to ``dtype`` (round-to-nearest-even), carried in fp32.

    Tensors that are not floating, or are float64 (which autocast leaves alone), come back unchanged.
    """
    if not t.is_floating_point() or t.dtype is torch.float64:
        return t
    if t.dtype is dtype:
        return t.float()  # exact: every half value is an fp32 value
    if torch.compiler.is_compiling():
        return _CompiledRound.apply(t, dtype)  # a cast pair would be elided: see "Compiled code" above
    return t.to(dtype).float()  # two of torch's casts, autograd rounding the gradient alike


def round_result(value: Any, dtype: torch.dtype = torch.float16) -> Any:
    """Every fp32 tensor in ``value`` rounded once to ``dtype``: the output rounding of a half GEMM."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.dtype is torch.float32 else t

    return cast(value) if isinstance(value, torch.Tensor) else map_tensors(cast, value)  # mostly one tensor


# Arguments of the GEMM family that are not GEMM operands, by the op's name: attention's additive mask
# (ALiBi's bias), which torch's half kernels take as given, an fp32 one in fp32. Rounding a bias of ~300 to
# bf16 moved a head's outputs by 0.7 where torch's kernel moved them by 0.005. (position, keyword) of each.
# Emulated GEMMs round the operands only, and a native half region casts only the operands of a mixed call.
NOT_OPERANDS: dict[str, tuple[int, str]] = {"scaled_dot_product_attention": (3, "attn_mask")}


def map_operands(
    name: str, args: Any, kwargs: dict[str, Any], operand: Callable[[Any], Any], other: Callable[[Any], Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` of the op ``name`` with ``operand`` applied to its GEMM operands and ``other``
    to the arguments that are not (:data:`NOT_OPERANDS`)."""
    position, keyword = NOT_OPERANDS.get(name, (-1, ""))
    mapped = tuple(other(a) if i == position else operand(a) for i, a in enumerate(args))
    return mapped, {k: other(v) if k == keyword else operand(v) for k, v in kwargs.items()}


def _rounded_operands(
    func: Callable[..., Any], args: Any, kwargs: dict[str, Any], rounder: RoundInput
) -> tuple[Any, dict[str, Any]]:
    """Every GEMM operand rounded by ``rounder``; an argument that is not one upcast exactly where it is
    half, else left as given."""
    name = getattr(func, "__name__", "")
    if name not in NOT_OPERANDS:  # every tensor is an operand (all GEMMs but attention): one walk
        return map_tensors(rounder, args), map_tensors(rounder, kwargs)

    def as_given(value: Any) -> Any:
        return map_tensors(lambda t: t.float() if t.dtype in HALF_DTYPES else t, value)

    return map_operands(name, args, kwargs, lambda v: map_tensors(rounder, v), as_given)


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
    saving_half = half_saving_gemm(func, args, kwargs, dtype, rounder)  # linear, matmul, conv: most calls
    if saving_half is not None:
        return round_result(saving_half, dtype)
    out = kwargs.get("out")
    if out is not None:  # compute into a fresh fp32 result, then write the caller's half tensor
        kwargs = {k: v for k, v in kwargs.items() if k != "out"}
    args, kwargs = _rounded_operands(func, args, kwargs, rounder)
    result = round_result(func(*args, **kwargs), dtype)
    if out is None:
        return result
    with torch.no_grad():
        for dst, src in zip(iter_tensors(out), iter_tensors(result), strict=True):
            dst.copy_(src)
    return out
