"""The op tables, as plain data: torch's own autocast tables, mixprec's deviations, apex O1's extra fp32
ops, and the ops a half-precision model still computes in fp32.

torch's tables mirror its "Autocast Op Reference" op by op for each device, read from
``aten/src/ATen/autocast_mode.cpp`` of torch 2.13 (CUDA and CPU lists differ a lot: on CPU, softmax, exp
and sum are *not* fp32). Every entry where mixprec deliberately differs from torch carries its reason
(``OpRule.reason``); the tests check the torch-sourced entries against the kernels registered with the
dispatcher and against torch.autocast's output dtypes.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

import torch

from mixprec.policy.rules import Action, OpRule, Source

__all__ = [
    "APEX_EXTRA_FP32",
    "HALF_MODEL_FP32_ACTIVATIONS",
    "HALF_MODEL_FP32_LOSSES",
    "HALF_MODEL_FP32_RESULTS",
    "MIXPREC_CPU_DEVIATIONS",
    "RECURRENT_OPS",
    "TORCH_CPU",
    "TORCH_CUDA",
    "TORCH_TABLES",
]


def _torch_rules(action: Action, *ops: str) -> tuple[OpRule, ...]:
    return tuple(OpRule(op, action) for op in ops)


# --------------------------------------------------------------------------------------------------------
# torch's tables (torch 2.13, aten/src/ATen/autocast_mode.cpp), by base op name; all overloads of a name
# share a policy there. Kept in torch's order so a diff against a newer torch is easy to read.
# --------------------------------------------------------------------------------------------------------

# The torch release the tables were read from. Other releases list a few ops differently (torch 2.11's
# CUDA list has _cudnn_rnn and lacks rms_norm; 2.14.1's adds linalg_matrix_sqrth on both devices and
# _cudnn_rnn on CUDA, and drops CPU cholesky and qr, whose linalg_ forms stay fp32); there torch's own
# autocast handles those ops as it does.
TABLES_TORCH_VERSION = (2, 13)

TORCH_CPU: tuple[OpRule, ...] = (
    *_torch_rules(
        Action.LOWER,
        "conv1d", "conv2d", "conv3d", "bmm", "mm", "linalg_vecdot", "baddbmm", "addmm",
        "_addmm_activation", "addbmm", "linear", "_convolution", "matmul", "conv_tbc", "mkldnn_rnn_layer",
        "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "prelu", "scaled_dot_product_attention",
        "_native_multi_head_attention",
    ),
    *_torch_rules(
        Action.FP32,
        "avg_pool3d", "binary_cross_entropy", "grid_sampler", "polar", "prod", "quantile", "nanquantile",
        "stft", "cdist", "grid_sampler_2d", "_grid_sampler_2d_cpu_fallback", "grid_sampler_3d", "trace",
        "view_as_complex", "cholesky", "cholesky_inverse", "cholesky_solve", "inverse", "lu_solve", "orgqr",
        "ormqr", "pinverse", "max_pool3d", "max_unpool2d", "max_unpool3d", "adaptive_avg_pool3d",
        "reflection_pad1d", "reflection_pad2d", "replication_pad1d", "replication_pad2d",
        "replication_pad3d", "mse_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
        "hinge_embedding_loss", "poisson_nll_loss", "smooth_l1_loss", "cross_entropy_loss", "l1_loss",
        "huber_loss", "margin_ranking_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
        "ctc_loss", "kl_div", "multilabel_margin_loss", "binary_cross_entropy_with_logits", "fft_fft",
        "fft_ifft", "fft_fft2", "fft_ifft2", "fft_fftn", "fft_ifftn", "fft_rfft", "fft_irfft", "fft_rfft2",
        "fft_irfft2", "fft_rfftn", "fft_irfftn", "fft_hfft", "fft_ihfft", "linalg_cond", "linalg_matrix_rank",
        "linalg_solve", "linalg_cholesky", "linalg_svdvals", "linalg_eigvals", "linalg_eigvalsh",
        "linalg_inv", "linalg_householder_product", "linalg_tensorinv", "linalg_tensorsolve",
        "fake_quantize_per_tensor_affine", "geqrf", "_lu_with_info", "qr", "svd", "triangular_solve",
        "fractional_max_pool2d", "fractional_max_pool3d", "adaptive_max_pool3d",
        "multilabel_margin_loss_forward", "linalg_qr", "linalg_cholesky_ex", "linalg_svd", "linalg_eig",
        "linalg_eigh", "linalg_lstsq", "linalg_inv_ex",
    ),
    *_torch_rules(Action.PROMOTE, "stack", "cat", "index_copy"),
)  # fmt: skip

# What to do instead of BCELoss on half probabilities (also O1's scale_loss refusal, mixprec.amp).
BCE_ADVICE = (
    "Use torch.nn.BCEWithLogitsLoss (or F.binary_cross_entropy_with_logits) on the logits instead: it fuses "
    "the sigmoid and is fp32 under autocast. To keep BCELoss, compute the sigmoid in fp32 too "
    "(mixprec.register_float_function(torch, 'sigmoid'), or the module applying it in mixprec.keep_fp32) "
    "and call BCELoss outside the region."
)
_BCE_FIX = (
    "it takes probabilities, so a sigmoid (or softmax) runs before it in half precision, where "
    "sigmoid(x) rounds to 1 for x > ~8.3 in fp16 (> ~6.2 in bf16) and log(1 - 1) gives inf. " + BCE_ADVICE
)

TORCH_CUDA: tuple[OpRule, ...] = (
    *_torch_rules(
        Action.LOWER,
        "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
        "conv_transpose3d", "convolution", "cudnn_convolution", "cudnn_convolution_transpose", "prelu",
        "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm",
        "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell",
        "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
        "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
    ),
    *_torch_rules(
        Action.FP32,
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
        "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "rms_norm",
        "group_norm", "frobenius_norm", "nuclear_norm", "cosine_similarity", "poisson_nll_loss",
        "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss",
        "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
        "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits",
        "dist", "pdist", "cdist", "renorm", "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d",
        "upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d",
        "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d",
        "upsample_bicubic2d", "_upsample_bicubic2d_aa",
        # torch's "fp32_set_opt_dtype" ops: it passes dtype=float32 instead of casting; same result dtype.
        "prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm", "linalg_matrix_norm",
        "sum",
        # torch's "fp32_append_dtype" op.
        "norm",
    ),
    *_torch_rules(
        Action.PROMOTE,
        "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
        "tensordot", "scatter_add",
    ),
    # torch raises for any autocast dtype on CUDA (binary_cross_entropy_banned).
    OpRule("binary_cross_entropy", Action.BANNED, reason=_BCE_FIX, source=Source.TORCH),
)  # fmt: skip


# mixprec's deliberate deviations in the default preset, each with its reason.
MIXPREC_CPU_DEVIATIONS: tuple[OpRule, ...] = (
    OpRule(
        "binary_cross_entropy",
        Action.BANNED,
        dtypes=(torch.float16,),
        source=Source.MIXPREC,
        # Not under bf16 on the CPU, though its sigmoid saturates sooner: that ban would put a Python layer
        # into every bf16 region there, which torch's autocast otherwise runs alone (P.TORCH.overrides).
        reason="CUDA bans it, CPU runs it in fp32; we ban it under fp16 on every device because " + _BCE_FIX,
    ),
)

# apex O1 kept these in fp32 on top of what torch's tables do (apex/amp/lists). One reason per group.
_APEX_POINTWISE = (
    "apex O1 kept transcendental pointwise ops in fp32: their results (exp, pow) overflow fp16 at inputs "
    "around 11, and log/rsqrt of half inputs lose the low bits that later sums need"
)
_APEX_REDUCTION = (
    "apex O1 kept reductions in fp32: a long sum/var/norm in half precision loses everything below "
    "eps * |running total| (eps = 2**-10 for fp16, 2**-7 for bf16)"
)
_APEX_SOFTMAX = (
    "apex O1 kept softmax-family ops in fp32 (torch does too on CUDA, not on CPU): exp of unnormalised "
    "logits overflows and the normaliser is a long sum"
)
_APEX_NORM = (
    "apex O1 kept normalisation layers in fp32: mean and variance are reductions over the whole feature "
    "dimension"
)
_APEX_LOSS = "apex O1 kept losses in fp32: a loss reduces over the batch, and its gradient seeds backward"
_APEX_GELU = (
    "kept in fp32 by the conservative preset: elementwise, so the upcast costs memory traffic only, and "
    "gelu's tail for x < -4 (|gelu| < 1e-4) falls into fp16's subnormals, where it has < 10 bits of precision"
)


def _apex_rules(reason: str, *ops: str) -> tuple[OpRule, ...]:
    return tuple(OpRule(op, Action.FP32, source=Source.MIXPREC, reason=reason) for op in ops)


APEX_EXTRA_FP32: tuple[OpRule, ...] = (
    *_apex_rules(
        _APEX_POINTWISE,
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
        "rsqrt", "sinh", "tan", "pow",
    ),
    *_apex_rules(_APEX_REDUCTION, "cumprod", "cumsum", "dist", "norm", "prod", "std", "sum", "var", "renorm"),
    *_apex_rules(_APEX_SOFTMAX, "softmax", "log_softmax", "softmin", "softplus"),
    *_apex_rules(
        _APEX_NORM, "layer_norm", "group_norm", "local_response_norm", "normalize", "cosine_similarity"
    ),
    *_apex_rules(
        _APEX_LOSS,
        "poisson_nll_loss", "cosine_embedding_loss", "cross_entropy_loss", "hinge_embedding_loss", "kl_div",
        "l1_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "multilabel_soft_margin_loss",
        "multi_margin_loss", "nll_loss", "binary_cross_entropy_with_logits", "smooth_l1_loss",
        "soft_margin_loss", "triplet_margin_loss",
    ),
    *_apex_rules(_APEX_GELU, "gelu"),
)  # fmt: skip


# torch's own table per device type: what torch.autocast does with no Python layer at all.
TORCH_TABLES: Mapping[str, tuple[OpRule, ...]] = types.MappingProxyType(
    {"cpu": TORCH_CPU, "cuda": TORCH_CUDA}
)


# --------------------------------------------------------------------------------------------------------
# Half-precision *models* (apex O2/O3, fastai's to_fp16): the weights are already half, so autocast's
# tables do not apply, but these ops still compute in fp32 (mixprec.half_compute). Activations go back to
# the input's half dtype so the model's dtype flow is unchanged; a loss stays fp32.
# --------------------------------------------------------------------------------------------------------

HALF_MODEL_FP32_ACTIVATIONS: tuple[str, ...] = (
    # exp of unnormalised logits overflows fp16 and the normaliser is a long sum
    "softmax", "log_softmax", "logsumexp",
    # mean and variance are reductions over the whole feature dimension
    "layer_norm", "group_norm", "rms_norm",
    # exp overflows fp16 from x ~ 11; log of half inputs loses the low bits later sums need
    "exp", "log",
    # a long sum in half loses everything below eps * |running total| (eps 2**-10 fp16, 2**-7 bf16)
    "sum", "mean",
    # segment sums add each source row into its slot in the target's dtype on the CPU: a GNN's degree of
    # a node with 1501 edges, index_add_ of ones into bf16 zeros, summed to 256 (256 + 1 rounds to 256).
    # The in-place forms compute into an fp32 copy of the target and write its rounding back.
    "index_add", "index_add_", "scatter_add", "scatter_add_",
    # pairwise distances: torch's autocast tables run cdist in fp32 (a difference of nearby points cancels
    # in half), and its CPU kernel has no half form at all ("cdist not implemented for 'Half'", a DETR
    # trial's matcher in a half model)
    "cdist",
    # matrix norms (the spectral one has no half kernel: "Low precision dtypes not supported") and the
    # matrix exponential, whose CPU half kernel returns NaN (torch 2.13, 8x8 skew-symmetric matrices of
    # norm ~0.01 or ~1: parametrizations.orthogonal's default map skipped every O2 step). Activations: an
    # L2 normalisation by linalg.norm keeps the model's dtype for the layer after it (a GRU refuses fp32)
    "linalg_norm", "linalg_matrix_norm", "linalg_matrix_exp", "matrix_exp",
)  # fmt: skip

# Ops with no half kernel on the CPU: every FFT ("Unsupported dtype Half") and the linear-algebra
# decompositions, solvers and determinants ("cholesky_cpu not implemented for 'Half'"; cuSOLVER has no half
# forms either). torch's CPU autocast table runs them in fp32 for that reason. In a half model they compute in
# fp32 and return fp32 (complex64 for a complex result, which has no usable half form), as torch.autocast's
# do: their results feed log-determinants, solves and spectral products, whose precision the fp32 computation
# was for. An FNet's fft2 and a flow's MultivariateNormal base failed in O2 and to_fp16() (a user trial).
HALF_MODEL_FP32_RESULTS: tuple[str, ...] = (
    "fft_fft", "fft_ifft", "fft_rfft", "fft_irfft", "fft_hfft", "fft_ihfft", "fft_fft2", "fft_ifft2",
    "fft_rfft2", "fft_irfft2", "fft_hfft2", "fft_ihfft2", "fft_fftn", "fft_ifftn", "fft_rfftn", "fft_irfftn",
    "fft_hfftn", "fft_ihfftn", "stft", "istft", "polar",
    "linalg_cholesky", "linalg_cholesky_ex", "cholesky", "cholesky_solve", "cholesky_inverse",
    "linalg_solve_triangular", "triangular_solve", "linalg_solve", "linalg_solve_ex", "linalg_lu_factor",
    "linalg_lu_factor_ex", "linalg_lu", "linalg_lu_solve", "lu_solve", "linalg_det", "det", "logdet",
    "slogdet", "linalg_slogdet", "linalg_inv", "linalg_inv_ex", "inverse", "linalg_pinv", "pinverse",
    "linalg_tensorinv", "linalg_tensorsolve", "linalg_qr", "qr", "geqrf", "orgqr", "ormqr",
    "linalg_householder_product", "linalg_svd", "svd", "linalg_svdvals", "linalg_eig", "linalg_eigvals",
    "linalg_eigh", "linalg_eigvalsh", "linalg_lstsq", "linalg_matrix_rank", "linalg_cond",
)  # fmt: skip

HALF_MODEL_FP32_LOSSES: tuple[str, ...] = (
    # a loss reduces over the batch and its gradient seeds backward: fp32, and returned as fp32
    "cross_entropy_loss", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div",
    "binary_cross_entropy_with_logits",
)  # fmt: skip

# Recurrent layers (nn.LSTM/GRU/RNN and their cells, as torch functions). Where a region emulates its half
# dtype they run in fp32: there is no GEMM to emulate inside torch's fused kernels, and torch's own half
# ones failed (CPU autocast lowers LSTM's mkldnn_rnn_layer: "could not create a primitive descriptor" for
# fp16, and for bf16 without AVX-512 BF16) or ran 6-11x slower than fp32 (a half model's LSTM). fp32 is
# more precise than the half kernel would be; an fp32 model's region returns fp32, a half model's the
# result rounded to its dtype. A policy rule for one of these names wins.
RECURRENT_OPS: tuple[str, ...] = (
    "lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
)  # fmt: skip
