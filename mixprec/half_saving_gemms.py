"""Emulated GEMMs whose backward keeps half-precision activations as they are.

An emulated GEMM (:mod:`mixprec.emulation`) runs torch's fp32 op on the fp32 upcasts of its rounded
inputs. Left to autograd, that op saves the fp32 upcasts for backward: twice the bytes of the half
activations they came from, held until backward (an emulated O2 MLP saved 25.9 MiB where fp32 saves 17.6).
The autograd functions here run the same fp32 op but save a half activation itself (an fp32 one, in O1:
its half cast, which the rounding makes anyway) and upcast it again in backward (exact), so saved
activations take what native half kernels take, and often nothing extra,
since the op that made the activation (a ReLU, say) saves it too. A parameter's fp32 copy is saved as
before: it is made once per region (the cast cache) and not again in backward. The price is that upcast
in backward: measured 1.03-1.10x the step time of an O2 CNN, within noise for MLPs and a GPT, on a 2-core
AVX2-only EPYC (benchmarks/RESULTS.md).

Covered: ``F.linear``; plain matrix products (mm, bmm, matmul of equal batch shapes); ``F.conv1d/2d/3d``
and ``F.conv_transpose1d/2d/3d`` with numeric padding; ``F.scaled_dot_product_attention`` of half q, k,
v on the CPU where torch picks its flash kernel (no mask, no dropout: q, k, v and the half output saved,
as torch's half kernel saves them, not their fp32 copies and an fp32 output). Other call forms
(broadcasting matmul, ``out=``, ``padding="same"``, a masked attention) return None and keep the generic
path, as do GEMMs but attention of fewer than ``FEW_ACTIVATIONS`` activation elements (their Python costs more
time than their bytes are worth; attention stays, so its gradients do not change with the batch). The backward
runs the kernels autograd runs for these ops, in fp32: results equal the generic emulation bit for bit
(tests/test_half_saving_gemms.py), but for attention's q and k gradients, which read the half output (about
one half rounding apart). Compiled code is unaffected: AOTAutograd re-partitions what is saved across forward
and backward whatever a function saves (attention keeps the generic path there), and so do torch.func's
transforms and forward-mode AD (plain ops compose with them: :mod:`mixprec.func_transforms`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
from torch.nn.attention import SDPBackend

from mixprec.func_transforms import inside_transform

__all__ = ["half_saving_gemm"]

RoundInput = Callable[[torch.Tensor], torch.Tensor]


def _parameter(t: torch.Tensor) -> bool:
    """A leaf that requires grad (torch's rule for what the cast cache keeps): not an activation."""
    return t.is_leaf and t.requires_grad


def _kept(t: torch.Tensor, rounded: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``t`` itself when ``rounded`` is its exact upcast (``t`` already holds ``dtype``) and ``t`` is an
    activation, else None (then the rounded fp32 copy is saved, as the generic path saves it)."""
    return t if t.dtype is dtype and rounded.dtype is torch.float32 and not _parameter(t) else None


def _round(
    t: torch.Tensor, dtype: torch.dtype, rounder: RoundInput
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(``t`` rounded to ``dtype`` and carried in fp32, the half tensor to save for it or None).

    An fp32 activation (an O1 model's LayerNorm output, the input batch) is rounded through its half cast,
    the two casts the generic rounding makes, and that half tensor is what backward keeps: what a native
    half kernel saves, half the bytes of the fp32 copy, which now lives only through the forward.
    Parameters keep the rounder's cached copy; compiled code the rounder's arithmetic rounding.
    """
    if t.dtype is torch.float32 and not _parameter(t) and not torch.compiler.is_compiling():
        half = t.to(dtype)
        rounded = rounder(half)  # its exact upcast; ``half`` itself where the region leaves t alone
        return rounded, _kept(half, rounded, dtype)
    rounded = rounder(t)
    return rounded, _kept(t, rounded, dtype)


# Below this many activation elements in a GEMM's operands, the generic path (autograd saves the fp32
# upcasts) runs instead: it saves at most 16 KiB more per GEMM, where this module's autograd functions
# cost ~70 us of Python a call, forward and backward (a neural ODE's 32x17 and 32x64 GEMMs: its step 1.4x
# the generic path's, on a 2-core AVX2 EPYC). From 4096 elements on (the digits MLP's first layer at
# batch 64), the bytes saved are kept: a half model's saved activations stay below fp32's.
FEW_ACTIVATIONS = 1 << 12


def _few_activations(args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether a GEMM's activations (its operands but parameters) are too small for their bytes to matter.
    Eager only: compiled code partitions what it saves itself (module docstring)."""
    if torch.compiler.is_compiling():
        return False
    elements = 0
    for operands in (args, kwargs.values()):
        for t in operands:
            if isinstance(t, torch.Tensor) and not _parameter(t):
                elements += t.numel()
    return elements < FEW_ACTIVATIONS


def _saved(keep: torch.Tensor | None, rounded: torch.Tensor) -> torch.Tensor:
    return rounded if keep is None else keep


# ---- linear ---------------------------------------------------------------------------------------------


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, keep: torch.Tensor | None, x_r: torch.Tensor, w_r: torch.Tensor, b_r: torch.Tensor | None
    ) -> torch.Tensor:
        ctx.has_bias = b_r is not None
        _, need_x, need_w, _ = ctx.needs_input_grad
        # What autograd's linear saves: the input for the weight's gradient, the weight for the input's.
        ctx.save_for_backward(_saved(keep, x_r) if need_w else None, w_r if need_x else None)
        return F.linear(x_r, w_r, b_r)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w_r = ctx.saved_tensors
        _, need_x, need_w, need_b = ctx.needs_input_grad
        # fp32 GEMMs, as the forward: no autocast region may turn them into slow half kernels here.
        with torch.autocast(grad.device.type, enabled=False):
            grad_x = grad.matmul(w_r) if need_x else None
            rows = grad.reshape(-1, grad.shape[-1])
            grad_w = rows.t().mm(x.reshape(-1, x.shape[-1]).float()) if need_w else None  # exact upcast
            grad_b = rows.sum(0) if need_b and ctx.has_bias else None
        return None, grad_x, grad_w, grad_b


def _linear(
    args: Any, kwargs: dict[str, Any], dtype: torch.dtype, rounder: RoundInput
) -> torch.Tensor | None:
    bound = dict(zip(("input", "weight", "bias"), args, strict=False)) | kwargs
    x, w, b = bound.get("input"), bound.get("weight"), bound.get("bias")
    if set(bound) - {"input", "weight", "bias"} or not _tensors(x, w) or not (b is None or _tensors(b)):
        return None
    (x_r, keep), w_r = _round(x, dtype, rounder), rounder(w)
    b_r = None if b is None else rounder(b)
    if not _all_fp32(x_r, w_r, b_r):
        return None
    return _Linear.apply(keep, x_r, w_r, b_r)


# ---- matrix products --------------------------------------------------------------------------------------


class _Matmul(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, a_keep: torch.Tensor | None, b_keep: torch.Tensor | None, a_r: torch.Tensor,
        b_r: torch.Tensor,
    ) -> torch.Tensor:
        _, _, need_a, need_b = ctx.needs_input_grad
        a, b = _saved(a_keep, a_r), _saved(b_keep, b_r)
        ctx.save_for_backward(a if need_b else None, b if need_a else None)
        return torch.matmul(a_r, b_r)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        a, b = ctx.saved_tensors
        _, _, need_a, need_b = ctx.needs_input_grad
        with torch.autocast(grad.device.type, enabled=False):  # fp32 GEMMs, as in _Linear
            grad_a = grad.matmul(b.float().transpose(-2, -1)) if need_a else None
            grad_b = a.float().transpose(-2, -1).matmul(grad) if need_b else None
        return None, None, grad_a, grad_b


def _matmul(
    func: Callable[..., Any], args: Any, kwargs: dict[str, Any], dtype: torch.dtype, rounder: RoundInput
) -> torch.Tensor | None:
    # Only a product of two matrices or of equal-shaped stacks of them, of the rank the function takes: no
    # vectors, no broadcasting, no out=. Anything else (and every call torch would refuse) goes generic.
    if kwargs or len(args) != 2 or not _tensors(*args):
        return None
    a, b = args
    rank = MATMULS[func]
    if a.dim() != b.dim() or a.dim() < 2 or (rank is not None and a.dim() != rank):
        return None
    if a.shape[:-2] != b.shape[:-2] or a.shape[-1] != b.shape[-2]:
        return None
    (a_r, a_keep), (b_r, b_keep) = _round(a, dtype, rounder), _round(b, dtype, rounder)
    if not _all_fp32(a_r, b_r):
        return None
    return _Matmul.apply(a_keep, b_keep, a_r, b_r)


# ---- convolutions -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ConvGeometry:
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int
    transposed: bool
    output_padding: tuple[int, ...]

    def bias_size(self, weight: torch.Tensor) -> int:
        # output channels: a convolution's weight is (out, in / groups, ...), a transposed one's
        # (in, out / groups, ...)
        return weight.shape[1] * self.groups if self.transposed else weight.shape[0]


class _Conv(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, keep: torch.Tensor | None, x_r: torch.Tensor, w_r: torch.Tensor, b_r: torch.Tensor | None,
        geometry: _ConvGeometry,
    ) -> torch.Tensor:
        ctx.geometry, ctx.has_bias = geometry, b_r is not None
        ctx.save_for_backward(_saved(keep, x_r), w_r)  # autograd's convolution saves both as well
        g = geometry
        return torch.convolution(x_r, w_r, b_r, g.stride, g.padding, g.dilation, g.transposed,
                                 g.output_padding, g.groups)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w_r = ctx.saved_tensors
        _, need_x, need_w, need_b, _ = ctx.needs_input_grad
        g = ctx.geometry
        with torch.autocast(grad.device.type, enabled=False):  # fp32 kernels, as in _Linear
            grad_x, grad_w, grad_b = torch.ops.aten.convolution_backward(
                grad, x.float(), w_r, [g.bias_size(w_r)] if ctx.has_bias else None, g.stride, g.padding,
                g.dilation, g.transposed, g.output_padding, g.groups,
                [need_x, need_w, need_b and ctx.has_bias],
            )
        return None, grad_x, grad_w, grad_b, None


# function -> (spatial dims, transposed)
CONVOLUTIONS: dict[Callable[..., Any], tuple[int, bool]] = {
    F.conv1d: (1, False), F.conv2d: (2, False), F.conv3d: (3, False),
    F.conv_transpose1d: (1, True), F.conv_transpose2d: (2, True), F.conv_transpose3d: (3, True),
}
# their parameters in order (a transposed convolution's output_padding and groups come before dilation)
_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_TRANSPOSE_ARGS = (
    "input", "weight", "bias", "stride", "padding", "output_padding", "groups", "dilation"
)


def _conv(
    func: Callable[..., Any], args: Any, kwargs: dict[str, Any], dtype: torch.dtype, rounder: RoundInput
) -> torch.Tensor | None:
    dims, transposed = CONVOLUTIONS[func]
    names = _CONV_TRANSPOSE_ARGS if transposed else _CONV_ARGS
    bound = dict(zip(names, args, strict=False)) | kwargs
    x, w, b = bound.get("input"), bound.get("weight"), bound.get("bias")
    padding = bound.get("padding", 0)
    if set(bound) - set(names) or isinstance(padding, str) or not _tensors(x, w):
        return None
    if not (b is None or _tensors(b)) or x.dim() != dims + 2:  # unbatched input: the generic path
        return None

    def per_dim(value: int | tuple[int, ...]) -> tuple[int, ...]:
        return (value,) * dims if isinstance(value, int) else tuple(value)

    geometry = _ConvGeometry(per_dim(bound.get("stride", 1)), per_dim(padding),
                             per_dim(bound.get("dilation", 1)), int(bound.get("groups", 1)), transposed,
                             per_dim(bound.get("output_padding", 0)))
    (x_r, keep), w_r = _round(x, dtype, rounder), rounder(w)
    b_r = None if b is None else rounder(b)
    if not _all_fp32(x_r, w_r, b_r):
        return None
    return _Conv.apply(keep, x_r, w_r, b_r, geometry)


# ---- attention --------------------------------------------------------------------------------------------


class _Attention(torch.autograd.Function):
    """CPU flash attention (torch's own fp32 kernel, forward and backward) on the upcasts of half q, k, v,
    saving the half q, k, v and output as a native half kernel saves them. The output is returned rounded
    to the half dtype: that rounded output is what backward reads (as a half kernel's backward reads its
    half output), so gradients differ from the generic path's (which reads the fp32 output) by about one
    half rounding of that output's part."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float | None
    ) -> torch.Tensor:
        ctx.is_causal, ctx.scale = is_causal, scale
        # Exact upcasts: a half value is an fp32 value. fp32 accumulation inside the kernel.
        out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.float(), k.float(), v.float(), 0.0, is_causal, scale=scale
        )
        half_out = out.to(q.dtype)  # the op's one rounding of its result
        ctx.save_for_backward(q, k, v, half_out, logsumexp)
        return half_out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, logsumexp = ctx.saved_tensors
        with torch.autocast(grad.device.type, enabled=False):  # fp32 kernels, as in _Linear
            grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad.float(), q.float(), k.float(), v.float(), out.float(), logsumexp, 0.0, ctx.is_causal,
                scale=ctx.scale,
            )
        # each gradient leaves rounded to its input's half dtype, as the generic path's input cast rounds it
        return *(g.to(t.dtype) for g, t in zip(grads, (q, k, v), strict=True)), None, None


_ATTENTION_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _attention(args: Any, kwargs: dict[str, Any], dtype: torch.dtype) -> torch.Tensor | None:
    # The call form the CPU flash kernel takes: half q, k, v activations on the CPU, no mask, no dropout,
    # no grouped heads, and the kernel torch itself picks for them (a sdpa_kernel() choice is honoured).
    # Everything else (and compiled code, whose partitioner decides what is saved) goes generic.
    bound = dict(zip(_ATTENTION_ARGS, args, strict=False)) | kwargs
    q, k, v = bound.get("query"), bound.get("key"), bound.get("value")
    if set(bound) - set(_ATTENTION_ARGS) or not _tensors(q, k, v) or torch.compiler.is_compiling():
        return None
    if bound.get("attn_mask") is not None or bound.get("dropout_p", 0.0) or bound.get("enable_gqa", False):
        return None
    if not all(t.dtype is dtype and t.device.type == "cpu" and not _parameter(t) for t in (q, k, v)):
        return None
    is_causal, scale = bool(bound.get("is_causal", False)), bound.get("scale")
    # the choice for the half tensors: the CPU flash kernel takes fp32, bf16 and fp16 alike
    if _sdp_choice(q, k, v, is_causal, scale) != int(SDPBackend.FLASH_ATTENTION):
        return None
    return _Attention.apply(q, k, v, is_causal, scale)


def _sdp_choice(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float | None
) -> int:
    """The kernel torch picks for q, k, v. The memory estimate's fake tensors get MATH from torch's fake
    kernel whatever they are (its O2 estimate then counted an attention's fp32 copies: 324 KiB against the
    164 measured), so for them torch is asked about real stand-ins: one batch row and head of the same
    shapes, dtype and last-dimension layout (what the CPU choice reads)."""
    if not is_fake(q):
        return torch._fused_sdp_choice(q, k, v, None, 0.0, is_causal, scale=scale)

    def stand_in(t: torch.Tensor) -> torch.Tensor:
        lead, (rows, cols) = (1,) * (t.dim() - 2), t.shape[-2:]
        if t.stride(-1) == 1:
            return torch.empty(*lead, rows, cols, dtype=t.dtype)
        return torch.empty(*lead, cols, rows, dtype=t.dtype).transpose(-2, -1)

    with unset_fake_temporarily():
        return torch._fused_sdp_choice(*map(stand_in, (q, k, v)), None, 0.0, is_causal, scale=scale)


# ---- dispatch ---------------------------------------------------------------------------------------------


def _tensors(*values: Any) -> bool:
    return all(isinstance(v, torch.Tensor) for v in values)


def _all_fp32(*rounded: torch.Tensor | None) -> bool:
    # An operand the rounder left alone (another device, float64): torch's own rules, the generic path.
    return all(t is None or t.dtype is torch.float32 for t in rounded)


# The matrix products _Matmul computes, and the rank each takes (None: matmul, any rank from 2 up).
MATMULS: dict[Callable[..., Any], int | None] = {
    torch.matmul: None, torch.Tensor.matmul: None, torch.mm: 2, torch.Tensor.mm: 2, torch.bmm: 3,
    torch.Tensor.bmm: 3,
}


def half_saving_gemm(
    func: Callable[..., Any], args: Any, kwargs: dict[str, Any], dtype: torch.dtype, rounder: RoundInput
) -> torch.Tensor | None:
    """The fp32 result (not yet rounded to ``dtype``) of ``func`` on ``rounder``'s copies of its inputs,
    with backward saving half activations as they are; None where ``func`` or its call form is not
    covered, and inside torch.func's transforms and forward-mode AD, where plain ops compose and these
    autograd functions would not (:mod:`mixprec.func_transforms`): the caller then takes the generic path."""
    if inside_transform():
        return None
    if func is F.scaled_dot_product_attention:  # at any size: its q, k gradients are not the generic path's
        return _attention(args, kwargs, dtype)
    if _few_activations(args, kwargs):  # the same values either way, cheaper per call
        return None
    if func is F.linear:
        return _linear(args, kwargs, dtype, rounder)
    if func in MATMULS:
        return _matmul(func, args, kwargs, dtype, rounder)
    if func in CONVOLUTIONS:
        return _conv(func, args, kwargs, dtype, rounder)
    return None
