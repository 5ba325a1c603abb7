"""``half_compute``: the arithmetic of a half-precision *model* (apex O2/O3, fastai's ``to_fp16``).

``autocast`` decides *which dtype* each op runs in for an fp32 model; a model cast to half has already
decided: its weights are half. Two things remain, and this region does them:

1. **How half GEMMs compute.** Where :mod:`mixprec.hardware` says the device has no fast kernels for
   the dtype (CPU fp16: 3x-500x slower than fp32 in torch; bf16 without AVX-512 BF16/AMX: ~90x) every
   GEMM/convolution with an operand of that dtype is computed as a tensor core does
   (:mod:`mixprec.emulation`), every operand rounded to the dtype. Where it does, torch's own kernels run,
   and a GEMM given half and fp32 operands (a timestep embedding computed in fp32 fed to a half Linear, as
   DiT's is) gets its fp32 ones cast to the dtype first: the emulated GEMM's rounding, where torch's kernel
   would refuse the mix ("mat1 and mat2 must have the same dtype"), so a model that runs on one device
   runs on the other.
2. **The numerically sensitive ops stay fp32** (``HALF_MODEL_FP32_*`` in :mod:`mixprec.policy.tables`):
   softmax, log_softmax, norms, exp/log, sum/mean and segment sums (index_add, scatter_add, in place
   too) take their half inputs upcast to fp32 and return their result in the input's half dtype; losses
   (cross_entropy, nll_loss, ...) return fp32. So a model that computes its loss inside forward (nanoGPT,
   HF models) gets an fp32 loss of fp32 arithmetic, where apex's O2 computed it in fp16. FFTs and linear
   algebra (cholesky, solves, determinants), which have no half kernel on the CPU, compute in fp32 and
   return fp32 (complex64), as under torch.autocast.

Ops whose floating inputs hold no half tensor, and every op while a torch autocast region is on (it has
its own rules), pass straight through. An autocast region of the *other* half dtype around the region is
a :class:`~mixprec.errors.ConfigError` (it would round the model's weights to that dtype).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from mixprec.activation_checkpoint import cover_segment
from mixprec.cast_handlers import eligible, run_emulated
from mixprec.cast_plan import plan, region_for
from mixprec.emulation import map_operands, round_result
from mixprec.errors import ConfigError
from mixprec.half_relu import RELU_NAMES, relu
from mixprec.policy.names import python_names
from mixprec.policy.presets import DEFAULT_POLICY
from mixprec.policy.registry import registry_version
from mixprec.policy.rules import Action
from mixprec.policy.tables import (
    HALF_MODEL_FP32_ACTIVATIONS,
    HALF_MODEL_FP32_LOSSES,
    HALF_MODEL_FP32_RESULTS,
    RECURRENT_OPS,
    TORCH_TABLES,
)
from mixprec.region import (
    STATE,
    EntryMark,
    Region,
    RegionMode,
    call_without_autocast,
    compiled_mode,
    func_name,
)
from mixprec.tensor_args import iter_tensors, map_tensors

__all__ = ["half_compute"]

# Python-level name -> whether the result stays fp32 (a loss; an FFT or a solver) rather than being rounded
# to the model's dtype (an activation).
_FP32_OPS: Mapping[str, bool] = {
    **{name: False for op in HALF_MODEL_FP32_ACTIVATIONS for name in python_names(op)},
    **{name: True for op in HALF_MODEL_FP32_LOSSES + HALF_MODEL_FP32_RESULTS for name in python_names(op)},
}


_RECURRENT = frozenset(RECURRENT_OPS)


class _HalfComputeMode(RegionMode):
    """Emulates the GEMM family for half operands and runs the sensitive ops in fp32 (module docstring)."""

    def __init__(
        self, region: Region, gemms: frozenset[str], recurrent: frozenset[str], native_gemms: frozenset[str]
    ) -> None:
        super().__init__()
        self.region = region
        self.gemms = gemms
        self.recurrent = recurrent  # the plan's fp32 recurrent layers (emulated regions: RECURRENT_OPS)
        self.native_gemms = native_gemms  # the GEMM family where torch's half kernels run (native regions)

    def changes(self, name: str) -> bool:
        return (name in RELU_NAMES or name in _FP32_OPS or name in self.recurrent or name in self.gemms
                or name in self.native_gemms)

    def handle(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        name = func_name(func)
        handler = self._handler(name, args, kwargs) if name is not None else None
        if handler is None:
            return self.pass_on(func, args, kwargs)
        cover_segment(self)  # in a checkpointed segment, its recompute must change this op the same way
        return handler(func, args, kwargs)

    def _relu(self, func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        return relu(func, args, kwargs, self.region.dtype, self.region.device_type)

    def _handler(self, name: str, args: Any, kwargs: Any) -> Callable[..., Any] | None:
        region = self.region
        if name in RELU_NAMES:  # emulated GEMMs only: see half_relu.py
            return self._relu if self.gemms and not torch.is_autocast_enabled(region.device_type) else None
        loss = _FP32_OPS.get(name)
        if loss is None and name in self.recurrent:
            loss = False  # fp32 arithmetic, the result rounded to the model's dtype
        if torch.is_autocast_enabled(region.device_type) or kwargs.get("out") is not None:
            return None  # out=: torch's own op writes the caller's tensor (an fp32 copy of it would not)
        if loss is None and name not in self.gemms:
            mixed = name in self.native_gemms and self._mixed(name, args, kwargs)
            return self._lower_mixed if mixed else None
        # keyword arguments too: F.layer_norm passes its weight and bias as keywords to the mode, and an fp32
        # input (cast_inputs=False) with half weights failed in torch ("mixed dtype (CPU)")
        operands = iter_tensors((args, kwargs))
        half = any(t.dtype is region.dtype and eligible(t, region.device_type) for t in operands)
        if not half:
            return None
        if loss is None:
            return lambda func, a, k: run_emulated(region, func, a, k)
        if kwargs.get("dtype") is not None:  # the caller chose the accumulation dtype
            return None
        in_place = name in _IN_PLACE
        return lambda func, a, k: _run_in_fp32(region, func, a, k, keep_fp32=loss, in_place=in_place)

    def _mixed(self, name: str, args: Any, kwargs: Any) -> bool:
        """Whether a native GEMM's operands (emulation.NOT_OPERANDS: not attention's mask) mix the region's
        half dtype and fp32 (a module kept fp32 has fp32 ones only, and keeps its fp32 GEMM)."""
        operands = map_operands(name, args, kwargs, lambda v: v, lambda _: None)
        dtypes = {t.dtype for t in iter_tensors(operands) if eligible(t, self.region.device_type)}
        return self.region.dtype in dtypes and torch.float32 in dtypes

    def _lower_mixed(self, func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        region = self.region

        def down(t: torch.Tensor) -> torch.Tensor:  # the rounding an emulated GEMM gives its operands
            return t.to(region.dtype) if t.dtype is torch.float32 and eligible(t, region.device_type) else t

        args, kwargs = map_operands(func_name(func) or "", args, kwargs, lambda v: map_tensors(down, v),
                                    lambda v: v)
        return self.pass_on(func, args, kwargs)


def _run_in_fp32(region: Region, func: Callable[..., Any], args: Any, kwargs: Any, keep_fp32: bool,
                 in_place: bool = False) -> Any:
    # The upcasts are exact; the one rounding back to half (for activations) is the only new error, the
    # same a native fp32-accumulating half kernel would make.
    def up(t: torch.Tensor) -> torch.Tensor:
        return t.float() if t.dtype is region.dtype and eligible(t, region.device_type) else t

    result = call_without_autocast(region.device_type, func, map_tensors(up, args), map_tensors(up, kwargs))
    if in_place and result is not args[0]:  # computed into the target's fp32 copy: write it back
        return args[0].copy_(result)  # copy_ rounds to the target's dtype, as round_result does
    return result if keep_fp32 else round_result(result, region.dtype)


# In-place ops of the fp32 lists (index_add_): their result is the first argument, changed. Derived from the
# tables' names here, once: Dynamo traces the handler and cannot trace str.endswith there.
_IN_PLACE = frozenset(name for name in _FP32_OPS if name.endswith("_") and not name.startswith("__"))


# One mode per plan (plans are few and long-lived): entering the region every step reuses it, so a
# compiled model run inside keeps its guards.
_MODES: dict[tuple[int, str], tuple[object, _HalfComputeMode]] = {}


def _mode(device_type: str, dtype: torch.dtype, _: int = 0) -> _HalfComputeMode:
    # The same cached plan as autocast(device, dtype): honours emulate_fp16 and the user's
    # register_half_function registrations, and costs a dict lookup per forward.
    made = plan(DEFAULT_POLICY, device_type, dtype)
    key = (id(made), device_type)
    hit = _MODES.get(key)
    if hit is not None and hit[0] is made:
        return hit[1]
    gemms = frozenset(
        name for name, action in made.actions.items() if action is Action.LOWER and made.emulate
    )
    recurrent = frozenset(name for name, action in made.actions.items()
                          if action is Action.FP32 and name in _RECURRENT)
    # torch's own GEMM family (its autocast's lower-precision list), whose half kernels a native region runs
    native_gemms = frozenset() if made.emulate else frozenset(
        name for rule in TORCH_TABLES.get(device_type, ()) if rule.action is Action.LOWER
        for name in python_names(rule.op)
    )
    # cache_enabled: a weight used several times in one forward is upcast once (see half_compute.__exit__)
    region = region_for(made, device_type, dtype, cache_enabled=True)
    mode = _HalfComputeMode(region, gemms, recurrent, native_gemms)
    if len(_MODES) >= 64:  # bounded like the plans it follows
        _MODES.clear()
    _MODES[key] = (made, mode)
    return mode


def _check_no_other_half_autocast(device_type: str, dtype: torch.dtype) -> None:
    """A half model inside an autocast region of the *other* half dtype would have its GEMMs round its
    weights to that dtype (bf16 -> fp16 overflows past 65504; fp16 -> bf16 drops 3 bits) and its norms
    fail in torch ("mixed dtype (CPU): expect parameter to have scalar type of Float"): say why here."""
    if not torch.is_autocast_enabled(device_type):
        return
    outer = torch.get_autocast_dtype(device_type)
    if outer in (torch.float16, torch.bfloat16) and outer is not dtype:
        raise ConfigError(
            f"a {dtype} model (O2/O3, to_fp16()/to_bf16(), half_compute) runs inside an autocast region of "
            f"{outer} on {device_type!r}: its GEMMs would round the {dtype} weights to {outer} (and on a "
            "CPU torch's norms fail on the mix).",
            f"use one half dtype: autocast(..., dtype={dtype}) around it, or no autocast at all (the half "
            f"model's region already runs its GEMMs in {dtype} and its sensitive ops in fp32), or cast the "
            f"model to {outer} instead.",
        )


class half_compute:  # noqa: N801 - a context manager used like autocast
    """Run a model whose weights are already half precision with tensor-core arithmetic and fp32
    sensitive ops (see the module docstring). Re-entrant; cheap to enter every forward."""

    def __init__(self, device_type: str, dtype: torch.dtype = torch.float16) -> None:
        self.device_type = device_type
        self.dtype = dtype
        self._modes: list[Any] = []

    def __enter__(self) -> half_compute:
        if torch.compiler.is_compiling():
            # registry_version(): read in the traced code, so a register_* call after compiling is a guard
            # failure (a retrace with the new plan), as in autocast's compiled regions.
            mode = compiled_mode(_mode, self.device_type, self.dtype, registry_version())
        else:
            _check_no_other_half_autocast(self.device_type, self.dtype)
            mode = _mode(self.device_type, self.dtype)
            STATE.entries += 1
            STATE.half_entries.append((mode, EntryMark.now()))
        mode.__enter__()
        self._modes.append(mode)
        return self

    def compiled_contexts(self) -> tuple[Any, Any]:
        """The region as two context managers Dynamo can resume after a graph break (it cannot resume
        this class: it would run the rest of the forward outside the region). For compiled code only."""
        mode = compiled_mode(_mode, self.device_type, self.dtype, registry_version())
        return contextlib.nullcontext(), mode

    def __exit__(self, *exc: Any) -> None:
        self._modes.pop().__exit__(*exc)
        if not torch.compiler.is_compiling():
            STATE.half_entries.pop()
            if not STATE.regions and not STATE.half_entries:
                STATE.cache.clear()  # the upcasts live for this forward only (autograd keeps its own)
