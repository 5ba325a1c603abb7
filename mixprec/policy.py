"""Per-op cast policies for autocast regions, as plain data.

A :class:`Policy` says, per device type and autocast dtype, what happens to each op inside an autocast
region (:class:`Action`):

* ``lower``   -- cast floating inputs to the region's dtype (fp16/bf16): GEMMs and convolutions, whose
  half-precision kernels accumulate in fp32 and run several times faster.
* ``fp32``    -- cast floating inputs to float32: ops whose result leaves the half range or loses precision
  (exp/log/pow, softmax, norms, long sums, losses).
* ``promote`` -- cast floating inputs to the widest floating input dtype: ops taking several tensors that
  must agree (cat, stack, addcmul, ...).
* ``banned``  -- raise: ops that are unsafe under autocast (binary_cross_entropy under fp16).
* ``native``  -- no casts at all; the op runs in the dtypes it is given (what every unlisted op does).

The default preset (``"torch"``) mirrors torch's "Autocast Op Reference" op by op for each device, read
from ``aten/src/ATen/autocast_mode.cpp`` of torch 2.13 (CUDA and CPU lists differ a lot: on CPU, softmax,
exp and sum are *not* fp32). Every entry where a preset deliberately differs from torch carries its reason
(``OpRule.reason``); the tests check the torch-sourced entries against the kernels registered with the
dispatcher and against torch.autocast's output dtypes.

User registrations (apex's ``register_half_function`` / ``register_float_function`` /
``register_promote_function``) live in a module-level registry, separate from the frozen presets, and are
layered on top of whatever policy a region uses (:func:`effective_policy`).

Op names are torch's operator names without namespace and overload (``"mm"``, ``"softmax"``,
``"cross_entropy_loss"``); :func:`op_name` maps Python callables, ``torch.ops.aten`` overloads and aliases
(``Tensor.__matmul__`` -> ``"matmul"``, ``F.cross_entropy`` -> ``"cross_entropy_loss"``) to them.
:func:`lookup` answers "what does this policy do with op X".
"""

from __future__ import annotations

import enum
import functools
import io
import threading
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from mixprec.errors import MixprecError
from mixprec.formats import dtype_label

__all__ = [
    # data model
    "Action",
    "Source",
    "OpRule",
    "DeviceTable",
    "DeviceSpec",
    "Policy",
    "PolicyDiff",
    "PolicyError",
    # device facts and presets
    "DEVICES",
    "device_spec",
    "TORCH",
    "TORCH_NATIVE",
    "APEX",
    "DEFAULT_POLICY",
    "PRESETS",
    "get_preset",
    # queries
    "op_name",
    "lookup",
    "diff",
    # apex-style global registration
    "register_half_function",
    "register_float_function",
    "register_promote_function",
    "registered_rules",
    "clear_registrations",
    "effective_policy",
]


class PolicyError(MixprecError, ValueError):
    """A policy, registration or lookup was given something it cannot use; the message names the fix."""


class Action(str, enum.Enum):
    """What an autocast region does with an op's floating-point inputs."""

    LOWER = "lower"
    FP32 = "fp32"
    PROMOTE = "promote"
    BANNED = "banned"
    NATIVE = "native"


class Source(str, enum.Enum):
    """Where a rule comes from: torch's own table, a documented mixprec deviation, or a user."""

    TORCH = "torch"
    MIXPREC = "mixprec"
    USER = "user"


@dataclass(frozen=True)
class OpRule:
    """One table entry: ``op`` gets ``action`` under the listed autocast dtypes (empty: all of them)."""

    op: str
    action: Action
    dtypes: tuple[torch.dtype, ...] = ()
    source: Source = Source.TORCH
    reason: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.op, str) or not self.op:
            raise PolicyError(f"OpRule.op must be a non-empty op name, got {self.op!r}", "use op_name(fn)")
        object.__setattr__(self, "action", Action(self.action))
        object.__setattr__(self, "source", Source(self.source))
        object.__setattr__(self, "dtypes", tuple(self.dtypes))
        for dtype in self.dtypes:
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise PolicyError(
                    f"OpRule({self.op!r}).dtypes must hold floating torch dtypes, got {dtype!r}",
                    "use torch.float16 or torch.bfloat16",
                )
        # Every deliberate deviation from torch's table must say why, where it is declared.
        if self.source is Source.MIXPREC and not self.reason:
            raise PolicyError(f"OpRule({self.op!r}) deviates from torch but has no reason", "add reason=...")

    def applies_to(self, dtype: torch.dtype) -> bool:
        return not self.dtypes or dtype in self.dtypes

    @property
    def is_deviation(self) -> bool:
        """True when this entry is not torch's own behaviour (a mixprec or user choice)."""
        return self.source is not Source.TORCH


@dataclass(frozen=True)
class DeviceSpec:
    """Platform facts about a device type that shape what autocast can and should do there."""

    device_type: str
    autocast_dtypes: tuple[torch.dtype, ...]
    # Whether half-precision GEMMs on this device are at least as fast as fp32 ones. Where they are not,
    # fp16 GEMMs are emulated: fp16-rounded inputs, fp32 compute, result rounded to fp16 (see autocast.py).
    fast_fp16_gemm: bool


# CPU: torch's fp16 GEMMs run at 0.3-57 GFLOP/s depending on operand layout against ~150 for fp32 and
# ~600 for bf16 (AVX-512 BF16) on the reference machine, so fp16 GEMMs are emulated there.
# CUDA: tensor cores run fp16 x fp16 with fp32 accumulation natively.
DEVICES: Mapping[str, DeviceSpec] = types.MappingProxyType(
    {
        "cpu": DeviceSpec("cpu", (torch.bfloat16, torch.float16), fast_fp16_gemm=False),
        "cuda": DeviceSpec("cuda", (torch.float16, torch.bfloat16), fast_fp16_gemm=True),
    }
)


def device_spec(device_type: str) -> DeviceSpec:
    """The :class:`DeviceSpec` for ``device_type``; raises PolicyError naming the known device types."""
    spec = DEVICES.get(device_type)
    if spec is None:
        raise PolicyError(
            f"unknown device type {device_type!r} for autocast",
            f"use one of {sorted(DEVICES)} (a device *type*: 'cuda', not 'cuda:0')",
        )
    return spec


@dataclass(frozen=True)
class DeviceTable:
    """The ordered rules of one device type; a later rule for the same op and dtype wins."""

    device_type: str
    rules: tuple[OpRule, ...]

    def __post_init__(self) -> None:
        device_spec(self.device_type)
        object.__setattr__(self, "rules", tuple(self.rules))

    @functools.cached_property
    def _index(self) -> dict[torch.dtype, dict[str, OpRule]]:
        index: dict[torch.dtype, dict[str, OpRule]] = {}
        for dtype in device_spec(self.device_type).autocast_dtypes:
            index[dtype] = {rule.op: rule for rule in self.rules if rule.applies_to(dtype)}
        return index

    def rules_for(self, dtype: torch.dtype) -> Mapping[str, OpRule]:
        """op name -> winning rule under ``dtype``."""
        index = self._index.get(dtype)
        if index is None:
            spec = device_spec(self.device_type)
            raise PolicyError(
                f"{self.device_type} autocast does not support {dtype}",
                f"use one of {', '.join(str(d) for d in spec.autocast_dtypes)}",
            )
        return index

    def ops(self) -> tuple[str, ...]:
        """Every op name listed, in first-appearance order."""
        return tuple(dict.fromkeys(rule.op for rule in self.rules))


def _torch_rules(action: Action, *ops: str) -> tuple[OpRule, ...]:
    return tuple(OpRule(op, action) for op in ops)


# --------------------------------------------------------------------------------------------------------
# torch's tables (torch 2.13, aten/src/ATen/autocast_mode.cpp), by base op name; all overloads of a name
# share a policy there. Kept in torch's order so a diff against a newer torch is easy to read.
# --------------------------------------------------------------------------------------------------------

_TORCH_CPU: tuple[OpRule, ...] = (
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

_BCE_FIX = (
    "it takes probabilities, so a sigmoid (or softmax) runs before it in half precision, where "
    "1 - sigmoid(x) rounds to 0 for x > ~8 in fp16 and log(0) gives inf. Use torch.nn.BCEWithLogitsLoss "
    "(or F.binary_cross_entropy_with_logits) on the logits instead: it fuses the sigmoid and is fp32 "
    "under autocast. To keep BCELoss, run it outside the region or in a keep_fp32 module."
)

_TORCH_CUDA: tuple[OpRule, ...] = (
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
_MIXPREC_CPU_DEVIATIONS: tuple[OpRule, ...] = (
    OpRule(
        "binary_cross_entropy",
        Action.BANNED,
        dtypes=(torch.float16,),
        source=Source.MIXPREC,
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


_APEX_EXTRA_FP32: tuple[OpRule, ...] = (
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


def _without_redundant(base: tuple[OpRule, ...], extra: tuple[OpRule, ...]) -> tuple[OpRule, ...]:
    """``extra`` minus entries that ``base`` already gives the same action for every dtype."""
    same = {(r.op, r.action) for r in base if not r.dtypes}
    return tuple(r for r in extra if (r.op, r.action) not in same)


# --------------------------------------------------------------------------------------------------------
# Policy
# --------------------------------------------------------------------------------------------------------


def _module_key(module: type | str) -> str:
    if isinstance(module, str):
        if not module:
            raise PolicyError("an fp32 module entry is an empty string", "pass a class or a class name")
        return module
    if isinstance(module, type) and issubclass(module, torch.nn.Module):
        return f"{module.__module__}.{module.__qualname__}"
    raise PolicyError(
        f"fp32 module entries must be nn.Module subclasses or class names, got {module!r}",
        "to keep one module instance in fp32 use mixprec.autocast.keep_fp32(module)",
    )


@dataclass(frozen=True)
class Policy:
    """A named, immutable cast policy: one :class:`DeviceTable` per device type, plus module rules.

    ``fp32_modules`` holds class names (``"LayerNorm"``) or qualified names (``"torch.nn.LayerNorm"``);
    modules of those classes run entirely in fp32 inside an autocast region. ``emulate_fp16`` lets devices
    without fast fp16 GEMMs (``DeviceSpec.fast_fp16_gemm``) emulate them; set it False to get torch's own
    fp16 kernels there. Derive variants with the ``with_*`` methods; they return new policies.
    """

    name: str
    tables: tuple[DeviceTable, ...]
    fp32_modules: tuple[str, ...] = ()
    emulate_fp16: bool = True
    description: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tables", tuple(self.tables))
        object.__setattr__(self, "fp32_modules", tuple(_module_key(m) for m in self.fp32_modules))
        seen = [t.device_type for t in self.tables]
        if len(seen) != len(set(seen)):
            raise PolicyError(f"Policy {self.name!r} has two tables for one device ({seen})", "merge them")

    # ---- queries -------------------------------------------------------------------------------------

    def table(self, device_type: str) -> DeviceTable:
        for table in self.tables:
            if table.device_type == device_type:
                return table
        device_spec(device_type)  # unknown device type: the clearer error
        raise PolicyError(
            f"policy {self.name!r} has no table for {device_type!r}",
            f"add one with policy.with_table(DeviceTable({device_type!r}, rules)), or use policy.TORCH",
        )

    def rule(self, op: object, device_type: str, dtype: torch.dtype) -> OpRule | None:
        """The rule that decides ``op`` under (device_type, dtype), or None when the op is unlisted."""
        return self.table(device_type).rules_for(dtype).get(op_name(op))

    def action(self, op: object, device_type: str, dtype: torch.dtype) -> Action:
        """What happens to ``op``'s inputs: its rule's action, or ``Action.NATIVE`` when unlisted."""
        rule = self.rule(op, device_type, dtype)
        return Action.NATIVE if rule is None else rule.action

    def deviations(self) -> tuple[tuple[str, OpRule], ...]:
        """(device_type, rule) for every entry that is not torch's own behaviour."""
        return tuple((t.device_type, r) for t in self.tables for r in t.rules if r.is_deviation)

    def overrides(self, device_type: str, dtype: torch.dtype) -> dict[str, Action]:
        """Ops whose action differs from torch's dispatcher-level autocast under (device_type, dtype).

        Only these need a Python-level layer; everything else torch.autocast already does itself.
        """
        mine = self.table(device_type).rules_for(dtype)
        torch_own = TORCH_NATIVE.table(device_type).rules_for(dtype)
        changed: dict[str, Action] = {}
        for op in mine.keys() | torch_own.keys():
            ours = mine[op].action if op in mine else Action.NATIVE
            theirs = torch_own[op].action if op in torch_own else Action.NATIVE
            if ours is not theirs:
                changed[op] = ours
        return changed

    # ---- derivation ----------------------------------------------------------------------------------

    def with_rules(self, *rules: OpRule, device_type: str | None = None) -> Policy:
        """Append rules (they win over earlier ones) to one device's table, or to every table."""
        targets = {t.device_type for t in self.tables} if device_type is None else {device_type}
        if device_type is not None:
            self.table(device_type)  # validates
        tables = tuple(
            replace(t, rules=t.rules + tuple(rules)) if t.device_type in targets else t for t in self.tables
        )
        return replace(self, tables=tables)

    def _with_action(
        self,
        action: Action,
        ops: Iterable[object],
        device_type: str | None,
        dtypes: tuple[torch.dtype, ...],
        reason: str,
    ) -> Policy:
        rules = tuple(
            OpRule(op_name(op), action, dtypes=dtypes, source=Source.USER, reason=reason) for op in ops
        )
        return self.with_rules(*rules, device_type=device_type)

    def with_lower(
        self,
        *ops: object,
        device_type: str | None = None,
        dtypes: tuple[torch.dtype, ...] = (),
        reason: str = "",
    ) -> Policy:
        """Run ``ops`` in the region's half-precision dtype."""
        return self._with_action(Action.LOWER, ops, device_type, dtypes, reason)

    def with_fp32(
        self,
        *ops: object,
        device_type: str | None = None,
        dtypes: tuple[torch.dtype, ...] = (),
        reason: str = "",
    ) -> Policy:
        """Run ``ops`` in float32."""
        return self._with_action(Action.FP32, ops, device_type, dtypes, reason)

    def with_promote(
        self,
        *ops: object,
        device_type: str | None = None,
        dtypes: tuple[torch.dtype, ...] = (),
        reason: str = "",
    ) -> Policy:
        """Run ``ops`` in the widest floating dtype among their inputs."""
        return self._with_action(Action.PROMOTE, ops, device_type, dtypes, reason)

    def with_banned(
        self,
        *ops: object,
        device_type: str | None = None,
        dtypes: tuple[torch.dtype, ...] = (),
        reason: str = "",
    ) -> Policy:
        """Make ``ops`` raise inside autocast regions (``reason`` becomes the error's advice)."""
        return self._with_action(Action.BANNED, ops, device_type, dtypes, reason)

    def with_native(
        self,
        *ops: object,
        device_type: str | None = None,
        dtypes: tuple[torch.dtype, ...] = (),
        reason: str = "",
    ) -> Policy:
        """Leave ``ops`` alone: they run in whatever dtypes they are given."""
        return self._with_action(Action.NATIVE, ops, device_type, dtypes, reason)

    def with_fp32_modules(self, *modules: type | str) -> Policy:
        """Run every module of these classes (or class names) entirely in fp32."""
        keys = tuple(_module_key(m) for m in modules)
        return replace(self, fp32_modules=tuple(dict.fromkeys(self.fp32_modules + keys)))

    def with_emulate_fp16(self, emulate: bool) -> Policy:
        return replace(self, emulate_fp16=bool(emulate))

    def with_table(self, table: DeviceTable) -> Policy:
        others = tuple(t for t in self.tables if t.device_type != table.device_type)
        return replace(self, tables=others + (table,))

    # ---- display -------------------------------------------------------------------------------------

    def __rich__(self) -> Any:
        return _policy_table(self)

    def render(self, width: int = 140) -> str:
        """The policy as a text table (what ``rich.print(policy)`` shows)."""
        return _render(_policy_table(self), width)


# --------------------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------------------

TORCH_NATIVE = Policy(
    name="torch-native",
    tables=(DeviceTable("cpu", _TORCH_CPU), DeviceTable("cuda", _TORCH_CUDA)),
    description="exactly torch.autocast's op tables (torch 2.13), no deviations",
)

TORCH = Policy(
    name="torch",
    tables=(DeviceTable("cpu", _TORCH_CPU + _MIXPREC_CPU_DEVIATIONS), DeviceTable("cuda", _TORCH_CUDA)),
    description="torch.autocast's op tables, plus binary_cross_entropy banned under fp16 on CPU too",
)

APEX = Policy(
    name="apex",
    tables=(
        DeviceTable("cpu", TORCH.table("cpu").rules + _without_redundant(_TORCH_CPU, _APEX_EXTRA_FP32)),
        DeviceTable("cuda", _TORCH_CUDA + _without_redundant(_TORCH_CUDA, _APEX_EXTRA_FP32)),
    ),
    description="the default plus apex O1's extra fp32 ops (softmax, reductions, norms, losses) and gelu",
)

# The default: torch's behaviour, so code moving from torch.autocast sees the same dtypes.
DEFAULT_POLICY = TORCH

PRESETS: Mapping[str, Policy] = types.MappingProxyType({p.name: p for p in (TORCH, TORCH_NATIVE, APEX)})


def get_preset(name: str) -> Policy:
    try:
        return PRESETS[name]
    except KeyError:
        raise PolicyError(f"unknown policy preset {name!r}", f"use one of {sorted(PRESETS)}") from None


# --------------------------------------------------------------------------------------------------------
# Op names
# --------------------------------------------------------------------------------------------------------

# Python-level names whose torch operator has another name. Autocast tables use operator names.
PY_ALIASES: Mapping[str, str] = types.MappingProxyType(
    {
        "__matmul__": "matmul",
        "__rmatmul__": "matmul",
        "__pow__": "pow",
        "__rpow__": "pow",
        "__ipow__": "pow",
        "cross_entropy": "cross_entropy_loss",
        "grid_sample": "grid_sampler",
    }
)

_MIXPREC_OP_ATTR = "__mixprec_op__"


def _is_torch_callable(fn: object) -> bool:
    module = getattr(fn, "__module__", None)
    if module is None:  # method descriptors of torch.Tensor (Tensor.softmax) have no __module__
        return getattr(fn, "__objclass__", None) is torch._C.TensorBase
    return module == "torch" or module.startswith(("torch.", "torch._C"))


def op_name(op: object) -> str:
    """Normalize ``op`` to the name policy tables use.

    Accepts a name (``"mm"``, ``"aten::mm"``, ``"aten.mm.default"``, ``"__matmul__"``), a
    ``torch.ops.aten`` op or overload, a torch function or Tensor method, or a user function (its
    ``module.qualname``; a function wrapped by a register_* decorator keeps its registered name).
    """
    if isinstance(op, str):
        if op.startswith(("aten::", "aten.")):
            op = op.split("::", 1)[1] if "::" in op else op.split(".", 1)[1]
            op = op.split(".", 1)[0]
        return PY_ALIASES.get(op, op)
    if isinstance(op, torch._ops.OpOverload):
        return op_name(op._schema.name)
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op_name(op._qualified_op_name)
    registered = getattr(op, _MIXPREC_OP_ATTR, None)
    if registered is not None:
        return registered
    name = getattr(op, "__name__", None)
    if name is None or not callable(op):
        raise PolicyError(f"cannot name op {op!r}", "pass an op name string, a torch function or a callable")
    if _is_torch_callable(op):
        return PY_ALIASES.get(name, name)
    return f"{getattr(op, '__module__', '?')}.{getattr(op, '__qualname__', name)}"


# --------------------------------------------------------------------------------------------------------
# apex-style global registration (module-level, mutable, kept apart from the frozen presets)
# --------------------------------------------------------------------------------------------------------


class _Registry:
    """The user's global registrations, in order; layered over any policy by :func:`effective_policy`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rules: dict[str, OpRule] = {}
        self.version = 0  # bumped on every change so cached region plans know to rebuild

    def add(self, rule: OpRule) -> None:
        with self._lock:
            self._rules.pop(rule.op, None)  # re-registration moves the op to the end: latest wins
            self._rules[rule.op] = rule
            self.version += 1

    def rules(self) -> tuple[OpRule, ...]:
        return tuple(self._rules.values())

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()
            self.version += 1


_REGISTRY = _Registry()
_REGISTER_NAMES = {
    Action.LOWER: "register_half_function",
    Action.FP32: "register_float_function",
    Action.PROMOTE: "register_promote_function",
}


def registered_rules() -> tuple[OpRule, ...]:
    """The user's global registrations, oldest first."""
    return _REGISTRY.rules()


def registry_version() -> int:
    return _REGISTRY.version


def clear_registrations() -> None:
    """Forget every register_* registration (attributes patched on user modules stay wrapped but inert)."""
    _REGISTRY.clear()


def _register(action: Action, target: object, name: str | None) -> Any:
    who = _REGISTER_NAMES[action]
    if name is None:
        if not callable(target):
            raise PolicyError(f"{who}(fn) needs a function, got {target!r}", f"or use {who}(module, 'name')")
        return _register_callable(action, target, who)
    if not isinstance(name, str) or not hasattr(target, name):
        raise PolicyError(
            f"{who}({getattr(target, '__name__', target)!r}, {name!r}): no attribute {name!r} there",
            "pass the module (or class) that defines the function, and its exact name",
        )
    attr = getattr(target, name)
    if _is_torch_callable(attr) or target is torch.Tensor:
        # torch functions are matched by op name in every spelling (torch.X, F.X, Tensor.X), the way
        # torch's dispatcher sees one aten op; torch itself is never patched.
        _REGISTRY.add(OpRule(op_name(name), action, source=Source.USER, reason=f"{who}"))
        return None
    setattr(target, name, _register_callable(action, attr, who, key=f"{target.__name__}.{name}"))
    return None


def _register_callable(action: Action, fn: Any, who: str, key: str | None = None) -> Any:
    key = key or op_name(fn)
    _REGISTRY.add(OpRule(key, action, source=Source.USER, reason=who))
    inner = getattr(fn, "__wrapped__", fn) if getattr(fn, _MIXPREC_OP_ATTR, None) else fn

    @functools.wraps(inner)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from mixprec.autocast import call_registered  # the engine imports this module

        return call_registered(key, inner, args, kwargs)

    setattr(wrapper, _MIXPREC_OP_ATTR, key)
    return wrapper


def register_half_function(module_or_fn: Any, name: str | None = None) -> Any:
    """Run a function in half precision inside autocast regions (apex's ``register_half_function``).

    ``register_half_function(module, "name")`` registers ``module.name``: torch functions by op name,
    other modules' functions by wrapping the attribute. ``@register_half_function`` decorates your own.
    A registered function's floating tensor arguments are cast and its body runs with autocast off.
    """
    return _register(Action.LOWER, module_or_fn, name)


def register_float_function(module_or_fn: Any, name: str | None = None) -> Any:
    """Run a function in fp32 inside autocast regions (apex's ``register_float_function``)."""
    return _register(Action.FP32, module_or_fn, name)


def register_promote_function(module_or_fn: Any, name: str | None = None) -> Any:
    """Run a function in its widest floating input dtype (apex's ``register_promote_function``)."""
    return _register(Action.PROMOTE, module_or_fn, name)


def effective_policy(policy: Policy | None = None) -> Policy:
    """``policy`` (default: DEFAULT_POLICY) with the global registrations applied on top."""
    base = DEFAULT_POLICY if policy is None else policy
    if not isinstance(base, Policy):
        raise PolicyError(
            f"policy must be a mixprec.policy.Policy, got {type(base).__name__}",
            "use a preset such as mixprec.policy.get_preset('torch'), or one derived from it",
        )
    rules = _REGISTRY.rules()
    return base.with_rules(*rules) if rules else base


def lookup(
    op: object,
    device_type: str = "cpu",
    dtype: torch.dtype | None = None,
    policy: Policy | None = None,
) -> OpRule | None:
    """What ``policy`` (with the user's registrations) does with ``op`` under (device_type, dtype).

    Returns the deciding :class:`OpRule`, or None when the op is unlisted (it runs in its input dtypes).
    ``dtype`` defaults to torch's current autocast dtype for the device.
    """
    if dtype is None:
        dtype = torch.get_autocast_dtype(device_spec(device_type).device_type)
    return effective_policy(policy).rule(op, device_type, dtype)


# --------------------------------------------------------------------------------------------------------
# Diff and display
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyDiff:
    """Where two policies disagree: (device, dtype, op, action in a, action in b) plus setting changes."""

    a: str
    b: str
    ops: tuple[tuple[str, torch.dtype, str, Action, Action], ...]
    settings: tuple[tuple[str, object, object], ...]

    def __bool__(self) -> bool:
        return bool(self.ops or self.settings)

    def __rich__(self) -> Any:
        from rich.table import Table

        table = Table(title=f"policy diff: {self.a} -> {self.b}", show_lines=False)
        for col in ("device", "dtype", "op", self.a, self.b):
            table.add_column(col)
        for device, dtype, op, act_a, act_b in self.ops:
            table.add_row(device, dtype_label(dtype), op, _styled(act_a), _styled(act_b))
        for setting, val_a, val_b in self.settings:
            table.add_row("*", "*", setting, str(val_a), str(val_b))
        return table

    def render(self, width: int = 120) -> str:
        return _render(self.__rich__(), width)


def diff(a: Policy, b: Policy) -> PolicyDiff:
    """Every (device, dtype, op) whose action differs between ``a`` and ``b``, and changed settings."""
    ops: list[tuple[str, torch.dtype, str, Action, Action]] = []
    devices = dict.fromkeys([t.device_type for t in a.tables] + [t.device_type for t in b.tables])
    for device in devices:
        for dtype in device_spec(device).autocast_dtypes:
            rules_a = _rules_or_empty(a, device, dtype)
            rules_b = _rules_or_empty(b, device, dtype)
            for op in sorted(rules_a.keys() | rules_b.keys()):
                act_a = rules_a[op].action if op in rules_a else Action.NATIVE
                act_b = rules_b[op].action if op in rules_b else Action.NATIVE
                if act_a is not act_b:
                    ops.append((device, dtype, op, act_a, act_b))
    settings = tuple(
        (name, getattr(a, name), getattr(b, name))
        for name in ("fp32_modules", "emulate_fp16")
        if getattr(a, name) != getattr(b, name)
    )
    return PolicyDiff(a.name, b.name, tuple(ops), settings)


def _rules_or_empty(policy: Policy, device: str, dtype: torch.dtype) -> Mapping[str, OpRule]:
    try:
        return policy.table(device).rules_for(dtype)
    except PolicyError:
        return {}


_ACTION_STYLES = {
    Action.LOWER: "green",
    Action.FP32: "cyan",
    Action.PROMOTE: "yellow",
    Action.BANNED: "bold red",
    Action.NATIVE: "dim",
}
_ACTION_ORDER = {action: i for i, action in enumerate(Action)}


def _styled(action: Action) -> str:
    return f"[{_ACTION_STYLES[action]}]{action.value}[/]"


def _policy_table(policy: Policy) -> Any:
    from rich.table import Table

    columns = [(t.device_type, d) for t in policy.tables for d in device_spec(t.device_type).autocast_dtypes]
    title = f"cast policy {policy.name!r}" + (f": {policy.description}" if policy.description else "")
    table = Table(title=title)
    table.add_column("op")
    for device, dtype in columns:
        table.add_column(f"{device} {dtype_label(dtype)}")
    table.add_column("why it differs from torch", overflow="fold", ratio=1)
    ops = dict.fromkeys(op for t in policy.tables for op in t.ops())

    def sort_key(op: str) -> tuple[int, str]:
        first = min(_ACTION_ORDER[policy.action(op, d, dt)] for d, dt in columns)
        return first, op

    for op in sorted(ops, key=sort_key):
        cells = []
        reasons = []
        for device, dtype in columns:
            rule = policy.table(device).rules_for(dtype).get(op)
            mark = "*" if rule and rule.is_deviation else ""
            cells.append(_styled(rule.action if rule else Action.NATIVE) + mark)
            if rule and rule.is_deviation and rule.reason and rule.reason not in reasons:
                reasons.append(rule.reason)
        table.add_row(op, *cells, "; ".join(reasons))
    for module in policy.fp32_modules:
        table.add_row(f"module {module}", *["fp32*"] * len(columns), "policy fp32_modules entry")
    return table


def _render(renderable: Any, width: int) -> str:
    from rich.console import Console

    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    console.print(renderable)
    return console.export_text()
